"""Curvature of transformers' models, where no anchor runs, against the loop in float64:
BERT for classification (the exact per-sample GGN diagonal: each sample's Jacobian by
``autograd.grad`` per output, its loss Hessian by ``torch.func.hessian``) and GPT-2
with its tied embedding and output layer (K-FAC's factors of every use, empirical
Fisher, against module hooks by hand: the lookup, the Conv1D layers' ``x @ W``, the
tied ``lm_head``). Sizes coincide on purpose (B = T = heads = 4)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import hessian

from persample import KFAC, per_sample_ggn_diag
from persample.inputs import samples_of
from zoo import bert, causal_lm_loss, gpt2_lm


class Logits(nn.Module):
    """A transformers classifier returning its logits ``(B, C)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).logits


def test_bert_ggn_diagonal_against_the_loop():
    model, inputs, labels, _ = bert()
    model = Logits(model)
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_ggn_diag(model, inputs, labels, loss_fn)
    params = dict(model.named_parameters())
    for i in range(len(labels)):
        out = model(**samples_of(inputs, i, i + 1))[0]  # (C,)
        h = hessian(lambda o, i=i: loss_fn(o[None], labels[i:i + 1]))(out.detach())
        jac = [torch.autograd.grad(out[c], list(params.values()), retain_graph=True,
                                   allow_unused=True) for c in range(len(out))]
        for k, (name, p) in enumerate(params.items()):
            j = torch.stack([torch.zeros_like(p) if row[k] is None else row[k] for row in jac])
            want = torch.einsum("c...,cd,d...->...", j, h, j)
            torch.testing.assert_close(got[name][i], want, rtol=1e-9, atol=1e-12, msg=name)


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
