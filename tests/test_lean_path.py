"""The program a full capture traces (persample.capture.lean): later calls like it check
each op against it instead of following it, on any model (transformers' included), and
every answer still equals the loop's in float64, whatever changed between calls."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import persample
from cached_calls import (
    B,
    D,
    Logits,
    Switch,
    T,
    bert,
    changed_between_calls,
    check,
    data,
    gpt2,
    kept,
    logits_loss,
)
from persample.capture import Capture
from persample.capture.lean import LeanCapture, Program
from persample.engine import captured_forward
from persample.inputs import as_batch


@pytest.fixture(autouse=True)
def programs_not_compiled():
    """The program's own path: a call that keeps coming back is not compiled here
    (tests/test_compiled_path.py runs the same questions compiled)."""
    before = persample.compile_calls(False)
    yield
    persample.compile_calls(before)




def _capture_of(model, x) -> Capture:
    watched = {id(p): p for p in model.parameters() if p.requires_grad}
    cap, _ = captured_forward(model, as_batch(x), watched)
    return cap










@pytest.mark.parametrize("make", [bert, gpt2], ids=["bert", "gpt2"])
def test_transformers_take_the_program_and_stay_exact(make):
    torch.manual_seed(0)
    model, y = make(), torch.randint(0, 3, (B,))
    persample.clear_plans()
    for k in range(4):
        ids = torch.randint(2, 50, (B, T))
        mask = torch.ones(B, T, dtype=torch.long)
        mask[k % B, T - 2:] = 0  # (another sample padded in each call)
        inputs = {"input_ids": ids, "attention_mask": mask}
        check(model, inputs, y, logits_loss)
    assert any(isinstance(kept, Program) for kept in kept(model))
    assert isinstance(_capture_of(model, inputs), LeanCapture)
    assert persample.verify(model, inputs, y, logits_loss).plan.startswith("cached: each")


def test_a_steady_call_follows_no_forward_op(monkeypatch):
    """Counted: in the steady state only the loss's ops reach the full capture."""
    torch.manual_seed(0)
    model, y = bert(), torch.randint(0, 3, (B,))
    inputs = {"input_ids": torch.randint(2, 50, (B, T))}
    for _ in range(3):
        persample.per_sample_grads(model, inputs, y, logits_loss)
    seen = []
    record = Capture.record

    def counting(self, func, args, kwargs):
        seen.append(func)
        return record(self, func, args, kwargs)

    monkeypatch.setattr(Capture, "record", counting)
    persample.per_sample_grads(model, inputs, y, logits_loss)
    forward_ops = len(_capture_of(model, inputs).program.entries)
    assert forward_ops > 50 and len(seen) <= 3, (forward_ops, seen)




def _steady(model, x, y, loss):
    persample.clear_plans()
    for _ in range(3):
        check(model, x, y, loss)
    assert isinstance(_capture_of(model, x), LeanCapture)




def test_an_attribute_that_changes_an_argument_is_caught():
    model, (x, y) = Switch().double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss)
    model.dim = 0  # (B == T: the same shapes)
    with pytest.raises(persample.LossNotPerSampleError, match="reduces over the batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    model.dim = 1
    check(model, x, y, loss)
    assert isinstance(_capture_of(model, x), LeanCapture)


def test_a_branch_on_values_is_caught():
    model, (x, y) = Switch().double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss)
    x2 = x.clone()
    x2[3, 0, 0] = 9.0  # the same shapes; the branch that mixes the samples
    with pytest.raises(persample.LossNotPerSampleError):
        persample.per_sample_grads(model, x2, y, loss, method="rules")
    check(model, torch.randn_like(x), y, loss)


def test_an_input_from_elsewhere_is_caught():
    model, (x, y) = Switch().double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss)
    model.wire = "shared"  # its mean over dim 0 now mixes per-sample rows
    with pytest.raises(persample.LossNotPerSampleError, match="batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")


def test_index_values_are_read_in_every_call():
    model, (x, y) = Switch().double(), data()
    loss = nn.CrossEntropyLoss()
    model.perm = torch.arange(T)
    _steady(model, x, y, loss)
    model.perm = torch.tensor([2, 0, 3, 1, 5, 4])  # same shape, other rows per sample
    check(model, x, y, loss)
    model.perm = torch.tensor([1, 1, 1, 0, 0, 0])
    check(model, x, y, loss)


def test_buffers_parameters_and_modules_changed_between_calls():
    model, (x, y) = Switch().double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss)
    changed_between_calls(model, x, y, loss)


def test_the_model_is_not_kept_alive():
    model, y = gpt2(), torch.randint(0, 3, (B,))
    inputs = {"input_ids": torch.randint(2, 50, (B, T))}
    for _ in range(3):
        persample.per_sample_grads(model, inputs, y, logits_loss)
    assert any(isinstance(kept, Program) for kept in kept(model))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


class Frozen(nn.Module):
    """A block run without autograd by a flag: the same ops, shapes and arguments."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.frozen = False

    def forward(self, x):
        with torch.set_grad_enabled(not self.frozen):
            h = torch.tanh(self.lin(x))
        return self.head(h)


def test_a_block_run_without_autograd_is_caught():
    torch.manual_seed(0)
    model = Frozen().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 2, (B,))
    _steady(model, x, y, F.cross_entropy)
    model.frozen = True
    fast = persample.per_sample_grads(model, x, y, F.cross_entropy)
    slow = persample.loop_per_sample_grads(model, x, y, F.cross_entropy)
    for name in slow:  # (the frozen block's parameters: no gradient, zero or absent)
        want = slow[name] if slow[name] is not None else torch.zeros_like(fast[name])
        torch.testing.assert_close(fast.get(name, torch.zeros_like(want)), want)
    assert torch.is_grad_enabled()


class Swallows(nn.Module):
    """A forward that takes any exception for a fallback of its own."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.odd = False

    def forward(self, x):
        h = self.lin(x)
        try:
            h = torch.sin(h) if self.odd else torch.tanh(h)
        except BaseException:  # noqa: BLE001 (what the test is about)
            h = torch.tanh(h)
        return self.head(h)


def test_a_forward_that_swallows_the_stop_still_runs_again():
    torch.manual_seed(0)
    model = Swallows().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 2, (B,))
    _steady(model, x, y, F.cross_entropy)
    model.odd = True
    check(model, x, y, F.cross_entropy)
    check(model, x, y, F.cross_entropy)


def test_a_program_that_keeps_failing_is_dropped():
    """A buffer replaced before every call (a new object where the program had another):
    every call leaves the program; after a few, none is kept, and every answer is exact."""
    torch.manual_seed(0)
    model = Switch().double()
    x, y = torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, 2, (B,))
    for k in range(8):
        model.register_buffer("scale", torch.full((D,), 1.0 + k, dtype=torch.float64))
        check(model, x, y, nn.CrossEntropyLoss())
    assert not any(isinstance(kept, Program) for kept in kept(model))


class Casts(nn.Module):
    """A block under autocast by a flag."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.cast = False

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cast):
            h = torch.tanh(self.lin(x))
        return self.head(h.float())


def test_a_stop_leaves_autograd_and_autocast_as_they_were():
    torch.manual_seed(0)
    model = Casts().float()
    x, y = torch.randn(B, D, dtype=torch.float32), torch.randint(0, 2, (B,))
    for _ in range(3):
        persample.per_sample_grads(model, x, y, F.cross_entropy)
    assert isinstance(_capture_of(model, x), LeanCapture)
    model.cast = True
    fast = persample.per_sample_grads(model, x, y, F.cross_entropy)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    slow = persample.loop_per_sample_grads(model, x, y, F.cross_entropy)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=2e-2, atol=2e-2)




def test_training_mode_draws_in_the_program():
    """Dropout on (BERT's, 0.1): each call's draws are the forward's own, against one
    batch forward under the same seed."""
    from persample.reference import forward_per_sample_grads

    model, y = Logits(bert().train()), torch.randint(0, 3, (B,))
    for k in range(4):
        ids = torch.randint(2, 50, (B, T))
        torch.manual_seed(k)
        fast = persample.per_sample_grads(model, ids, y, F.cross_entropy)
        torch.manual_seed(k)
        slow = forward_per_sample_grads(model, ids, y, F.cross_entropy)
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)
    cap = _capture_of(model, ids)
    assert isinstance(cap, LeanCapture) and len(cap.draws) > 0


class DropThenBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.head = nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, 2)

    def forward(self, x):
        h = self.drop(self.lin(x))
        if bool((x[:, 0] > 5).any()):  # after the draw: a stop here has drawn already
            h = h * 2.0
        return self.head(h)


def test_a_stop_after_a_draw_draws_the_same_numbers_again():
    from persample.reference import forward_per_sample_grads

    torch.manual_seed(0)
    model = DropThenBranch().double().train()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 2, (B,))
    for _ in range(3):
        persample.per_sample_grads(model, x, y, F.cross_entropy)
    assert isinstance(_capture_of(model, x), LeanCapture)
    x2 = x.clone()
    x2[2, 0] = 9.0
    torch.manual_seed(5)
    fast = persample.per_sample_grads(model, x2, y, F.cross_entropy)
    after = torch.rand(1)
    torch.manual_seed(5)
    slow = forward_per_sample_grads(model, x2, y, F.cross_entropy)
    assert torch.equal(torch.rand(1), after)  # (as many numbers drawn as one forward)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)
