"""In-place writes in the cached calls (persample.capture.lean, .compiled): a program
holds a write into a tensor its own call made (a mask filled in place, weights
normalised with ``/=``), its layout decided again at every call; a write into anything
from before the call (a buffer, an input), or into a tensor an op that reads parameters
has read, keeps the full capture. Every answer equals the loop's in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from cached_calls import B, D, T, check, kept
from persample.capture.compiled import Compiled
from persample.capture.lean import Program
from persample.errors import InPlaceModificationError


class Writes(nn.Module):
    """A mask made and filled in place, then put in each sample's order (as ViTMAE's
    random masking does), and per-sample weights normalised in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.keep = 3

    def forward(self, x, noise):  # x (B, T, D), noise (B, T)
        mask = torch.ones(x.shape[0], x.shape[1], dtype=x.dtype)  # (B, T), no sample in it
        mask[:, :self.keep] = 0
        mask = torch.gather(mask, 1, torch.argsort(noise, dim=1))  # (B, T) by sample
        t = torch.tanh(self.lin(x))  # (B, T, D)
        w = t * t + 1.0
        w /= w.sum(-1, keepdim=True)
        return self.head((w * mask.unsqueeze(-1)).sum(1))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, T, D, generator=g, dtype=torch.float64),
            "noise": torch.rand(B, T, generator=g, dtype=torch.float64)}


def _note(model, inputs, y, loss):
    return persample.verify(model, inputs, y, loss).plan


def test_writes_into_the_calls_own_tensors_take_the_cached_call(compiled):
    model, y, loss = Writes().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    for k in range(4):  # (each call its own noise: other positions masked per sample)
        check(model, _inputs(k), y, loss)
    want = Compiled if compiled else Program
    assert any(isinstance(found, want) for found in kept(model)), kept(model)
    note = _note(model, _inputs(9), y, loss)
    assert note.startswith("cached: compiled" if compiled else "cached: each of"), note


def test_an_argument_of_a_write_changed_between_calls_is_caught(compiled):
    model, y, loss = Writes().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    for k in range(3):
        check(model, _inputs(k), y, loss)
    model.keep = 5  # (another slice filled: the same shapes)
    for k in range(3):
        check(model, _inputs(k), y, loss)


class Scatters(nn.Module):
    """Samples written into rows given by values (``out[rows] = h``): their own while
    ``key`` is sorted, each other's rows otherwise."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.key = torch.arange(B)

    def forward(self, x):  # (B, T, D)
        h = torch.tanh(self.lin(x))
        out = h * 2.0  # (B, T, D)
        out[torch.argsort(self.key[:x.shape[0]])] = h.detach() + h  # (the loop's batch of
        # one: row 0)
        return self.head(out.sum(1))


def test_a_write_by_index_values_is_decided_in_every_call(compiled):
    model, y, loss = Scatters().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    x = _inputs(0)["x"]
    for _ in range(3):
        check(model, x, y, loss)
    assert any(isinstance(found, (Program, Compiled)) for found in kept(model))
    model.key = torch.tensor([2, 0, 3, 1, 5, 4])  # each sample's data in another's rows
    for _ in range(2):
        with pytest.raises(persample.LossNotPerSampleError, match="another sample's rows"):
            persample.per_sample_grads(model, x, y, loss, method="rules")
    model.key = torch.arange(B)
    check(model, x, y, loss)


class Counts(nn.Module):
    """A buffer written in place at every call, and the input scaled in place."""

    def __init__(self, what):
        super().__init__()
        self.lin = nn.Linear(D, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))
        self.what = what

    def forward(self, x):  # (B, D)
        if self.what == "buffer":
            self.calls += 1
        else:
            x.mul_(1.0)  # (a view of the input: the user's own tensor)
            x[:, 0].add_(0.0)
        return self.lin(x)


@pytest.mark.parametrize("what", ["buffer", "input"])
def test_writes_into_tensors_from_before_the_call_are_not_held(compiled, what):
    model, y = Counts(what).double(), torch.randint(0, 2, (B,))
    x = torch.randn(B, D, dtype=torch.float64)
    for _ in range(4):
        persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    assert not any(isinstance(found, (Program, Compiled)) for found in kept(model))
    check(model, x, y, nn.CrossEntropyLoss())


class ReadThenWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):  # (B, D)
        h = x * 1.0
        out = self.lin(h)  # (its rule needs h as it was)
        h.mul_(2.0)
        return out + h[:, :2]


def test_a_write_into_what_an_op_read_keeps_the_full_capture(compiled):
    model, y = ReadThenWritten().double(), torch.randint(0, 2, (B,))
    x = torch.randn(B, D, dtype=torch.float64)
    for _ in range(3):
        with pytest.raises(InPlaceModificationError, match="modified in place"):
            persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")
    assert not any(isinstance(found, (Program, Compiled)) for found in kept(model))


class Residual(nn.Module):
    """A residual block as torchvision's ResNet writes it: ``out += identity`` then
    ``ReLU(inplace=True)``, the same tensor written twice."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 2)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):  # (B, T, D)
        identity = self.relu(self.lin(x))
        out = self.lin2(identity)
        out += identity
        out = self.relu(out)
        return self.head(out.sum(1))


def test_a_tensor_written_twice_takes_the_cached_call(compiled):
    model, y, loss = Residual().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    for k in range(4):
        check(model, _inputs(k)["x"], y, loss)
    want = Compiled if compiled else Program
    assert any(isinstance(found, want) for found in kept(model)), kept(model)
