"""Tensors with a batch-sized dim that hold no sample's data: shared tensors expanded to
the batch inside ``forward`` (``arange(T).expand_as(ids)``, BERT's buffered token type
ids, a learned bias or a class token expanded or repeated to ``B`` rows) stay at rule
speed and exact, and ``supported`` says which path each parameter really takes.

Such a tensor has a dim of size ``B`` but its rows are identical: it is shared (shared)
data, and nothing may read its size as the batch. Sizes coincide on purpose
(batch = sequence length = heads). Every model goes through ``battery.check``: against
the loop over samples in float64, ``per_sample_grads`` and ``per_sample_grad_norms``
(total and per parameter) with the rules and ``auto``, and ``private_grad`` (noise 0),
with no fallback or vmap warning, no per-sample VJP from ``torch.func`` on a
path a rule can take, ``supported`` agreeing with the path the call took, and the model
left as it was.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import battery
import persample
import zoo
from persample.batch import SHARED, Batched
from persample.batch.flow import unbroadcast
from persample.capture import Capture
from persample.engine import pullback

B = T = H = 4  # coinciding on purpose
E, V = 8, 11


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


@contextlib.contextmanager
def per_sample_vjps():
    """Inside: the parameters whose per-sample gradient took an op's per-sample VJP from
    ``torch.func`` ("op vjp") or the per-module fallback, as ``{"op vjp": ids, "fallback":
    calls}``."""
    seen: dict[str, set] = {"op vjp": set(), "fallback": set()}
    op_vjp, module_vjp = pullback.op_vjp, pullback.module_vjp

    def op_vjps(op, *args, **kwargs):
        seen["op vjp"] |= set(op.sources_all)
        return op_vjp(op, *args, **kwargs)

    def whole(call, *args, **kwargs):
        seen["fallback"].add(call.describe())
        return module_vjp(call, *args, **kwargs)

    pullback.op_vjp, pullback.module_vjp = op_vjps, whole
    try:
        yield seen
    finally:
        pullback.op_vjp, pullback.module_vjp = op_vjp, module_vjp


def check(model: nn.Module, inputs, targets, loss_fn,
          slower: dict[str, str] | None = None) -> None:
    """``battery.check`` (exact against the loop, no warning, the model unchanged) with
    ``supported`` saying ``rule`` for every parameter but those in ``slower`` (name ->
    "op vjp" or "fallback"), and the calls taking torch.func's per-sample VJP of an op
    exactly for the ``op vjp`` ones, the per-module fallback exactly where a ``fallback``
    is expected."""
    slower = slower or {}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with per_sample_vjps() as seen:
        battery.check(model, inputs, targets, loss_fn,
                      paths={n: slower.get(n, "rule") for n in params})
    by_id = {id(p): n for n, p in params.items()}
    assert {by_id[i] for i in seen["op vjp"] if i in by_id} == {
        n for n, kind in slower.items() if kind == "op vjp"}
    assert bool(seen["fallback"]) == ("fallback" in slower.values())


# ---------------------------------------------------------------------------
# a shared tensor widened to the batch inside forward, four ways


def widen(t: Tensor, how: str, n: int) -> Tensor:
    """``t`` (``(1, *rest)`` or ``rest``) as ``(n, *rest)``, its rows identical."""
    base = t if t.dim() and t.shape[0] == 1 else t.unsqueeze(0)
    shape = (n, *base.shape[1:])
    if how == "expand":
        return base.expand(*shape)
    if how == "broadcast_to":
        return torch.broadcast_to(base, shape)
    if how == "expand_as":
        return base.expand_as(torch.empty(shape))
    return base.repeat(n, *[1] * (base.dim() - 1))


HOWS = ["expand", "broadcast_to", "expand_as", "repeat"]


class AddedToActivations(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin = how, nn.Linear(E, E)
        self.pos, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) + widen(self.pos, self.how, x.shape[0])
        return self.head(torch.tanh(h)).sum(1)


class PositionIds(nn.Module):
    """``arange(T)`` widened to ``(B, T)``: the ids of a trainable position embedding."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.tok, self.pos = how, nn.Embedding(V, E), nn.Embedding(T, E)
        self.head = nn.Linear(E, 3)

    def forward(self, ids: Tensor) -> Tensor:
        positions = widen(torch.arange(ids.shape[1]), self.how, ids.shape[0])
        return self.head(torch.tanh(self.tok(ids) + self.pos(positions))).sum(1)


class BufferedTypes(nn.Module):
    """BERT's form: a ``(1, T)`` buffer of token type ids widened by the model."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.tok, self.types = how, nn.Embedding(V, E), nn.Embedding(2, E)
        self.register_buffer("type_ids", (torch.arange(T) >= T // 2).long()[None])
        self.head = nn.Linear(E, 3)

    def forward(self, ids: Tensor) -> Tensor:
        types = widen(self.type_ids[:, :ids.shape[1]], self.how, ids.shape[0])
        return self.head(torch.tanh(self.tok(ids) + self.types(types))).sum(1)


class AttentionBias(nn.Module):
    """A learned (or buffered) ``(H, T, T)`` bias widened to ``(B, H, T, T)`` as the
    attention mask of ``scaled_dot_product_attention``."""

    def __init__(self, how: str, learned: bool = True):
        super().__init__()
        self.how, self.qkv, self.head = how, nn.Linear(E, 3 * E), nn.Linear(E, 3)
        bias = torch.randn(H, T, T)
        if learned:
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=widen(self.bias, self.how, n))
        return self.head(out.transpose(1, 2).reshape(n, T, E)).sum(1)


class ClassToken(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin = how, nn.Linear(E, E)
        self.cls, self.head = nn.Parameter(torch.randn(1, 1, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.cat([widen(self.cls, self.how, x.shape[0]), self.lin(x)], 1)
        return self.head(torch.tanh(h)).mean(1)


class JoinedFeatures(nn.Module):
    """Learned per-position features widened to the batch, joined along the features."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.extra = how, nn.Parameter(torch.randn(T, 2))
        self.head = nn.Linear(E + 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.cat([x, widen(self.extra, self.how, x.shape[0])], -1)).sum(1)


class Gated(nn.Module):
    """A widened parameter in ``x * g`` and as a branch of ``where`` (no rule: its own
    backward on per-sample copies)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.g, self.head = how, nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        g = widen(self.g, self.how, x.shape[0])
        return self.head(torch.maximum(torch.where(x > 0, x * g, g), g)).sum(1)


class BatchedMatrix(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.w, self.head = how, nn.Parameter(torch.randn(E, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.bmm(x, widen(self.w, self.how, x.shape[0]))).sum(1)


MODELS = [AddedToActivations, PositionIds, BufferedTypes, AttentionBias, ClassToken,
          JoinedFeatures, Gated, BatchedMatrix]
TOKENS = (PositionIds, BufferedTypes)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("make", MODELS, ids=[m.__name__ for m in MODELS])
def test_widened_shared_tensor_is_on_the_rules(make, how):
    torch.manual_seed(0)
    model = make(how)
    inputs = torch.randint(0, V, (B, T)) if make in TOKENS else torch.randn(B, T, E)
    check(model, inputs, torch.tensor([0, 2, 1, 2]), ce)


@pytest.mark.parametrize("how", HOWS)
def test_buffered_attention_bias(how):
    """A widened buffer as the mask: no parameter behind it, every parameter on a rule."""
    torch.manual_seed(0)
    check(AttentionBias(how, learned=False), torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]),
          ce)


class ChangedAfterRepeat(nn.Module):
    """The tensor a ``repeat`` copied is changed in place afterwards: the copy no longer
    equals it broadcast (``where`` reads the copy), and pulling back through the op that
    made the source would read its new value: the per-module fallback, exact."""

    def __init__(self):
        super().__init__()
        self.g, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        source = self.g * 1.0
        copy = source.unsqueeze(0).repeat(x.shape[0], 1, 1)
        source.mul_(2.0)
        return self.head(torch.where(x > 0, x, copy)).sum(1)


class ChangedCopy(nn.Module):
    """The widened copy itself is changed in place, through a view, before it is read:
    it is no longer what ``repeat`` made (the per-module fallback, exact)."""

    def __init__(self):
        super().__init__()
        self.g, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        copy = self.g.unsqueeze(0).repeat(x.shape[0], 1, 1)
        copy[:, 0].mul_(3.0)  # every sample's first position
        return self.head(torch.where(x > 0, x, copy)).sum(1)


class ComputedFromWidened(nn.Module):
    """``-g`` of a widened ``g`` is a new shared tensor as wide as the batch (its rows
    identical, but no longer made by widening): ``maximum`` has no rule for it, and pairs
    its rows with the samples, so its per-sample VJPs come from one backward of
    ``maximum`` with each sample's cotangent at its own rows (the rows do not overlap)."""

    def __init__(self):
        super().__init__()
        self.g, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.maximum(x, -self.g.expand(x.shape[0], T, E))).sum(1)


SLOWER = {ChangedAfterRepeat: "fallback", ChangedCopy: "fallback", ComputedFromWidened: "rule"}


@pytest.mark.parametrize("make", list(SLOWER), ids=[m.__name__ for m in SLOWER])
def test_a_widened_tensor_changed_since_is_not_read_as_its_source(make):
    torch.manual_seed(0)
    check(make(), torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]), ce,
          slower={"g": SLOWER[make]})


# ---------------------------------------------------------------------------
# the data flow: a widened tensor stays shared; an op reads its narrow form only where the
# output is the same


def test_widened_tensor_is_free_and_never_taken_for_the_batch():
    """``arange(T).expand(B, T)`` (B == T) and a parameter repeated to ``B`` rows are shared;
    joined with per-sample data along another dim of the same size they do not become
    the batch."""
    emb = nn.Embedding(T, E)
    x = torch.randn(B, T, E)
    with Capture(emb, {id(p): p for p in emb.parameters()}, B, [x]) as cap:
        ids = torch.arange(T).expand(B, T)
        table = emb.weight.unsqueeze(0).repeat(B, 1, 1)  # (B, T, E): rows identical
        looked = emb(ids.t())  # (T, B, E): its dim 1 has size B too
        mixed_dims = x.transpose(0, 1) + looked  # (T, B, E): samples in dim 1
        y = x + table
    assert cap.layout(ids) is SHARED and cap.layout(table) is SHARED
    assert cap.layout(looked) is SHARED
    assert cap.layout(mixed_dims) == Batched(1) and cap.layout(y) == Batched(0)


class Loop(nn.Module):
    """Records what the capture hands each op: ``where`` and ``add`` read the narrow form
    of a widened parameter; ``mul`` of two widened tensors alone keeps them (narrowed, its
    output would shrink)."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.randn(T, E))
        self.s = nn.Parameter(torch.randn(1))

    def forward(self, x: Tensor) -> Tensor:
        g = self.g.expand(x.shape[0], T, E)
        both = g * self.s.expand(x.shape[0], T, E)  # shared (B, T, E): nothing to broadcast
        return torch.where(x > 0, x, g) + both


def test_only_ops_that_broadcast_read_the_narrow_form():
    model = Loop()
    x = torch.randn(B, T, E)
    with Capture(model, {id(p): p for p in model.parameters()}, B, [x]) as cap:
        model(x)
    shapes = {getattr(op.func, "__name__", ""): [tuple(t.shape) for t in op.leaves]
              for op in cap.ops}
    assert shapes["where"] == [(B, T, E), (B, T, E), (T, E)]  # cond, x, g read as (T, E)
    assert shapes["mul"] == [(B, T, E), (B, T, E)]  # g * s kept: narrowed, (T, 1) would shrink
    # ``+`` reads the shared (B, T, E) product as it is: it was made by mul, not widened
    add = next(op for op in cap.ops if getattr(op.func, "__name__", "").endswith("add__")
               or getattr(op.func, "__name__", "") in ("add", "__add__"))
    assert [tuple(t.shape) for t in add.leaves] == [(B, T, E), (B, T, E)]


def test_unbroadcast_keeps_the_op_as_it_was():
    """The elementwise form replaces only operands that broadcast to the same output: an
    in-place op's target and ``out=`` never; ``None`` where nothing changes."""
    a, wide, narrow = torch.randn(B, T), torch.randn(B, T), torch.randn(T)
    pick = {id(wide): narrow}.get

    def narrowed(t):
        return pick(id(t))

    got = unbroadcast(torch.add, (a, wide), {}, narrowed)
    assert got is not None and got[0][1] is narrow
    assert unbroadcast(torch.Tensor.add_, (wide, a), {}, narrowed) is None  # the target
    assert unbroadcast(torch.add, (a, wide), {"out": torch.empty(B, T)}, narrowed) is None
    assert unbroadcast(torch.mul, (wide, 2.0), {}, narrowed) is None  # the output would shrink
    assert unbroadcast(torch.add, (a, a), {}, narrowed) is None  # nothing to replace
    assert unbroadcast(F.linear, (a, wide), {}, narrowed) is None  # broadcasts nothing
    q = torch.randn(B, H, T, 2)
    got = unbroadcast(F.scaled_dot_product_attention, (q, q, q), {"attn_mask": wide},
                      narrowed)
    assert got is not None and got[1]["attn_mask"] is narrow


def test_a_zero_dim_source_is_not_read_for_its_expansion():
    """``p.expand(B, T)`` of a 0-dim ``p`` stays as it is: read as the 0-dim tensor, a
    float32 operand beside it would no longer be promoted to float64."""
    p = nn.Parameter(torch.tensor(1.5))
    lin = nn.Linear(T, T).float()
    model = nn.ModuleDict({"lin": lin})
    model.p = p
    x = torch.randn(B, T, dtype=torch.float32)
    with Capture(model, {id(q): q for q in model.parameters()}, B, [x]) as cap:
        y = lin(x) * p.expand(B, T)
    assert y.dtype == torch.float64
    mul = next(op for op in cap.ops if "mul" in getattr(op.func, "__name__", ""))
    assert [t.dim() for t in mul.leaves] == [2, 2]


# ---------------------------------------------------------------------------
# real models: GPT-2 with position ids built in a wrapper, BERT with and without token
# type ids (its buffer widened by the model), padding masks


class PositionsInForward(nn.Module):
    """GPT-2 called with ``position_ids = arange(T).expand_as(input_ids)`` built in the
    wrapper's forward."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.lm(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=positions)


def gpt2_with_positions():
    import zoo

    model, inputs, labels, loss = zoo.gpt2_lm()
    return PositionsInForward(model), inputs, labels, loss


def bert(token_types: bool):
    import zoo

    return zoo.bert_token_types() if token_types else zoo.bert()


@pytest.mark.parametrize("build", [gpt2_with_positions, lambda: bert(False),
                                   lambda: bert(True)],
                         ids=["gpt2-positions-in-forward", "bert", "bert-token-types"])
def test_real_models_with_batch_sized_shared_tensors(build):
    zoo.require("transformers")
    model, inputs, labels, loss = build()
    assert int(inputs["attention_mask"].sum()) < B * T  # a padded sample
    check(model, inputs, labels, loss)


# ---------------------------------------------------------------------------
# supported() is what the call does


class NoRule(nn.Module):
    """One op whose rule does not cover the form reads a parameter: ``einsum`` of its
    diagonal."""

    def __init__(self):
        super().__init__()
        self.w, self.head = nn.Parameter(torch.randn(E, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.einsum("btd,dd->btd", x, self.w)).sum(1)


def test_supported_names_the_op_whose_rule_declines_and_why():
    torch.manual_seed(0)
    model, x = NoRule(), torch.randn(B, T, E)
    check(model, x, torch.tensor([0, 2, 1, 2]), ce, slower={"w": "op vjp"})
    (route,) = [r for r in persample.supported(model, x) if r.params == ("w",)]
    assert route.path == "op vjp"
    assert route.reason.startswith("einsum in module '<root>' (NoRule): ")
    assert "a diagonal of an operand" in route.reason
    assert "torch.func" in route.reason


class TwoOps(nn.Module):
    """A parameter read by an op with a rule first and by one whose rule declines
    afterwards (``einsum`` of its diagonal): the slower path is the one reported."""

    def __init__(self):
        super().__init__()
        self.w, self.head = nn.Parameter(torch.randn(E, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x @ self.w)
        return self.head(torch.einsum("btd,dd->btd", h, self.w)).sum(1)


def test_supported_reports_op_vjp_where_any_use_takes_it():
    torch.manual_seed(0)
    model, x = TwoOps(), torch.randn(B, T, E)
    check(model, x, torch.tensor([0, 2, 1, 2]), ce, slower={"w": "op vjp"})
    (route,) = [r for r in persample.supported(model, x) if r.params == ("w",)]
    assert route.reason.startswith("einsum") and "also matmul" in route.reason


# ---------------------------------------------------------------------------
# parameters written in place into shared tensors: no op the capture recorded made what
# such a tensor holds afterwards


class IntoFree(nn.Module):
    """``buf.add_(g)`` on a fresh shared tensor (on the rules: a derived tensor)."""

    def __init__(self):
        super().__init__()
        self.g, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        buf = torch.zeros(T, E)
        buf.add_(self.g)
        return self.head(torch.tanh(x + buf)).sum(1)


class IntoDerived(nn.Module):
    """``w.add_(h)`` on ``w = g * 1``: ``h`` reaches the output only through ``w``."""

    def __init__(self):
        super().__init__()
        self.g, self.h = nn.Parameter(torch.randn(T, E)), nn.Parameter(torch.randn(E))
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = self.g * 1.0
        w.add_(self.h)
        return self.head(torch.tanh(x * w)).sum(1)


class ScaledInPlace(nn.Module):
    """``w.mul_(2)`` on a tensor computed from ``g``: pulled back through ``g * 1`` alone
    its per-sample gradient would be half of what it is (the ``mul_`` is its op)."""

    def __init__(self):
        super().__init__()
        self.g, self.head = nn.Parameter(torch.randn(T, E)), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = self.g.t().t() * 1.0
        w.mul_(2.0)
        return self.head(torch.tanh(x + w)).sum(1)


class ReadAfterChange(nn.Module):
    """``a = g * 1`` read by ``a + q``, then scaled in place and read again."""

    def __init__(self):
        super().__init__()
        self.g, self.q = nn.Parameter(torch.randn(T, E)), nn.Parameter(torch.randn(E))
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        a = self.g * 1.0
        h = x * (a + self.q)
        a.mul_(2.0)
        return self.head(torch.tanh(h + a)).sum(1)


@pytest.mark.parametrize("make", [ScaledInPlace, IntoDerived], ids=["scaled", "into-derived"])
def test_a_derived_tensor_changed_in_place_takes_the_rules(make):
    """A derived tensor changed in place by a constant or a parameter: the change is the
    op that made its new value (replayed from the value it overwrote), and the value
    before it goes back to the op that made that."""
    torch.manual_seed(0)
    check(make(), torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]), ce)


@pytest.mark.parametrize("make", [ReadAfterChange], ids=["read-after-change"])
def test_a_parameter_changed_in_place_takes_the_fallback(make):
    torch.manual_seed(0)
    model = make()
    check(model, torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]), ce,
          slower={n: "fallback" for n, _ in model.named_parameters() if n != "head.weight"
                  and n != "head.bias"})


class SamplesAddedInPlace(nn.Module):
    """Per-sample data added in place into a parameter repeated to the batch (``pos +=
    tokens``), then scaled in place by more sample data: what later ops read is those
    ops' output, no longer the repeated parameter."""

    def __init__(self, twice: bool):
        super().__init__()
        self.twice, self.g = twice, nn.Parameter(torch.randn(T, E))
        self.lin, self.head = nn.Linear(E, E), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = self.g.unsqueeze(0).repeat(x.shape[0], 1, 1)
        w.add_(self.lin(x))
        if self.twice:
            w.mul_(torch.tanh(x))
        return self.head(torch.tanh(w)).sum(1)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_sample_data_written_into_a_derived_tensor_stays_on_the_rules(twice):
    torch.manual_seed(0)
    check(SamplesAddedInPlace(twice), torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]), ce)


def test_a_parameter_written_into_a_fresh_tensor_takes_the_rules():
    """``buf.add_(g)`` on a fresh shared tensor: ``buf`` is then a derived tensor, made by
    the write (replayed out of place from the zeros it overwrote)."""
    torch.manual_seed(0)
    check(IntoFree(), torch.randn(B, T, E), torch.tensor([0, 2, 1, 2]), ce)




def test_cotangents_each_at_its_own_position_are_paired_with_the_samples():
    """A shared tensor's per-sample cotangents ``(n, v, *shape)`` zero but at each
    sample's own position along a dim become cotangents paired there ``(n, v, ..., 1,
    ...)`` holding the same numbers; one entry elsewhere keeps them unpaired. Sizes
    coincide (every dim 3): the dim is found by the zeros, not by a size."""
    from persample.batch import Batched
    from persample.engine.pullback import _on_own_positions

    n = 3
    full = torch.zeros(n, 2, 3, n, 3, dtype=torch.float64)  # (n, v, 3, n, 3): dim 1 holds them
    for i in range(n):
        full[i, :, :, i] = torch.randn(2, 3, 3, dtype=torch.float64)
    got, pairing = _on_own_positions(full, n)
    assert pairing == Batched(1) and got.shape == (n, 2, 3, 1, 3)
    assert torch.equal(pairing.front_cotangents(full.sum(0), n), got)  # (the same numbers)
    full[0, 0, 0, 1, 0] = 1.0  # (sample 0 reaches sample 1's position)
    got, pairing = _on_own_positions(full, n)
    assert pairing is None and got is full


class PartlyRelu(nn.Module):
    """A table of coordinates through a linear layer whose output's first half is then
    rectified in place (a write into part of it: the layer's parameters are read where
    autograd cannot be followed), then a second layer, added to every sample."""

    def __init__(self):
        super().__init__()
        self.register_buffer("coords", torch.randn(5, 2, dtype=torch.float64))
        self.first, self.second = nn.Linear(2, 8), nn.Linear(4, 1)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = self.first(self.coords)
        part = h[:, :4]
        part.relu_()
        return self.head(x + self.second(part).squeeze(-1))


def test_supported_names_the_fallback_a_derived_tensor_is_also_read_through(monkeypatch):
    """The first layer takes its module's fallback; the ops that read the derived tensor
    made from both layers' parameters had recorded it under their own rule, so that
    ``supported()`` said ``rule`` where the fallback ran. It says what ran; the answer
    equals the loop's."""
    import persample.engine.pullback as pullback

    calls = []
    fallback = pullback._fallback
    monkeypatch.setattr(pullback, "_fallback", lambda *a: calls.append(1) or fallback(*a))
    torch.manual_seed(0)
    model = PartlyRelu().double()
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    paths = {r.module: r.path for r in persample.supported(model, x, y, nn.MSELoss())}
    assert paths == {"first": "fallback", "second": "rule", "head": "rule"}, paths
    assert calls, "the fallback ran"
    got = persample.per_sample_grads(model, x, y, nn.MSELoss())
    want = persample.loop_per_sample_grads(model, x, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
