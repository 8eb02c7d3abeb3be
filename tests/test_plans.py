"""The data flow kept from earlier calls (persample.capture.tape, persample.engine.tapes):
later calls like the first take it op by op, and any op that differs (another path
through the code, other arguments, an input from elsewhere, other values) is decided
again: every answer equals the loop's, in float64, whatever changed between calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from persample.capture.tape import Opaque, arguments_key

B = T = 4  # the batch size equals the sequence length: nothing may be inferred from sizes
D = 3


def _check(model, x, y, loss_fn, method="rules"):
    fast = persample.per_sample_grads(model, x, y, loss_fn, method=method)
    slow = persample.loop_per_sample_grads(model, x, y, loss_fn)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


def _plan(model, x, y, loss_fn) -> str:
    return persample.verify(model, x, y, loss_fn).plan


class Switch(nn.Module):
    """A model whose code takes one of several paths by a Python attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.skip = nn.Linear(D, 2)
        self.table = nn.Parameter(torch.randn(T, D))
        self.dim, self.wire, self.perm = 1, "own", None

    def forward(self, x):  # (B, T, D)
        h = torch.tanh(self.lin(x))  # (B, T, D)
        h = torch.sin(h)
        if self.perm is not None:  # rows taken by an index whose values differ by call
            h = h[:, self.perm]
        # dim 1: per sample; dim 0: sums the samples
        return self.head(h.sum(self.dim)) + self.skip(x.sum(1))


def _data():
    torch.manual_seed(0)
    return torch.randn(B, T, D), torch.randint(0, 2, (B,))


def test_steady_state_takes_the_data_flow_and_stays_exact():
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    persample.clear_plans()
    assert _plan(model, x, y, loss).startswith("new")
    for _ in range(6):  # (its program, then its compiled call, whose first call is new)
        _check(model, x, y, loss)
    assert _plan(model, x, y, loss).startswith("cached")
    x2 = torch.randn(B, T, D)  # other values, same shapes: the same data flow
    _check(model, x2, y, loss)


def test_an_argument_that_changes_is_decided_again():
    """``h.sum(1)`` and ``h.sum(0)`` have the same shape here (B == T); the second sums the
    samples, which the rules refuse: a kept step must not answer for it."""
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    _check(model, x, y, loss)
    _check(model, x, y, loss)
    model.dim = 0
    with pytest.raises(persample.LossNotPerSampleError, match="reduces over the batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    model.dim = 1
    _check(model, x, y, loss)


class Wired(nn.Module):
    """The same ops in every call, one of them reading a shared tensor or a per-sample
    one of the same shape."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.table = nn.Parameter(torch.randn(T, D))
        self.wire = "shared"

    def forward(self, x):  # (B, T, D)
        h = self.lin(x)
        shared = self.table.detach().expand_as(h) * 1.0  # (B, T, D), no sample in it
        z = torch.sin(shared if self.wire == "shared" else h)
        z = z.mean(0, keepdim=True) + h  # a mean over dim 0: of h, it mixes the samples
        return self.head(z.sum(1))


def test_an_input_from_elsewhere_is_decided_again():
    """``sin`` reads a per-sample tensor where it read a shared one of the same shape, and
    the same ops follow: the mean over dim 0 that was harmless now mixes the samples."""
    model, (x, y) = Wired(), _data()
    loss = nn.CrossEntropyLoss()
    _check(model, x, y, loss)
    _check(model, x, y, loss)
    model.wire = "own"
    with pytest.raises(persample.LossNotPerSampleError, match="mean reduces over the batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    model.wire = "shared"
    _check(model, x, y, loss)


def test_index_values_are_read_in_every_call():
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    model.perm = torch.tensor([0, 1, 2, 3])
    _check(model, x, y, loss)
    _check(model, x, y, loss)
    model.perm = torch.tensor([2, 0, 3, 1])  # same shape, other rows for each sample
    _check(model, x, y, loss)


def test_other_shapes_and_batch_sizes_keep_their_own():
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    for b in (4, 3, 4, 3, 1, 4):
        _check(model, x[:b], y[:b], loss)


def test_cache_plans_off_and_clear():
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    _check(model, x, y, loss)
    before = persample.cache_plans(False)
    try:
        assert before is True
        _check(model, x, y, loss)
        assert _plan(model, x, y, loss).startswith("new")
    finally:
        persample.cache_plans(before)
    _check(model, x, y, loss)
    assert _plan(model, x, y, loss).startswith("cached")
    persample.clear_plans()
    assert _plan(model, x, y, loss).startswith("new")
    with pytest.raises(TypeError, match="cache_plans"):
        persample.cache_plans("no")


def test_supported_says_whether_the_call_took_kept_data_flow():
    model, (x, y) = Switch(), _data()
    loss = nn.CrossEntropyLoss()
    persample.clear_plans()
    assert persample.supported(model, x, y, loss).plan.startswith("new")
    assert persample.supported(model, x, y, loss).plan.startswith("cached")
    assert persample.supported(model).plan == ""  # (no inputs: no call)


def test_training_mode_draws_anew_each_call():
    """Dropout's masks are drawn in every call; the answer is the forward that ran."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
    model = nn.Sequential(nn.Linear(D, 8), nn.TransformerEncoder(
        layer, 2, enable_nested_tensor=False), nn.Flatten(), nn.Linear(8 * T, 2)).train()
    x, y = _data()
    loss = nn.CrossEntropyLoss()
    for seed in range(3):
        torch.manual_seed(seed)
        fast = persample.per_sample_grads(model, x, y, loss)
        torch.manual_seed(seed)
        slow = persample.forward_per_sample_grads(model, x, y, loss)
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-9, atol=1e-12)
    assert _plan(model, x, y, loss).startswith("cached")


def test_the_model_is_not_kept_alive():
    import gc
    import weakref

    model, (x, y) = Switch(), _data()
    _check(model, x, y, nn.CrossEntropyLoss())
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_arguments_key():
    x = torch.zeros(2)
    assert arguments_key((x, [1, 2], slice(None, 3)), {"dim": -1}) == arguments_key(
        (x, [1, 2], slice(None, 3)), {"dim": -1})
    assert arguments_key((x, (1, 2)), {}) != arguments_key((x, [1, 2]), {})
    with pytest.raises(Opaque):
        arguments_key((x, object()), {})


def test_no_step_keeps_a_layout_that_holds_tensors():
    """A layout holding this call's values (a packed batch's sample ids, a sorted dim's
    keys, the rows a scatter wrote) is not kept for the next call, nor any tensor."""
    from persample.batch import SHARED, Batched, Flow
    from persample.batch.ops_indexing import Partly, Sorted
    from persample.capture.tape import reusable

    x = torch.zeros(4, 3)
    plain = Flow(Batched(0))
    assert reusable(torch.add, plain, [Batched(0), SHARED], [x, x])
    ids = torch.arange(4)
    for lay in (Batched(0, index=ids), Sorted(0, keys=ids), Partly("rows", rows=ids)):
        assert not reusable(torch.add, Flow(lay), [Batched(0)], [x])
        assert not reusable(torch.add, plain, [lay], [x])
    # an integer input whose values the op's flow reads (an index) is decided again at
    # every call; one an elementwise op or a view reads (a mask's ge, its expand) is not
    assert not reusable(torch.gather, plain, [Batched(0), Batched(0)], [x, ids])
    assert not reusable(torch.Tensor.__getitem__, plain, [Batched(0), Batched(0)], [x, ids])
    assert reusable(torch.ge, plain, [Batched(0)], [ids])
    assert reusable(torch.Tensor.expand, plain, [Batched(0)], [ids])
    assert reusable(torch.Tensor.__getitem__, plain, [Batched(0)], [ids])  # ids[:, None]


def test_arguments_of_equal_value_and_other_type_differ():
    x = torch.zeros(2)
    assert arguments_key((x, 1), {}) != arguments_key((x, True), {})
    assert arguments_key((x, 1), {}) != arguments_key((x, 1.0), {})
