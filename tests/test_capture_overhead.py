"""The capture's own cost on models with frozen parts, and that what makes it cheaper
changes no answer.

- While a capture is open, compiled code runs eagerly (``torch.compiler.set_stance``), so
  the capture's per-op hook and module hooks are not wrapped for TorchDynamo (a few
  microseconds per op); where that stance cannot be set they are.
- The shared tensors (parameters, buffers, tensors held as attributes, in lists, tuples
  and dicts) are gathered in one walk of the modules.
- Frozen parts that mix samples are still found where they do it, with the adapters
  (the only trainable parameters) after them: the rules refuse, naming the op, and
  ``auto`` gives the loop's answer; frozen parts that keep samples apart stay exact on
  the rules.

Sizes coincide on purpose (batch = sequence length = heads); float64 against the loop.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from cases import assert_exact
from persample.batch import Batched
from persample.batch.flow import op_leaves
from persample.batch.ops_indexing import Sorted
from persample.capture import Capture
from persample.capture.mode import Mode
from persample.capture.tensors import free_tensors
from persample.patches import WhileCapturing

B = T = H = 4
E = 8


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


class Adapted(nn.Module):
    """A frozen backbone (``inner``) and a trainable low-rank adapter beside its last
    layer, as LoRA puts it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.requires_grad_(False)
        self.out = nn.Linear(E, 3).requires_grad_(False)
        self.a, self.b = nn.Linear(E, 2, bias=False), nn.Linear(2, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inner(x)
        return (self.out(h) + self.b(self.a(h))).sum(1)


def hooks(model: nn.Module) -> list:
    return [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)
            for h in d.values()]


def test_no_wrapping_for_dynamo_while_compiled_code_runs_eagerly():
    torch._dynamo  # noqa: B018 (loaded: compiled code may run)
    model = Adapted(nn.Sequential(nn.Linear(E, E), nn.GELU()))
    x = torch.randn(B, T, E)
    with Capture(model, {id(p): p for p in model.parameters() if p.requires_grad}, B,
                 [x]) as cap:
        assert WhileCapturing.stance is not None
        assert type(cap._mode) is Mode
        assert hooks(model) and not any(hasattr(h, "_torchdynamo_disable")
                                        for h in hooks(model))
        model(x)
    assert not hooks(model)


def test_wrapped_for_dynamo_where_compiled_code_may_run(monkeypatch, snapshot):
    """Where the stance cannot be set (a capture opened inside a compiled region), the
    per-op hook and the module hooks are hidden from TorchDynamo, and the answer is the
    same."""
    torch._dynamo  # noqa: B018

    def refuse(*args, **kwargs):
        raise RuntimeError("set_stance inside a compiled region")

    monkeypatch.setattr(torch.compiler, "set_stance", refuse)
    torch.manual_seed(0)
    model = Adapted(nn.Sequential(nn.Linear(E, E), nn.GELU()))
    x, y = torch.randn(B, T, E), torch.tensor([0, 2, 1, 2])
    with Capture(model, {id(p): p for p in model.parameters() if p.requires_grad}, B,
                 [x]) as cap:
        assert type(cap._mode) is not Mode
        assert isinstance(cap._mode, Mode)
        assert hooks(model) and all(hasattr(h, "_torchdynamo_disable") for h in hooks(model))
        model(x)
    state = snapshot(model)
    got = persample.per_sample_grads(model, x, y, ce, method="rules")
    assert_exact(got, persample.loop_per_sample_grads(model, x, y, ce))
    state.assert_unchanged()


class Holder(nn.Module):
    """Tensors held every way a module holds them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(E, E)
        self.register_buffer("kept", torch.randn(E))
        self.register_buffer("scratch", torch.randn(E), persistent=False)
        self.register_buffer("absent", None)
        self.mask = torch.ones(T, T).tril()
        self._private = torch.randn(3)
        self.table = [torch.randn(2), (torch.randn(2), {"deep": torch.randn(2)})]
        self.by_name = {"a": torch.randn(2)}
        self.flag, self.size, self.label = True, 3, "holder"


def test_free_tensors_are_every_tensor_the_modules_hold():
    model = nn.Sequential(Holder(), nn.Sequential(Holder()))
    want = set()
    for m in model.modules():
        want |= {id(p) for p in m._parameters.values() if p is not None}
        want |= {id(b) for b in m._buffers.values() if b is not None}
        if isinstance(m, Holder):
            want |= {id(m.mask), id(m._private), id(m.table[0]), id(m.table[1][0]),
                     id(m.table[1][1]["deep"]), id(m.by_name["a"])}
    shared = (torch.randn(2),)
    got = {id(t) for t in free_tensors(model, shared)}
    assert got == want | {id(shared[0])}


def test_free_tensors_are_free_in_the_capture():
    """A held tensor that requires no grad (a mask, a buffer) is shared, not unknown."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(T, T)
            self.cache = {"mask": torch.ones(T, T).tril()}

        def forward(self, x):
            return self.lin(x) * self.cache["mask"]

    model, x = Masked(), torch.randn(B, T, T)
    with Capture(model, {id(p): p for p in model.parameters()}, B, [x]) as cap:
        y = model(x)
    assert cap.layout(y) == Batched(0)


def test_layout_and_leaf_helpers_keep_their_meaning():
    plain = Batched(1)
    assert plain.moved(1) is plain and plain.moved(0) == Batched(0)
    keyed = Sorted(0, index=torch.tensor([1, 0]), keys=torch.tensor([0, 1]))
    same = keyed.moved(0)  # a subclass's extras are not carried by a move
    assert type(same) is Batched and same == keyed
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert op_leaves((a, [b, 1, c], 2.0), {"w": a, "rest": (c,)}) == [a, b, c, a, c]


# ---------------------------------------------------------------------------
# frozen backbones: where samples mix inside, the rules refuse; elsewhere exact


class CentreOverBatch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0, keepdim=True)


class AttendAcrossBatch(nn.Module):
    """Attention along dim 0: each sample attends to the others."""

    def forward(self, x: Tensor) -> Tensor:
        q = x.transpose(0, 1)  # (T, B, E)
        return F.scaled_dot_product_attention(q, q, q).transpose(0, 1)


class PerSampleAttention(nn.Module):
    """Frozen self-attention along each sample's positions: samples stay apart."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + out.transpose(1, 2).reshape(n, T, E)


@pytest.mark.parametrize("inner, op", [
    (lambda: nn.Sequential(nn.Linear(E, E), CentreOverBatch()), "mean"),
    (lambda: nn.Sequential(nn.Linear(E, E), AttendAcrossBatch()),
     "scaled_dot_product_attention"),
], ids=["centred-over-the-batch", "attention-across-the-batch"])
def test_frozen_part_that_mixes_samples_is_found(inner, op, snapshot):
    torch.manual_seed(0)
    model = Adapted(inner())
    x, y = torch.randn(B, T, E), torch.tensor([0, 2, 1, 2])
    state = snapshot(model)
    with pytest.raises((persample.NeedsWholeModel, persample.LossNotPerSampleError),
                       match=op):
        persample.per_sample_grads(model, x, y, ce, method="rules")
    with warnings.catch_warnings():  # auto: refused by name (no per-sample gradient)
        warnings.simplefilter("ignore")
        with pytest.raises(persample.CertificateError, match="mixes samples"):
            persample.per_sample_grads(model, x, y, ce)
    got = persample.per_sample_grads(model, x, y, ce, method="loop")  # asked for
    assert_exact(got, persample.loop_per_sample_grads(model, x, y, ce))
    state.assert_unchanged()


def test_frozen_batchnorm_in_training_mode_is_refused():
    model = Adapted(nn.Sequential(nn.Linear(E, E), nn.Flatten(0, 1), nn.BatchNorm1d(E),
                                  nn.Unflatten(0, (B, T)))).train()
    x, y = torch.randn(B, T, E), torch.tensor([0, 2, 1, 2])
    with pytest.raises(ValueError, match="BatchNorm"):
        persample.per_sample_grads(model, x, y, ce)


def test_frozen_backbone_that_keeps_samples_apart_is_exact_on_the_rules(snapshot):
    torch.manual_seed(0)
    model = Adapted(nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E), PerSampleAttention(),
                                  nn.GELU(), nn.Dropout(0.1))).eval()
    x, y = torch.randn(B, T, E), torch.tensor([0, 2, 1, 2])
    state = snapshot(model)
    got = persample.per_sample_grads(model, x, y, ce, method="rules")
    assert_exact(got, persample.loop_per_sample_grads(model, x, y, ce))
    assert {r.path for r in persample.supported(model, x, y, ce)} == {"rule"}
    state.assert_unchanged()
