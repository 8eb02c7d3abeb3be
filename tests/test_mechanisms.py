"""Mechanisms real models use, each exact and on the fast path: parametrizations,
checkpointing (reentrant or not), multiple-choice reshapes, mixture-of-experts routing
(top-k gates, tokens picked with ``nonzero``/``where``/masks and scattered back with
``index_add_``; tokens sorted by expert), a fused qkv indexed with a list, ALiBi
attention (``baddbmm``), NFNet's standardised weights, ``torch.compile``, graph batches
(``PackedRows``, torch_geometric's ``Batch``: message passing by node ids, pooling by
the batch vector), and the same mechanisms in transformers' BLOOM, MPT, Mixtral and
Qwen2-MoE built from small configs.

Every model goes through ``battery.check``: against the loop over samples in float64,
``per_sample_grads`` and ``per_sample_grad_norms`` (total and per parameter) with the
rules and ``auto``, ``private_grad`` (noise 0, against the loop's clipped mean), with no
fallback warning, ``supported`` reporting the path of every parameter, and the model
left as it was. Sizes coincide on purpose: batch = sequence length = heads = experts =
choices = nodes per graph.
"""

from __future__ import annotations

import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import persample
import zoo
from battery import assert_exact, check, flat, module_paths
from persample import PackedRows, loop_per_sample_grads, per_sample_grads
from persample.batch import SHARED, Batched, Ctx, Mixed, Unknown, propagate
from persample.batch.ops_indexing import Partly, Sorted

B = T = H = EXPERTS = CHOICES = 4  # coinciding on purpose
E = 8


def mse(out, y):
    return ((out - y) ** 2).flatten(1).sum(1)


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


# ---------------------------------------------------------------------------
# parametrizations, checkpointing, multiple choice


def parametrized() -> nn.Module:
    """weight_norm, spectral_norm (eval: no power iteration) and orthogonal
    (Householder, its sign read through ``.int()``) on three Linear layers."""
    torch.manual_seed(0)
    return nn.Sequential(parametrizations.weight_norm(nn.Linear(E, E)), nn.Tanh(),
                         parametrizations.spectral_norm(nn.Linear(E, E)), nn.Tanh(),
                         parametrizations.orthogonal(nn.Linear(E, 3))).eval()


def test_parametrizations():
    check(parametrized(), torch.randn(B, E), torch.randn(B, 3), mse)


def test_a_forward_that_updates_its_buffers_is_certified_from_where_it_began():
    """spectral_norm in training mode (an SN-GAN's discriminator) runs a power iteration
    at every forward, writing its ``u`` and ``v`` buffers in place: the batch forward's
    weights are those of that iteration. The rules give each sample's gradient at the
    forward that ran (one batch forward, ``autograd.grad`` of each sample's loss); the
    certificate's reference forward starts from the buffers where the call began, so
    it runs the same function and certifies it, where it had run another iteration
    and rejected the result. The buffers are left as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(E, E)), nn.Tanh(),
                          nn.Linear(E, 3)).double().train()
    x, y = torch.randn(B, E, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    before = [b.clone() for b in model.buffers()]
    want = persample.forward_per_sample_grads(model, x, y, mse)
    for b, v in zip(model.buffers(), before):
        b.copy_(v)
    for method in ("rules", "auto"):
        got = per_sample_grads(model, x, y, mse, method=method)  # (certified: check="first")
        assert_exact(got, want)
        assert all(torch.equal(b, v) for b, v in zip(model.buffers(), before))
    persample.verify(model, x, y, mse)  # (its own certificate of the rules: no rejection
    assert_exact(per_sample_grads(model, x, y, mse, method="rules"), want)  # kept)
    assert all(torch.equal(b, v) for b, v in zip(model.buffers(), before))
    assert {r.path for r in persample.supported(model, x, y, mse)} == {"rule"}


class Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` between two Linear layers."""

    def __init__(self, reentrant: bool, first: bool = True):
        super().__init__()
        self.first = nn.Linear(E, E) if first else nn.Identity()
        self.block = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E), nn.GELU())
        self.head = nn.Linear(E, 3)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.block, self.first(x), use_reentrant=self.reentrant)
        return self.head(h).sum(1)


def backward_loop(model: nn.Module, x: Tensor, y: Tensor, loss_fn) -> dict[str, Tensor]:
    """Each sample's ``loss.backward()`` into ``p.grad``: the reference where
    ``autograd.grad`` cannot run (a reentrant checkpoint refuses it)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    found = {n: p.new_zeros((len(x), *p.shape)) for n, p in params.items()}
    for i in range(len(x)):
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        for n, p in params.items():
            if p.grad is not None:
                found[n][i] = p.grad
            p.grad = None
    return found


def test_checkpoint_non_reentrant():
    torch.manual_seed(0)
    check(Checkpointed(reentrant=False), torch.randn(B, T, E), torch.randn(B, 3), mse)


def test_checkpoint_reentrant_is_on_the_rules():
    """The reentrant checkpoint runs its function under ``no_grad`` inside a custom
    autograd Function and again in the backward (which ``autograd.grad`` refuses): while
    persample captures, it runs as the function itself, so every parameter is on a rule;
    the checkpoint is itself again afterwards."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    x, y = torch.randn(B, T, E), torch.randn(B, 3)
    want = backward_loop(model, x, y, mse)
    check(model, x, y, mse, want=want)
    for method in ("loop", "vmap"):  # the slower methods run it as the function too
        check(model, x, y, mse, want=want, methods=(method,), dp=False, paths=None)
        assert "apply" not in CheckpointFunction.__dict__
    with pytest.raises(RuntimeError, match="use_reentrant=True"):  # plain autograd.grad
        torch.autograd.grad(mse(model(x), y).sum(), list(model.parameters()))


def test_checkpoint_reentrant_without_inputs_requiring_grad():
    """No input requires grad: the checkpoint passes no gradient inside (the block's
    parameters get zeros), exactly as in plain training."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True, first=False)
    x, y = torch.randn(B, T, E), torch.randn(B, 3)
    want = backward_loop(model, x, y, mse)
    assert all(not bool(want[n].any()) for n in want if n.startswith("block"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
        check(model, x, y, mse, want=want, paths=module_paths(
            model, {"block.0": "fallback", "block.1": "fallback", "head": "rule"}))


class HalvedInPlace(nn.Module):
    """A linear map of a slice of a table handed in, part of it divided in place (which
    takes the per-module fallback), against the samples' keys."""

    def __init__(self):
        super().__init__()
        self.keys, self.pos_q_proj = nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: Tensor, table: Tensor) -> Tensor:  # (b, T, E), (2 T, E)
        pos = self.pos_q_proj(table[:T]).unsqueeze(0)  # (1, T, E)
        pos[:, :2] /= 2.0
        return self.keys(x) @ pos.transpose(1, 2)  # (b, T, T)


class ReturnedTwice(nn.Module):
    """An encoder holding the table and returning its last state twice, as transformers'
    ``last_hidden_state`` and the last of its ``hidden_states``; the model reads the
    first."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(2 * T, E)
        self.att = HalvedInPlace()

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        h = self.att(x, self.table.weight)
        return h, (x, h)


class OnTopOfTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = ReturnedTwice()

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x)[0].sum(-1)  # (b, T)


def test_a_fallback_call_returning_a_tensor_twice_takes_its_gradient_once():
    """A per-module fallback call whose output holds one tensor twice (transformers'
    encoders: ``last_hidden_state`` and the last of ``hidden_states``) gets that tensor's
    gradient once (DeBERTa's position table's per-sample gradients were twice the
    loop's)."""
    torch.manual_seed(0)
    model = OnTopOfTwice()
    x, y = torch.randn(B, T, E), torch.randn(B, T)
    check(model, x, y, mse, paths=module_paths(model, {
        "encoder.table": "fallback", "encoder.att.pos_q_proj": "fallback",
        "encoder.att.keys": "rule"}))


class DividedThroughAView(nn.Module):
    """A projection of a parameter table, viewed as heads and divided in place through
    that view (DeBERTa's position-to-content term), against the samples' keys; with
    ``read``: the projection read again through its base after the division (``"base"``),
    or a slice of it divided instead of the whole (``"slice"``)."""

    def __init__(self, read: str = ""):
        super().__init__()
        self.read = read
        self.keys, self.proj = nn.Linear(E, E), nn.Linear(E, E)
        self.table = nn.Parameter(torch.randn(2 * T, E))

    def forward(self, x: Tensor) -> Tensor:  # (b, T, E)
        base = self.proj(self.table[:T])  # (T, E)
        heads = base.view(T, 2, E // 2).permute(1, 0, 2)  # (2, T, E / 2)
        if self.read == "slice":
            heads[:, :2] /= 2.0
        else:
            heads /= 2.0
        k = self.keys(x).view(x.shape[0], T, 2, E // 2).transpose(1, 2)  # (b, 2, T, E / 2)
        out = (k @ heads.transpose(1, 2)).sum((1, 3))  # (b, T)
        if self.read == "base":
            out = out + (self.keys(x) @ base.T).sum(-1)
        return out


@pytest.mark.parametrize("read", ["", "base", "slice"])
def test_a_derived_tensor_divided_in_place_through_a_view(read):
    """A view covering all of a tensor made from parameters, written in place, makes a
    derived tensor of the write (the rules take it); the base read again after the write
    (found changed since its op made it), or a slice written, take the per-module
    fallback: exact either way."""
    torch.manual_seed(0)
    model = DividedThroughAView(read)
    x, y = torch.randn(B, T, E), torch.randn(B, T)
    if read:
        check(model, x, y, mse, paths=None, forbid=None)
        assert any(r.path == "fallback" for r in persample.supported(model, x, y, mse))
    else:
        check(model, x, y, mse)


def test_deberta_v1_position_to_content_is_exact():
    """transformers' DeBERTa (v1) with its position-to-content term (its relative
    position table's projection divided in place through its heads' view), whose
    encoder returns its last state twice: on the rules and exact, at an initialisation
    where the table's gradients are small next to the others' (where the certificate's
    floor for them let a 2x error of the per-module fallback through)."""
    transformers = zoo.require("transformers")
    torch.manual_seed(0)
    config = transformers.DebertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=H,
        intermediate_size=32, max_position_embeddings=32, num_labels=4,
        relative_attention=True, max_relative_positions=8, pos_att_type=["p2c"],
        initializer_range=0.01)
    model = transformers.DebertaForSequenceClassification(config).eval()
    inputs, y = {"input_ids": torch.randint(3, 50, (B, 2 * T))}, torch.randint(0, 4, (B,))

    def loss(out, y):
        return F.cross_entropy(out.logits, y, reduction="none")

    check(model, inputs, y, loss, dp=False)


class MultipleChoice(nn.Module):
    """SWAG-style ``(B, C, T)`` token ids scored as ``(B*C, T)`` rows, back to ``(B, C)``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, E)
        self.mix = nn.Linear(E, E)
        self.score = nn.Linear(E, 1)

    def forward(self, ids: Tensor) -> Tensor:
        b, c, t = ids.shape
        h = torch.tanh(self.mix(self.emb(ids.view(b * c, t))))  # (B*C, T, E)
        return self.score(h.mean(1)).view(b, c)


def test_multiple_choice():
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (B, CHOICES, T))
    check(MultipleChoice(), ids, torch.tensor([0, 3, 1, 2]), ce)


# ---------------------------------------------------------------------------
# mixture of experts


class TopKMoE(nn.Module):
    """Top-2 of 4 experts by softmax gates over the merged ``(B*T, E)`` tokens; each
    expert's tokens picked by ``where`` (Mixtral), ``nonzero`` or a boolean mask, its
    output weighted by its gate and scattered back with ``index_add_`` into zeros made
    from sizes (``zeros(B*T, E)``) or from the tokens (``zeros_like``)."""

    def __init__(self, pick: str, target: str = "zeros"):
        super().__init__()
        self.gate = nn.Linear(E, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(),
                                                   nn.Linear(2 * E, E)) for _ in range(EXPERTS))
        self.out = nn.Linear(E, 3)
        self.pick, self.target = pick, target

    def forward(self, x: Tensor) -> Tensor:
        b, t, e = x.shape
        h = x.reshape(-1, e)  # (B*T, E)
        weights, chosen = self.gate(h).softmax(-1).topk(2, dim=-1)  # (B*T, 2)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(b * t, e) if self.target == "zeros" else torch.zeros_like(h)
        mask = F.one_hot(chosen, EXPERTS).permute(2, 1, 0)  # (EXPERTS, 2, B*T)
        for k, expert in enumerate(self.experts):
            if self.pick == "where":
                slot, rows = torch.where(mask[k])
            elif self.pick == "nonzero":
                rows, slot = (chosen == k).nonzero(as_tuple=True)
            else:
                hit = chosen == k  # (B*T, 2)
                rows = torch.arange(b * t)[hit.any(-1)]
                slot = hit[rows].long().argmax(-1)
            out.index_add_(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return self.out(torch.tanh(out.view(b, t, e) + x)).sum(1)


@pytest.mark.parametrize("pick, target", [("where", "zeros"), ("nonzero", "zeros_like"),
                                          ("mask", "zeros")])
def test_top_k_mixture_of_experts(pick, target):
    torch.manual_seed(0)
    check(TopKMoE(pick, target), torch.randn(B, T, E), torch.randn(B, 3), mse)


class SortedMoE(nn.Module):
    """Top-1 routing with the tokens sorted by expert (``argsort``), cut into the
    experts' groups with ``split(bincount)``, and put back in order by assignment
    (``out[order] = y``) or by the inverse permutation (``y[order.argsort()]``)."""

    def __init__(self, unsort: str):
        super().__init__()
        self.gate = nn.Linear(E, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(E, E) for _ in range(EXPERTS))
        self.out = nn.Linear(E, 3)
        self.unsort = unsort

    def forward(self, x: Tensor) -> Tensor:
        b, t, e = x.shape
        h = x.reshape(-1, e)
        weight, chosen = self.gate(h).softmax(-1).max(-1)  # (B*T,)
        order = chosen.argsort()
        counts = torch.bincount(chosen, minlength=EXPERTS).tolist()
        y = torch.cat([ex(part) for ex, part in zip(self.experts, h[order].split(counts))])
        if self.unsort == "assign":
            back = torch.empty_like(y)
            back[order] = y
        else:
            back = y[order.argsort()]
        return self.out(back.view(b, t, e) * weight.view(b, t, 1)).sum(1)


@pytest.mark.parametrize("unsort", ["assign", "inverse"])
def test_mixture_of_experts_sorted_by_expert(unsort):
    torch.manual_seed(0)
    check(SortedMoE(unsort), torch.randn(B, T, E), torch.randn(B, 3), mse)


class ExpertChoice(nn.Module):
    """Each expert picks its top tokens across the whole batch: a sample's tokens are
    chosen by comparing them with other samples' (the samples interact)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(E, 2, bias=False)
        self.expert = nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        b, t, e = x.shape
        h = x.reshape(-1, e)
        scores = self.gate(h)[:, 0]  # (B*T,)
        _, top = scores.topk(b * t // 2)
        out = torch.zeros_like(h).index_add_(0, top, self.expert(h[top]))
        return out.view(b, t, e).sum(1)


def test_routing_that_compares_samples_is_refused_by_rules_and_auto():
    """Expert-choice routing picks tokens across the batch: samples mix, so ``auto``
    refuses too (the loop's each-sample-alone answer fails the certificate); the loop
    answers when asked for."""
    torch.manual_seed(0)
    model = ExpertChoice()
    x, y = torch.randn(B, T, E), torch.randn(B, E)
    with pytest.raises(ValueError, match="topk selects positions of several samples"):
        per_sample_grads(model, x, y, mse, method="rules")
    with pytest.warns(UserWarning, match="topk selects positions"):
        with pytest.raises(persample.CertificateError, match="mixes samples.*topk"):
            per_sample_grads(model, x, y, mse)
    got = per_sample_grads(model, x, y, mse, method="loop")
    assert_exact(got, loop_per_sample_grads(model, x, y, mse))


# ---------------------------------------------------------------------------
# attention: a fused qkv indexed with a list, ALiBi


class FusedQKV(nn.Module):
    """A fused ``(B, T, 3, H, d)`` projection; queries picked with a list in a later dim
    (``qkv[..., [0], :, :]``) and the last position with ``o[..., [-1], :]``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, H, E // H)
        q = qkv[..., [0], :, :].squeeze(2)
        k, v = qkv[:, :, 1], qkv[:, :, 2]
        att = torch.einsum("bthd,bshd->bhts", q, k).softmax(-1)
        o = torch.einsum("bhts,bshd->bthd", att, v).reshape(b, t, E)
        return self.out(o[..., [-1], :]).sum(1)


class ALiBi(nn.Module):
    """BLOOM-style attention with linear biases (Press et al. 2022, "Train Short, Test
    Long"): a slope per head times the key positions made from the padding mask,
    ``(B*H, 1, T)``, added by ``baddbmm`` with its operands by keyword."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, 3)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / H)
                                                     for i in range(H)]))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, t, e = x.shape
        d = e // H
        positions = ((mask.cumsum(-1) - 1) * mask)[:, None, :]  # (B, 1, T)
        alibi = (self.slopes[None, :, None] * positions).reshape(b * H, 1, t)
        q, k, v = self.qkv(x).view(b, t, 3, H, d).permute(2, 0, 3, 1, 4).reshape(
            3, b * H, t, d).unbind(0)
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0,
                               alpha=1 / math.sqrt(d))  # (B*H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.bmm(scores.softmax(-1), v).view(b, H, t, d).transpose(1, 2).reshape(b, t, e)
        return self.out(o).sum(1)


def test_fused_qkv_indexed_with_a_list():
    torch.manual_seed(0)
    check(FusedQKV(), torch.randn(B, T, E), torch.randn(B, 3), mse)


def test_alibi_attention():
    torch.manual_seed(0)
    mask = torch.ones(B, T)
    mask[0, -1] = 0
    check(ALiBi(), (torch.randn(B, T, E), mask), torch.randn(B, 3), mse)


# ---------------------------------------------------------------------------
# weight standardisation (NFNets)


class ScaledStdConv(nn.Module):
    """NFNet's ``ScaledStdConv2d`` (Brock et al. 2021) by hand: the weight standardised
    per output channel with ``batch_norm`` in the forward, times a learned gain."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.gain = nn.Parameter(torch.rand(4, 1, 1, 1) + 0.5)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        w = F.batch_norm(self.weight.reshape(1, 4, -1), None, None,
                         weight=(self.gain * 27 ** -0.5).view(-1), training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, padding=1).flatten(1)


def timm_scaled_std_conv() -> nn.Module:
    from zoo import require

    timm = require("timm")
    torch.manual_seed(0)
    return nn.Sequential(timm.layers.ScaledStdConv2d(3, 4, 3, padding=1), nn.Flatten())


@pytest.mark.parametrize("make", [ScaledStdConv, timm_scaled_std_conv], ids=["hand", "timm"])
def test_scaled_std_conv(make):
    torch.manual_seed(0)
    check(make(), torch.randn(B, 3, T, T), torch.randn(B, 4 * T * T), mse)


# ---------------------------------------------------------------------------
# torch.compile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.fc(x)))).sum(1)


@pytest.mark.parametrize("form", ["block", "model", "fullgraph"])
def test_compiled_module_is_exact_without_recompiling(form):
    """While persample captures, compiled code runs eagerly, its ops one by one, and
    TorchDynamo never traces persample's own work: exact, no recompilation, no warning,
    every parameter on a rule, also under ``fullgraph=True`` (no graph break to refuse);
    afterwards the model compiles as before."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    if form == "block":
        model = nn.Sequential(nn.Linear(E, E), torch.compile(Block(), backend="eager"))
    else:
        model = torch.compile(nn.Sequential(nn.Linear(E, E), Block()), backend="eager",
                              fullgraph=form == "fullgraph")
    x, y = torch.randn(B, T, E), torch.randn(B, 3)
    want = loop_per_sample_grads(model, x, y, mse)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_exact(per_sample_grads(model, x, y, mse), want)
    assert not caught, [str(w.message) for w in caught]
    assert not counters["stats"] and not counters["recompiles"]
    check(model, x, y, mse, want=want)
    torch._dynamo.reset()
    counters.clear()
    model(x)
    assert counters["stats"]["unique_graphs"] == 1  # compiled again outside the capture


# ---------------------------------------------------------------------------
# graph batches and packed rows


class DeepSets(nn.Module):
    """A set model (Zaheer et al. 2017) on ``PackedRows``: rows of every sample, summed
    per sample with ``index_add_`` into ``(num_samples, F)``."""

    def __init__(self):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(3, E), nn.Tanh())
        self.rho = nn.Linear(E, 2)

    def forward(self, rows: PackedRows) -> Tensor:
        h = self.phi(rows.data)
        return self.rho(torch.zeros(rows.num_samples, E).index_add_(0, rows.sample_index, h))


def test_packed_rows():
    torch.manual_seed(0)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 3, 0, 1, 3])  # unsorted, counts 3, 2, 3, 2
    check(DeepSets(), PackedRows(torch.randn(10, 3), index, B), torch.randn(B, 2), mse)


def graph_batch(directed: bool = False):
    """torch_geometric's ``Batch`` of 4 graphs of 4 nodes (= batch size): a ring, both
    ways unless ``directed`` (then node 0 of each graph receives no message), and two
    random edges."""
    from zoo import require

    require("torch_geometric")
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(B):
        ring = torch.arange(4)
        edges = [torch.stack([ring, (ring + 1) % 4])]
        if directed:
            edges = [torch.tensor([[0, 1, 2, 1], [1, 2, 3, 3]])]
        else:
            edges += [torch.stack([(ring + 1) % 4, ring]), torch.randint(0, 4, (2, 2), generator=g)]
        graphs.append(Data(x=torch.randn(4, 3, generator=g, dtype=torch.float64),
                           edge_index=torch.cat(edges, 1)))
    return Batch.from_data_list(graphs)


class HandGIN(nn.Module):
    """GIN (Xu et al. 2019) by hand: messages gathered by source node ids, summed into
    their target nodes with ``index_add_``, ``(1 + eps) x + sum``, pooled per graph by the
    batch vector."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, E), nn.ReLU(), nn.Linear(E, E))
        self.eps = nn.Parameter(torch.tensor(0.1))
        self.head = nn.Linear(E, 2)

    def forward(self, data) -> Tensor:
        x, (src, dst) = data.x, data.edge_index
        summed = torch.zeros_like(x).index_add_(0, dst, x.index_select(0, src))
        h = self.mlp((1 + self.eps) * x + summed)
        return self.head(torch.zeros(data.num_graphs, E).index_add_(0, data.batch, h))


class PyGNet(nn.Module):
    """torch_geometric's own ``GCNConv`` (self loops, symmetric degree normalisation) or
    ``GINConv``, then ``global_mean_pool``."""

    def __init__(self, kind: str):
        super().__init__()
        from torch_geometric.nn import GCNConv, GINConv

        self.conv = GCNConv(3, E) if kind == "gcn" else GINConv(
            nn.Sequential(nn.Linear(3, E), nn.ReLU(), nn.Linear(E, E)), train_eps=True)
        self.head = nn.Linear(E, 2)

    def forward(self, data) -> Tensor:
        from torch_geometric.nn import global_mean_pool

        h = torch.relu(self.conv(data.x, data.edge_index))
        return self.head(global_mean_pool(h, data.batch))


@pytest.mark.parametrize("make, directed", [
    (HandGIN, False), (HandGIN, True), (lambda: PyGNet("gcn"), False),
    (lambda: PyGNet("gin"), False), (lambda: PyGNet("gin"), True)],
    ids=["hand-gin", "hand-gin-directed", "pyg-gcn", "pyg-gin", "pyg-gin-directed"])
def test_graph_batches(make, directed):
    """Per-graph gradients: each graph a sample, its nodes and edges found by data flow
    from the batch's ``batch`` vector and per-graph offsets (nodes that receive no
    message take their sample where their own features are added)."""
    batch = graph_batch(directed)
    torch.manual_seed(0)
    check(make(), batch, torch.randn(B, 2), mse)


# ---------------------------------------------------------------------------
# the data-flow rules themselves


def flow(func, args, kwargs, out, layouts):
    ctx = Ctx(B, lambda t: next((lay for x, lay in layouts if x is t), SHARED))
    return propagate(ctx, func, args, kwargs, out).outputs


def test_nonzero_gives_each_position_its_sample():
    chosen = torch.tensor([0, 1, 1, 2, 3, 1, 0, 0, 2, 2, 1, 3, 0, 3, 3, 1])  # (B*T,)
    merged = Batched(0, inner=T)
    hit = chosen == 1
    rows = hit.nonzero(as_tuple=True)[0]  # positions 1, 2, 5, 10, 15
    got = flow(torch.Tensor.nonzero, (hit,), {"as_tuple": True}, (rows,), [(hit, merged)])
    assert got[0] == Batched(0, index=torch.tensor([0, 0, 1, 2, 3]))
    hidden = torch.randn(B * T, E)
    picked = hidden[rows]
    assert flow(torch.Tensor.__getitem__, (hidden, rows), {}, picked,
                [(hidden, merged), (rows, got[0])]) == got[0]
    # the same rows named by another sample's index entries: mixed
    wrong = Batched(0, index=torch.tensor([0, 1, 1, 2, 3]))
    assert isinstance(flow(torch.Tensor.__getitem__, (hidden, rows), {}, picked,
                           [(hidden, merged), (rows, wrong)]), Mixed)


def test_index_add_rows_get_the_samples_landing_in_them():
    merged = Batched(0, inner=T)
    rows = torch.tensor([1, 2, 5, 10, 15])
    own = Batched(0, index=torch.tensor([0, 0, 1, 2, 3]))
    src = torch.randn(5, E)
    target = torch.zeros(B * T, E)
    out = target.clone().index_add_(0, rows, src)
    got = flow(torch.Tensor.index_add, (target, 0, rows, src), {}, out, [(rows, own), (src, own)])
    assert isinstance(got, Partly) and got.rows.tolist()[:6] == [-1, 0, 0, -1, -1, 1]
    # every row reached: the merged layout; a row written by two samples: mixed
    everything, hidden = torch.arange(B * T), torch.randn(B * T, E)
    assert flow(torch.Tensor.index_add, (target, 0, everything, hidden), {}, hidden,
                [(everything, merged), (hidden, merged)]) == merged
    two = Batched(0, index=torch.tensor([0, 0, 1, 2, 2]))
    clash = torch.tensor([1, 2, 5, 10, 10])
    assert isinstance(flow(torch.Tensor.index_add, (target, 0, clash, src), {}, out,
                           [(clash, two), (src, Batched(0, index=torch.tensor([0, 1, 1, 2, 3])))]),
                      Mixed)


def test_an_index_naming_samples_makes_rows_samples():
    """``zeros(B, F).index_add_(0, sample_index, h)``: row g is sample g, also a sample
    with no rows (sample 3 here); the same values naming rows of another kind do not."""
    index = torch.tensor([0, 0, 1, 2, 2])
    packed = Batched(0, index=index)
    h = torch.randn(5, E)
    out = torch.zeros(B, E).index_add_(0, index, h)
    got = flow(torch.Tensor.index_add, (torch.zeros(B, E), 0, index, h), {}, out,
               [(index, packed), (h, packed)])
    assert got == Batched(0)
    node_ids = torch.tensor([1, 1, 2, 3, 3])  # values are positions, not samples
    got = flow(torch.Tensor.index_add, (torch.zeros(B, E), 0, node_ids, h), {}, out,
               [(node_ids, packed), (h, packed)])
    assert isinstance(got, Partly) and got.rows.tolist() == [-1, 0, 1, 2]  # row 0: none


def test_gathers_and_scatters_by_node_ids():
    """Graph batches: node rows gathered by the source ids of edges (``gather``,
    ``index_select``), reduced into target nodes (``scatter_reduce``, PyG's max
    aggregation), written back by ``index_put_``; each edge or node is its graph's."""
    nodes = Batched(0, index=torch.tensor([0, 0, 1, 1, 2, 3, 3, 3]))
    edges = Batched(0, index=torch.tensor([0, 1, 1, 2, 3, 3]))
    src = torch.tensor([1, 2, 3, 4, 5, 7])
    x = torch.randn(8, E)
    ids = src[:, None].expand(6, E)
    lays = [(x, nodes), (src, edges), (ids, edges)]
    assert flow(torch.gather, (x, 0, ids), {}, x.gather(0, ids), lays) == edges
    assert flow(torch.Tensor.index_select, (x, 0, src), {}, x.index_select(0, src), lays) == edges
    wrong = torch.tensor([1, 2, 3, 4, 5, 0])  # the last edge of graph 3 reads graph 0's node
    assert isinstance(flow(torch.Tensor.index_select, (x, 0, wrong), {}, x.index_select(0, wrong),
                           [(x, nodes), (wrong, edges)]), Mixed)
    best = x[:, 0].argmax(0, keepdim=True)  # a row chosen by comparing every sample's data
    assert isinstance(flow(torch.Tensor.index_select, (x, 0, best), {}, x.index_select(0, best),
                           [(x, nodes), (best, Mixed("argmax over the batch"))]), Mixed)
    dst = torch.tensor([0, 3, 2, 4, 6, 6])[:, None].expand(6, E)
    msg = torch.randn(6, E)
    out = torch.zeros(8, E).scatter_reduce(0, dst, msg, "amax", include_self=False)
    got = flow(torch.scatter_reduce, (torch.zeros(8, E), 0, dst, msg, "amax"),
               {"include_self": False}, out, [(dst, edges), (msg, edges)])
    assert isinstance(got, Partly) and got.rows.tolist() == [0, -1, 1, 1, 2, -1, 3, -1]
    full = torch.zeros(8, E)
    put = full.clone().index_put_((torch.arange(8),), x)
    assert flow(torch.Tensor.index_put_, (full, (torch.arange(8),), x), {}, put,
                [(x, nodes)]) == nodes
    mask = x[:, 0] > 0
    picked = x.masked_select(mask[:, None])
    got = flow(torch.masked_select, (x, mask[:, None]), {}, picked,
               [(x, nodes), (mask, nodes)])
    assert got == Batched(0, index=nodes.index[mask].repeat_interleave(E))


def test_a_sort_keeps_each_position_its_sample():
    keys = torch.tensor([3, 0, 2, 1, 0, 0, 3, 2])  # (B*T,) with T = 2
    merged = Batched(0, inner=2)
    values, order = keys.sort()
    got = flow(torch.Tensor.sort, (keys,), {}, (values, order), [(keys, merged)])
    assert isinstance(got[1], Sorted) and got[1] == Batched(0, index=order // 2)
    # topk over the batch picks some samples' positions by comparing them: mixed
    top = keys.topk(3)
    assert isinstance(flow(torch.Tensor.topk, (keys, 3), {}, top, [(keys, merged)])[1], Mixed)


def test_cuts_of_the_batch_dim_follow_only_sort_keys():
    """``split(bincount)`` of positions sorted by key cuts where each piece holds one
    key; other cuts of an irregular batch dim, or of a plain one, are not followed."""
    keys = torch.tensor([2, 0, 0, 1, 2, 0, 1, 1])
    values, order = keys.sort()
    lay = Sorted(0, index=order // 2, keys=values)
    x = torch.randn(8, E)
    counts = torch.bincount(keys).tolist()  # [3, 3, 2]
    pieces = x.split(counts)
    got = flow(torch.Tensor.split, (x, counts), {}, pieces, [(x, lay)])
    assert [g.index.tolist() for g in got] == [[0, 1, 2], [1, 3, 3], [0, 2]]
    for cut, lay_x in (([4, 4], lay), ([4, 4], Batched(0, inner=2)),
                       ([4, 4], Batched(0, index=order // 2))):
        assert all(isinstance(g, Unknown) for g in flow(torch.Tensor.split, (x, cut), {},
                                                        x.split(cut), [(x, lay_x)]))


def test_free_positions_of_an_irregular_dim_are_not_picked():
    """Rows of packed samples picked by shared positions depend on where other samples'
    rows lie: not followed, except a permutation of all of them."""
    packed = Batched(0, index=torch.tensor([0, 0, 1, 2, 2, 3]))
    x = torch.randn(6, E)
    first = torch.tensor([0, 1, 2])
    assert isinstance(flow(torch.Tensor.__getitem__, (x, first), {}, x[first], [(x, packed)]),
                      Unknown)
    perm = torch.tensor([5, 4, 3, 2, 1, 0])
    assert flow(torch.Tensor.__getitem__, (x, perm), {}, x[perm], [(x, packed)]) == Batched(
        0, index=torch.tensor([3, 2, 2, 1, 0, 0]))
    twice = torch.tensor([0, 0, 2, 3, 4, 5])  # (as many as the rows, one of them twice)
    assert isinstance(flow(torch.Tensor.__getitem__, (x, twice), {}, x[twice],
                           [(x, packed)]), Unknown)


def test_one_position_per_sample_is_a_permutation():
    from persample.batch.layouts import nonnegative, one_per_sample

    assert one_per_sample(torch.tensor([2, 0, 1]), 3)
    assert not one_per_sample(torch.tensor([0, 0, 2]), 3)  # (one twice, one missing)
    assert not one_per_sample(torch.tensor([0, 1]), 3)
    assert nonnegative(torch.tensor([0, 2])) and nonnegative(torch.tensor([], dtype=torch.long))
    assert not nonnegative(torch.tensor([3, -1]))  # (a position of no sample)


def test_free_rows_are_completed_by_the_data_added_to_them():
    """A row nothing landed in holds no sample's data; adding a batched tensor there
    gives it that tensor's sample (GIN's ``(1 + eps) x + sum`` at a node with no
    incoming edge)."""
    rows = torch.tensor([0, 1, 1, 2])
    partial = Partly("a scatter", 0, torch.tensor([0, -1, 1, 2]))
    x = torch.randn(4, E)
    agg = torch.randn(4, E)
    out = agg + x
    lay = Partly(partial.why, 0, partial.rows, weakref.ref(agg))
    got = flow(torch.Tensor.add, (agg, x), {}, out, [(agg, lay), (x, Batched(0, index=rows))])
    assert got == Batched(0, index=rows)
    # the layout describes its own tensor only: passed on to another, it is unknown
    assert isinstance(flow(torch.Tensor.add, (agg, x), {}, out, [(agg, partial),
                                                                 (x, Batched(0, index=rows))]),
                      Unknown)


def test_rows_no_sample_reaches_are_never_guessed():
    """Scattered into rows of a tensor built from sizes, with some rows never written
    (a node no edge reaches, nothing added later): the output cannot be split by sample,
    supported says so, and auto is exact."""

    class Scattered(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(E, E)

        def forward(self, x: Tensor) -> Tensor:
            b = x.shape[0]
            dst = torch.arange(b) * 2  # rows 0, 2, 4, 6 of 2B: odd rows stay empty
            return torch.zeros(2 * b, E).index_add_(0, dst, self.fc(x)).view(b, 2 * E)

    torch.manual_seed(0)
    model = Scattered()
    x, y = torch.randn(B, E), torch.randn(B, 2 * E)
    assert {r.path for r in persample.supported(model, x, y, mse)} == {"vmap"}
    with pytest.warns(UserWarning, match="no sample's data"):
        got = per_sample_grads(model, x, y, mse)
    assert_exact(got, loop_per_sample_grads(model, x, y, mse))


# ---------------------------------------------------------------------------
# the same mechanisms in transformers models (small configs, random weights)


def _hf(name: str, config):
    from zoo import _hf as build

    return build(name, config)


def text():
    from zoo import VOCAB, _text

    inputs, labels = _text()
    return inputs, labels, VOCAB


def causal_lm_loss(out, labels):
    from zoo import causal_lm_loss as loss

    return loss(out, labels)


def bloom():
    from zoo import require

    transformers = require("transformers")
    inputs, labels, vocab = text()
    config = transformers.BloomConfig(vocab_size=vocab, hidden_size=16, n_layer=2, n_head=H)
    return _hf("BloomForCausalLM", config), inputs, labels


def mpt():
    from zoo import require

    transformers = require("transformers")
    inputs, labels, vocab = text()
    config = transformers.MptConfig(vocab_size=vocab, d_model=16, n_layers=2, n_heads=H,
                                    max_seq_len=16, expansion_ratio=2)
    return _hf("MptForCausalLM", config), inputs, labels


def mixtral(experts: str = "batched_mm"):
    from zoo import require

    transformers = require("transformers")
    inputs, labels, vocab = text()
    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=2, max_position_embeddings=16, experts_implementation=experts)
    return _hf("MixtralForCausalLM", config), inputs, labels


def qwen2_moe(experts: str = "batched_mm"):
    from zoo import require

    transformers = require("transformers")
    inputs, labels, vocab = text()
    config = transformers.Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=16, experts_implementation=experts)
    return _hf("Qwen2MoeForCausalLM", config), inputs, labels


def gpt2_reentrant_checkpointing():
    """GPT-2 with ``gradient_checkpointing_enable(use_reentrant=True)`` (the default of
    older transformers), in training mode (checkpointing is off in eval) without dropout."""
    from zoo import gpt2_config

    inputs, labels, _ = text()
    model = _hf("GPT2LMHeadModel", gpt2_config(resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train(), inputs, labels


@pytest.mark.slow
@pytest.mark.parametrize("make", [bloom, mpt, mixtral, qwen2_moe],
                         ids=["bloom-alibi", "mpt-alibi", "mixtral", "qwen2-moe"])
def test_transformers_models(make):
    """ALiBi (BLOOM's ``baddbmm`` by keyword, MPT's bias table) and mixture-of-experts
    layers (the experts' module rule, whatever implementation runs inside) on the
    rules."""
    model, inputs, labels = make()
    check(model, inputs, labels, causal_lm_loss, paths={"rule", "module rule"}
          if make in (mixtral, qwen2_moe) else {"rule"})


@pytest.mark.slow
def test_transformers_reentrant_gradient_checkpointing():
    model, inputs, labels = gpt2_reentrant_checkpointing()
    rows = [{k: v[i:i + 1] for k, v in inputs.items()} for i in range(B)]
    want = {n: p.new_zeros((B, *p.shape)) for n, p in model.named_parameters()}
    for i, row in enumerate(rows):  # loss.backward() per sample: autograd.grad is refused
        causal_lm_loss(model(**row), labels[i:i + 1]).sum().backward()
        for n, p in model.named_parameters():
            want[n][i] = p.grad if p.grad is not None else 0
            p.grad = None
    check(model, inputs, labels, causal_lm_loss, want=want)


@pytest.mark.slow
@pytest.mark.parametrize("make", [mixtral, qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_transformers_eager_experts_loop_takes_the_experts_module_rule(make):
    """transformers' eager experts loop over the experts some token chose (a set made
    from every sample's routing, which the op rules cannot follow): the experts' module
    rule computes from the call's inputs, routing and backprops alone, exactly."""
    model, inputs, labels = make("eager")
    routes = persample.supported(model, inputs, labels, causal_lm_loss)
    assert {r.path for r in routes} == {"rule", "module rule"}
    assert {r.module.rsplit(".", 1)[-1] for r in routes if r.path == "module rule"} == {
        "experts"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # auto stays on the rules
        got = per_sample_grads(model, inputs, labels, causal_lm_loss)
    assert_exact(got, loop_per_sample_grads(model, inputs, labels, causal_lm_loss))


# ---------------------------------------------------------------------------
# indexing drawn at random: the layout said is the truth, or no layout is said


def _samples_of(lay: Batched, shape: tuple) -> Tensor:
    """The sample of every entry of a tensor of ``shape`` with layout ``lay``."""
    from persample.batch.layouts import sample_of_positions

    rows = sample_of_positions(lay, shape[lay.dim], B, torch.device("cpu")).long()
    view = [1] * len(shape)
    view[lay.dim] = shape[lay.dim]
    return rows.view(view).expand(shape)


@st.composite
def indexed_batches(draw):
    """A tensor with its batch in some dim (plain, merged with other positions, or an
    index layout), and an index: ints, slices, ``None``, ``...``, lists, shared index
    tensors and masks, in any order torch accepts."""
    rank = draw(st.integers(2, 4))
    dim = draw(st.integers(0, rank - 1))
    kind = draw(st.sampled_from(["plain", "inner", "outer", "index"]))
    shape = [draw(st.integers(1, 3)) for _ in range(rank)]
    shape[dim] = B if kind in ("plain", "index") else 2 * B
    lay = {"plain": Batched(dim), "inner": Batched(dim, inner=2), "outer": Batched(dim, outer=2),
           "index": Batched(dim, index=torch.tensor([2, 0, 3, 1]))}[kind]
    items, in_dim = [], 0
    while in_dim < rank and draw(st.booleans()):
        size = shape[in_dim]
        item = draw(st.sampled_from(["int", "slice", "none", "list", "tensor", "mask"]))
        if item == "none":
            items.append(None)
            continue
        if item == "int":
            items.append(draw(st.integers(-size, size - 1)))
        elif item == "slice":
            items.append(slice(draw(st.integers(0, size)), None, draw(st.integers(1, 2))))
        elif item == "list":
            items.append(draw(st.lists(st.integers(-size, size - 1), min_size=1, max_size=3)))
        elif item == "tensor":
            items.append(torch.tensor(draw(st.lists(st.integers(0, size - 1), min_size=1,
                                                    max_size=3))))
        else:
            items.append(torch.tensor(draw(st.lists(st.booleans(), min_size=size,
                                                    max_size=size))))
        in_dim += 1
    if draw(st.booleans()) and in_dim < rank:
        items.insert(draw(st.integers(0, len(items))), Ellipsis)
    return tuple(shape), lay, tuple(items)


@settings(max_examples=150, deadline=None)
@given(indexed_batches())
def test_indexing_says_the_truth_or_nothing(case):
    """Whatever the index, the layout given to ``x[index]`` names the sample of every
    entry (checked by indexing a tensor of the samples themselves), or is unknown."""
    shape, lay, index = case
    x = torch.randn(shape)
    try:
        out = x[index]
    except IndexError:
        return  # torch refuses this index itself
    truth = _samples_of(lay, shape)[index]
    got = flow(torch.Tensor.__getitem__, (x, index), {}, out, [(x, lay)])
    if isinstance(got, Batched):
        assert torch.equal(_samples_of(got, tuple(out.shape)), truth), (got, index)
    else:
        assert isinstance(got, Unknown), got


@st.composite
def scatters(draw):
    """``target.index_add_(0, index, source)``: a shared or batched target, a source whose
    rows carry samples (plain or an index layout), an index shared or with its own samples."""
    rows = draw(st.integers(1, 6))
    size = draw(st.integers(1, 6))
    source = draw(st.lists(st.integers(0, B - 1), min_size=rows, max_size=rows))
    index = draw(st.lists(st.integers(0, size - 1), min_size=rows, max_size=rows))
    target = draw(st.one_of(st.none(), st.lists(st.integers(0, B - 1), min_size=size,
                                                max_size=size)))
    own = draw(st.sampled_from(["shared", "source", "values"]))
    return source, index, target, own


@settings(max_examples=150, deadline=None)
@given(scatters())
def test_scatters_say_the_truth_or_nothing(case):
    """Each row of ``index_add_``'s result holds the samples of what landed in it and
    its own: one sample, the layout says it; several, mixed; none, the row is shared (or,
    for an index naming samples into a result of one row per sample, the sample it
    names: into rows of anything else, graph nodes, values equal to their samples are a
    coincidence)."""
    source, index, target, own = case
    idx = torch.tensor(index)
    if own == "values":
        idx = torch.tensor(source)
        index = source
    size = max(len(target) if target is not None else 0, max(index) + 1)
    target = None if target is None else target + [0] * (size - len(target))
    src, x = torch.randn(len(source), 2), torch.zeros(size, 2)
    lays = [(src, Batched(0, index=torch.tensor(source)))]
    if target is not None:
        lays.append((x, Batched(0, index=torch.tensor(target))))
    if own != "shared":
        lays.append((idx, Batched(0, index=torch.tensor(source))))
    out = x.clone().index_add_(0, idx, src)
    got = flow(torch.Tensor.index_add, (x, 0, idx, src), {}, out, lays)
    truth = [set() if target is None else {target[r]} for r in range(size)]
    for s, r in zip(source, index):
        truth[r].add(s)
    if own != "shared" and index == source and size == B:  # the index names samples (by
        # draw or by chance) of a result with a row per sample
        for r in range(size):
            truth[r].add(r)
    if any(len(t) > 1 for t in truth):
        assert isinstance(got, Mixed), (got, truth)
    elif all(len(t) == 0 for t in truth):
        assert got is SHARED
    else:
        rows = torch.tensor([next(iter(t)) if t else -1 for t in truth])
        if isinstance(got, Partly):
            assert torch.equal(got.rows, rows)
        else:
            assert isinstance(got, Batched) and bool((rows >= 0).all())
            assert torch.equal(_samples_of(got, (size,)), rows), (got, truth)


def test_a_parameter_with_a_gradient_hook_is_answered_by_the_loop():
    """``p.register_hook(fn)`` (peft's OSF projects its gradients away from a frozen
    subspace): autograd runs it on each gradient of ``p``, so the loop runs it on each
    sample's. The rules and torch.func do not see it: they refuse, naming the parameter,
    and ``auto`` answers by the loop, also uncertified (``check="never"`` answered the
    unprojected gradients, silently)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(E, T), nn.Tanh(), nn.Linear(T, 3))
    basis = torch.linalg.qr(torch.randn(T, 2))[0]  # (T, 2)
    net[0].weight.register_hook(lambda g: g - basis @ (basis.T @ g))
    x, y = torch.randn(B, E), torch.randn(B, 3)
    want = loop_per_sample_grads(net, x, y, mse)
    for method in ("rules", "vmap"):
        with pytest.raises((persample.NeedsWholeModel, persample.UnsupportedModuleError),
                           match="parameter '0.weight' has a gradient hook"):
            per_sample_grads(net, x, y, mse, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_exact(per_sample_grads(net, x, y, mse, check="never"), want)
        norms = persample.per_sample_grad_norms(net, x, y, mse, check="never")
    torch.testing.assert_close(norms, flat(want).norm(dim=1), rtol=1e-10, atol=1e-12)


class SparseUpdate(nn.Module):
    """A frozen weight plus a sparse update of trainable values at fixed entries, added
    in place (peft's ShiRA): ``w = W.clone(); w += sparse_coo_tensor(idx, values)``."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(E, T).requires_grad_(False)
        self.index = torch.tensor([[0, 1, 2, 3, 1], [1, 3, 0, 5, 1]])
        self.values = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(T, 3)

    def forward(self, x):
        w = self.base.weight.clone()
        w += torch.sparse_coo_tensor(self.index, self.values * 2.0, w.shape)
        return self.head(torch.tanh(F.linear(x, w, self.base.bias)))


def test_a_sparse_update_of_a_weight_takes_the_rules():
    """The sparse tensor's per-sample cotangent is dense (it crashed copying it into a
    sparse buffer), and its values' rule reads it at their entries."""
    torch.manual_seed(0)
    model = SparseUpdate()
    x, y = torch.randn(B, E), torch.randn(B, 3)
    check(model, x, y, mse)


class SeriesInPlace(nn.Module):
    """A rotation summed in place from the identity, term by term (peft's OFT: the
    Cayley-Neumann series ``R = I; R.add_(Q, alpha=2); R.add_(Q @ Q, alpha=2); ...`` of a
    skew-symmetric parameter), applied per block by ``einsum``."""

    def __init__(self, terms: int):
        super().__init__()
        self.terms = terms
        self.q = nn.Parameter(torch.randn(2, H, H) * 0.3)
        self.head = nn.Linear(2 * H, 3)

    def forward(self, x):  # (b, 2 H)
        skew = self.q - self.q.transpose(-2, -1)
        rotation = torch.eye(H).repeat(2, 1, 1)
        rotation.add_(skew, alpha=2.0)
        power = skew
        for _ in range(self.terms - 1):
            power = torch.bmm(power, skew)
            rotation.add_(power, alpha=2.0)
        y = torch.einsum("...rk,rkc->...rc", x.reshape(-1, 2, H), rotation)
        return self.head(y.reshape(x.shape))


@pytest.mark.parametrize("terms", [2, 4])
def test_a_tensor_summed_in_place_term_by_term_takes_the_rules(terms):
    """Each ``add_`` after the first overwrites the value the one before made: the chain of
    writes is followed back (the first write's input changed since it ran only by the
    later writes, which took its value as theirs to pull back through); the rules, in
    calls cached after the parameter changed (the per-module fallback before)."""
    torch.manual_seed(0)
    model = SeriesInPlace(terms)
    loss = nn.CrossEntropyLoss(reduction="none")
    for _ in range(4):
        x, y = torch.randn(B, 2 * H), torch.randint(0, 3, (B,))
        assert {r.path for r in persample.supported(model, x, y, loss)} == {"rule"}
        assert_exact(per_sample_grads(model, x, y, loss, method="rules"),
                     loop_per_sample_grads(model, x, y, loss))
        with torch.no_grad():
            model.q.mul_(1.1)
