"""Curvature of real models, where no anchor runs, against the loop in float64: BERT for
classification, timm's ViT and an LSTM classifier (the exact per-sample GGN diagonal:
each sample's Jacobian by ``autograd.grad`` per output, its loss Hessian by
``torch.func.hessian``; K-FAC's factors of the ViT against module hooks, its exact
diagonals and the LSTM's against the loop's per-sample gradients) and GPT-2
with its tied embedding and output layer (K-FAC's factors of every use, empirical
Fisher, against module hooks by hand: the lookup, the Conv1D layers' ``x @ W``, the
tied ``lm_head``). Sizes coincide on purpose (B = T = heads = 4)."""

from __future__ import annotations

import torch
from torch import nn

import cases  # noqa: F401 (first: cases_recurrent imports it, and it cases_recurrent)
from cases_recurrent import LSTMClassifier
from persample import KFAC, loop_per_sample_grads, per_sample_ggn_diag
from persample.inputs import samples_of
from test_ggn_diag import ggn_diag_by_loop
from zoo import bert, causal_lm_loss, gpt2_lm, timm_vit_layerscale


class Logits(nn.Module):
    """A transformers classifier returning its logits ``(B, C)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).logits


def _assert_rows(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    assert sum(bool(w.abs().max() > 0) for w in want.values()) >= len(want) - 1  # not zeros


def test_bert_ggn_diagonal_against_the_loop():
    model, inputs, labels, _ = bert()
    model = Logits(model)
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_ggn_diag(model, inputs, labels, loss_fn)
    _assert_rows(got, ggn_diag_by_loop(model, lambda i: model(**samples_of(inputs, i, i + 1)),
                                        labels, loss_fn))


def test_timm_vit_ggn_diagonal_and_kfac_against_the_loop_and_hooks():
    """timm's ViT (patch convolution, class token, position table, LayerScale): the
    per-sample GGN diagonal against the loop; K-FAC's factors of every ``nn.Linear`` and
    the patch convolution against module hooks (empirical Fisher, expand), the rest's
    exact diagonals against the loop's squared per-sample gradients."""
    model, x, labels, _ = timm_vit_layerscale()
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_ggn_diag(model, x, labels, loss_fn)
    _assert_rows(got, ggn_diag_by_loop(model, lambda i: model(x[i:i + 1]), labels, loss_fn))

    kfac = KFAC(model, fisher="empirical")
    kfac.update(x, labels, loss_fn)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    read, grads = _hooked(model, linears, lambda: loss_fn(model(x), labels) * len(labels))
    n = len(labels)
    for name, m in linears.items():
        a, g = read[name], grads[name]
        if isinstance(m, nn.Conv2d):
            a = nn.functional.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride
                                     ).transpose(1, 2)
            g = g.flatten(2).transpose(1, 2)
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        (f,) = kfac.factors[f"{name}.weight"]
        assert f.rows == "G"
        torch.testing.assert_close(f.A, a.T @ a / len(a), rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(f.G, g.T @ g / n, rtol=1e-9, atol=1e-12, msg=name)
    loop = loop_per_sample_grads(model, x, labels, loss_fn)
    assert {"cls_token", "pos_embed", "blocks.0.ls1.gamma", "norm.weight"} <= set(
        kfac.diagonals)
    for name, d in kfac.diagonals.items():
        torch.testing.assert_close(d, loop[name].square().mean(0), rtol=1e-9, atol=1e-12,
                                   msg=name)


def test_lstm_curvature_against_the_loop():
    """A bidirectional 2-layer LSTM classifier: the per-sample GGN diagonal against the
    loop; K-FAC gives the recurrent weights their exact diagonal (no factors), equal to
    the loop's, and factors to the embedding and the output layer."""
    torch.manual_seed(0)
    model = LSTMClassifier().double()
    tokens = torch.randint(1, 13, (5, 7), generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 2, 1, 1, 0])
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_ggn_diag(model, tokens, labels, loss_fn)
    _assert_rows(got, ggn_diag_by_loop(model, lambda i: model(tokens[i:i + 1]), labels,
                                        loss_fn))
    kfac = KFAC(model, fisher="type-2")
    kfac.update(tokens, labels, loss_fn)
    recurrent = {n for n, _ in model.lstm.named_parameters()}
    assert {f"lstm.{n}" for n in recurrent} <= set(kfac.diagonals)
    assert {"emb.weight", "out.weight", "out.bias"} <= set(kfac.factors)
    for name in (f"lstm.{n}" for n in recurrent):
        torch.testing.assert_close(kfac.diagonals[name], got[name].mean(0), rtol=1e-9,
                                   atol=1e-12, msg=name)


def _hooked(model, modules, loss):
    """Each module's input and its output's gradient under ``loss()``'s backward."""
    read, grads = {}, {}

    def hook(name):
        def keep(module, args, output):
            read[name] = args[0].detach()
            output.register_hook(lambda g: grads.__setitem__(name, g.detach()))
        return keep

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        value = loss()
    finally:
        for h in handles:
            h.remove()
    torch.autograd.grad(value, [p for p in model.parameters() if p.requires_grad],
                        allow_unused=True)
    return read, grads


def test_gpt2_kfac_with_tied_weights_against_hooks():
    transformers = __import__("transformers")
    model, inputs, labels, _ = gpt2_lm()
    kfac = KFAC(model, fisher="empirical")
    kfac.update(inputs, labels, causal_lm_loss)
    factors = kfac.factors
    n = len(labels)
    watched = {name: m for name, m in model.named_modules()
               if isinstance(m, (nn.Embedding, nn.Linear, transformers.pytorch_utils.Conv1D))}
    read, grads = {}, {}

    def hook(name):
        def keep(module, args, output):
            read[name] = (args[0] if args else None)
            output.register_hook(lambda g: grads.__setitem__(name, g.detach()))
        return keep

    handles = [m.register_forward_hook(hook(name)) for name, m in watched.items()]
    try:
        out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits
    probe = logits.detach().requires_grad_(True)
    cot = torch.autograd.grad(causal_lm_loss(type(out)(logits=probe), labels).sum(), probe)[0]
    torch.autograd.grad(logits, [p for p in model.parameters() if p.requires_grad], cot,
                        allow_unused=True)

    def second_moment(t, count):
        t = t.reshape(-1, t.shape[-1])
        return t.T @ t / count

    wte = "transformer.wte"
    (lookup, head) = factors[f"{wte}.weight"]  # the tied table: the lookup, then lm_head
    ids = read[wte].reshape(-1)
    counts = torch.bincount(ids, minlength=model.config.vocab_size).double()
    torch.testing.assert_close(lookup.A, counts / ids.numel(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(lookup.G, second_moment(grads[wte], n), rtol=1e-10, atol=1e-13)
    assert (lookup.rows, head.rows) == ("A", "G")
    torch.testing.assert_close(head.A, second_moment(read["lm_head"], read["lm_head"][..., 0]
                                                     .numel()), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(head.G, second_moment(grads["lm_head"], n), rtol=1e-10,
                               atol=1e-13)
    compared = 0
    for name, m in watched.items():
        if not isinstance(m, transformers.pytorch_utils.Conv1D):
            continue
        (f,) = factors[f"{name}.weight"]
        x = read[name]
        assert f.rows == "A"  # W (in, out) of x @ W
        torch.testing.assert_close(f.A, second_moment(x, x[..., 0].numel()), rtol=1e-10,
                                   atol=1e-13)
        torch.testing.assert_close(f.G, second_moment(grads[name], n), rtol=1e-10, atol=1e-13)
        compared += 1
    assert compared == 8  # c_attn, c_proj, c_fc, mlp c_proj of 2 layers
