"""A parameter read in more than one place gets every contribution: a module rule's
parameter also read by an op outside that module, and a parameter handed as an argument
to another module whose call takes the per-module fallback."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from battery import check
from test_dataflow import _Gain  # (x * w inside a custom autograd.Function)

B = 4  # = the sequence length and the input width


class ReadsRecurrentWeight(nn.Module):
    """``nn.LSTM`` (its module rule) and ``F.linear`` of its ``weight_hh_l0`` outside."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)  # (B, T, 3)
        h = out[:, -1]
        return self.head(torch.tanh(F.linear(h, self.lstm.weight_hh_l0)[:, :3] + h))


def test_a_module_rules_parameter_read_outside_gets_both_contributions():
    torch.manual_seed(0)
    model = ReadsRecurrentWeight().double()
    x, y = torch.randn(B, 4, 4).double(), torch.randint(0, 2, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), methods=("rules", "auto", "loop"), paths=None)
    routes = {(r.module, p): r.path for r in persample.supported(
        model, x, y, nn.CrossEntropyLoss()) for p in r.params}
    assert routes["lstm", "weight_ih_l0"] == "module rule", routes


class Adapter(nn.Module):
    """Reads a weight it is handed (as adapter libraries do) inside a custom Function."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return _Gain.apply(F.linear(x, weight), self.scale)


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.adapter, self.head = Adapter(), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.adapter(x, self.weight))


def test_a_parameter_handed_to_a_module_that_falls_back_is_written():
    torch.manual_seed(0)
    model = Owner().double()
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), methods=("rules", "auto", "loop"),
          paths=None, forbid=None)


class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.jit.script(nn.Linear(4, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(x)))


def test_a_torchscript_submodule_is_named_and_auto_answers():
    torch.manual_seed(0)
    model = Scripted().double()
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    with pytest.raises(persample.NeedsWholeModel, match="'body' .*TorchScript"):
        persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")
    with pytest.warns(UserWarning, match="'body' .*TorchScript") as caught:
        got = persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    assert len([w for w in caught if "TorchScript" in str(w.message)]) == 1
    want = persample.loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


class NoGradScale(nn.Module):
    """A weight divided by its norm taken under ``torch.no_grad()`` (a constant to
    autograd), and read normally."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            scale = self.a.weight.norm()
        return self.head(torch.tanh(F.linear(x, self.a.weight / scale, self.a.bias)))


def test_a_weight_read_under_no_grad_is_a_constant_on_the_rules():
    torch.manual_seed(0)
    model = NoGradScale().double()
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), methods=("rules", "auto", "vmap", "loop"))


class Cached(nn.Module):
    """Keeps tensors made in one forward for the next: an index table (no gradient path:
    shared in later calls) and the transposed weight (a gradient path into the first
    call's graph: not followed, so the rules refuse and auto answers)."""

    def __init__(self, weight_too: bool):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.weight_too, self.cache = weight_too, {}

    def forward(self, x: Tensor) -> Tensor:
        if "index" not in self.cache:
            self.cache["index"] = torch.arange(4).flip(0)
            self.cache["wt"] = self.a.weight.t()
        h = x[:, self.cache["index"]]
        h = h @ self.cache["wt"] if self.weight_too else self.a(h)
        return self.head(torch.tanh(h))


def test_a_tensor_cached_by_an_earlier_call_is_shared_unless_it_carries_a_graph():
    torch.manual_seed(0)
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    model = Cached(weight_too=False).double()
    persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())  # fills the cache
    check(model, x, y, nn.CrossEntropyLoss(), methods=("rules", "auto"))
    model = Cached(weight_too=True).double()
    persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    with pytest.raises(persample.NeedsWholeModel):
        persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")


@functools.lru_cache
def _reversed_positions(k: int) -> Tensor:
    return torch.arange(k).flip(0)


class CachedAside(nn.Module):
    """An index table kept outside the model (a function's ``lru_cache``, as transformers
    keeps relative position indices), which no walk of the model finds."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.a(x[:, _reversed_positions(x.shape[1])])))


def test_a_tensor_cached_by_a_plain_forward_is_shared_from_the_next_call():
    """An index table cached by a forward persample did not run (the user's plain
    forward first): the first call cannot tell it from a tensor made in it by code the
    capture cannot see, so the rules refuse it and ``auto`` answers by another exact
    method; from the next call on it is one from before the call, shared, on the rules,
    unless it was written since it was last read."""
    _reversed_positions.cache_clear()
    torch.manual_seed(0)
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    model, loss = CachedAside().double(), nn.CrossEntropyLoss()
    model(x)  # fills the cache outside persample
    with pytest.raises(persample.NeedsWholeModel, match="made outside the captured ops"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    check(model, x, y, loss, methods=("rules", "auto"))
    persample.clear_plans()  # (a compiled call traces the function, cache and all)
    _reversed_positions(4).add_(0)  # written since (the same values, a new version)
    with pytest.raises(persample.NeedsWholeModel, match="made outside the captured ops"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    check(model, x, y, loss, methods=("rules", "auto"))


@functools.lru_cache
def _inference_offset(k: int) -> Tensor:
    with torch.inference_mode():
        return torch.linspace(-1.0, 1.0, k, dtype=torch.float64)


class InferenceConstant(nn.Module):
    """Adds a tensor made under ``torch.inference_mode`` and cached outside the model: it
    keeps no version counter, so a later call cannot tell whether it was written since."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + _inference_offset(3)


def test_an_inference_tensor_from_before_is_answered_at_every_call():
    _inference_offset.cache_clear()
    _inference_offset(3)  # (made before the first call)
    torch.manual_seed(0)
    x, y = torch.randn(B, 4).double(), torch.randint(0, 3, (B,))
    model, loss = InferenceConstant().double(), nn.CrossEntropyLoss()
    for _ in range(2):
        with pytest.raises(persample.NeedsWholeModel, match="made outside the captured ops"):
            persample.per_sample_grads(model, x, y, loss, method="rules")
    with pytest.warns(UserWarning, match="made outside the captured ops"):
        persample.per_sample_grads(model, x, y, loss)
    check(model, x, y, loss, methods=("auto", "loop"), paths=None, forbid=None)


_SHIFT = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)  # a constant of the module


class GlobalShift(nn.Module):
    """Reads a tensor its Python module binds to a global name, made at import."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.a(x - _SHIFT) * _SHIFT))


def test_a_global_tensor_of_the_forwards_module_is_shared_from_the_first_call():
    """A global of the module that defines ``forward`` was bound before the call: shared,
    as the model's own attributes are, so the first call takes the rules too."""
    torch.manual_seed(0)
    x, y = torch.randn(B, 4).double(), torch.randint(0, 2, (B,))
    check(GlobalShift().double(), x, y, nn.CrossEntropyLoss(), methods=("rules", "auto"))
