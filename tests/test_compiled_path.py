"""The compiled call (persample.capture.compiled): once a call's program has held, its
forward runs as one TorchDynamo graph with no op intercepted, and every answer still
equals the loop's in float64, whatever changed between calls."""

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
from persample.capture.compiled import Compiled, CompiledCapture
from persample.capture.lean import LeanCapture, Program
from persample.engine import tapes


@pytest.fixture(autouse=True)
def compile_at_once(monkeypatch):
    """The forward compiled from the call after the one that traced its program."""
    monkeypatch.setattr(tapes, "COMPILE_AFTER", 0)
    persample.clear_plans()


@pytest.fixture
def ran(monkeypatch):
    """Per call since: did it run the compiled graph's plan (True), or not (False)."""
    found = []
    finish = CompiledCapture.finish

    def spy(self, output):
        done = finish(self, output)
        found.append(done)
        return done

    monkeypatch.setattr(CompiledCapture, "finish", spy)
    return found












@pytest.mark.parametrize("make", [bert, gpt2], ids=["bert", "gpt2"])
def test_transformers_run_compiled_and_stay_exact(make, ran):
    torch.manual_seed(0)
    model, y = make(), torch.randint(0, 3, (B,))
    for k in range(5):
        ids = torch.randint(2, 50, (B, T))
        mask = torch.ones(B, T, dtype=torch.long)
        mask[k % B, T - 2:] = 0  # (another sample padded in each call)
        check(model, {"input_ids": ids, "attention_mask": mask}, y, logits_loss)
    assert any(isinstance(kept, Compiled) for kept in kept(model))
    assert ran[-2:] == [True, True], ran
    note = persample.verify(model, {"input_ids": ids, "attention_mask": mask}, y,
                            logits_loss).plan
    assert note.startswith("cached: compiled"), note


def test_a_steady_call_follows_no_forward_op(monkeypatch, ran):
    """Counted: in the steady state no forward op reaches a capture or a program's
    check; only the loss's ops are followed."""
    torch.manual_seed(0)
    model, y = bert(), torch.randint(0, 3, (B,))
    inputs = {"input_ids": torch.randint(2, 50, (B, T))}
    for _ in range(4):
        persample.per_sample_grads(model, inputs, y, logits_loss)
    seen, checked = [], []
    record, run = Capture.record, LeanCapture.run

    def counting(self, func, args, kwargs):
        seen.append(func)
        return record(self, func, args, kwargs)

    def checking(self, func, args, kwargs):
        checked.append(func)
        return run(self, func, args, kwargs)

    monkeypatch.setattr(Capture, "record", counting)
    monkeypatch.setattr(LeanCapture, "run", checking)
    persample.per_sample_grads(model, inputs, y, logits_loss)
    assert ran[-1] is True
    assert len(seen) <= 3 and not checked, (seen, checked)






def _steady(model, x, y, loss, ran):
    for _ in range(4):
        check(model, x, y, loss)
    assert ran[-1] is True, ran


def test_an_attribute_that_changes_an_argument_is_caught(ran):
    model, (x, y) = Switch(values=False).double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss, ran)
    model.dim = 0  # (B == T: the same shapes)
    with pytest.raises(persample.LossNotPerSampleError, match="reduces over the batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    model.dim = 1
    check(model, x, y, loss)
    assert ran[-1] is True


def test_an_input_from_elsewhere_is_caught(ran):
    model, (x, y) = Switch(values=False).double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss, ran)
    model.wire = "shared"  # its mean over dim 0 now mixes per-sample rows
    with pytest.raises(persample.LossNotPerSampleError, match="batch"):
        persample.per_sample_grads(model, x, y, loss, method="rules")


def test_index_values_are_read_in_every_call(ran):
    model, (x, y) = Switch(values=False).double(), data()
    loss = nn.CrossEntropyLoss()
    model.perm = torch.arange(T)
    _steady(model, x, y, loss, ran)
    model.perm = torch.tensor([2, 0, 3, 1, 5, 4])  # same shape, other rows per sample
    check(model, x, y, loss)
    model.perm = torch.tensor([1, 1, 1, 0, 0, 0])
    check(model, x, y, loss)
    assert ran[-1] is True


def test_buffers_parameters_and_modules_changed_between_calls(ran):
    model, (x, y) = Switch(values=False).double(), data()
    loss = nn.CrossEntropyLoss()
    _steady(model, x, y, loss, ran)
    changed_between_calls(model, x, y, loss)


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if bool((x[:, 0] > 5).any()):  # a branch on values: no one graph
            h = h + h.mean(0, keepdim=True)
        return self.head(h)


def test_a_branch_on_values_keeps_the_program(ran):
    torch.manual_seed(0)
    model = Branch().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 2, (B,))
    for _ in range(4):
        check(model, x, y, F.cross_entropy)
    assert not any(ran)  # (TorchDynamo refused the one graph: the program kept instead)
    assert kept(model) and all(isinstance(kept, Program) for kept in kept(model))
    x2 = x.clone()
    x2[3, 0] = 9.0  # the branch that mixes the samples
    with pytest.raises(persample.LossNotPerSampleError):
        persample.per_sample_grads(model, x2, y, F.cross_entropy, method="rules")




def test_training_mode_draws_as_the_forward_that_ran(ran):
    """Dropout on (BERT's, 0.1): each call's draws are the forward's own, against one
    batch forward under the same seed, and the generator is left where it would be."""
    from persample.reference import forward_per_sample_grads

    model, y = Logits(bert().train()), torch.randint(0, 3, (B,))
    for k in range(5):
        ids = torch.randint(2, 50, (B, T))
        torch.manual_seed(k)
        fast = persample.per_sample_grads(model, ids, y, F.cross_entropy)
        after = torch.rand(3)
        torch.manual_seed(k)
        slow = forward_per_sample_grads(model, ids, y, F.cross_entropy)
        assert torch.equal(after, torch.rand(3))
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)
    assert ran[-2:] == [True, True], ran


def test_the_model_is_not_kept_alive(ran):
    model, y = gpt2(), torch.randint(0, 3, (B,))
    inputs = {"input_ids": torch.randint(2, 50, (B, T))}
    for _ in range(4):
        persample.per_sample_grads(model, inputs, y, logits_loss)
    assert ran[-1] is True
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


class Scaled(nn.Module):
    """Not an ``nn.Sequential`` of torch's layers: the stock path does not take it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3))

    def forward(self, x):
        return self.inner(x) * 2.0


def _scaled_steady(ran):
    """A :class:`Scaled` in float64 and its data, after the calls that compile it."""
    torch.manual_seed(0)
    model = Scaled().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(4):
        check(model, x, y, F.cross_entropy)
    assert ran[-1] is True
    return model, x, y


def test_gradient_norms_take_it(ran):
    torch.manual_seed(0)
    model = Scaled().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(4):
        norms = persample.per_sample_grad_norms(model, x, y, F.cross_entropy)
    assert ran[-1] is True
    slow = persample.loop_per_sample_grads(model, x, y, F.cross_entropy)
    want = torch.cat([g.flatten(1) for g in slow.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-12)


def test_a_hook_added_later_is_followed(ran):
    """A forward hook registered after the graph was traced changes the forward:
    TorchDynamo traces it again, and the answer follows the hook."""
    model, x, y = _scaled_steady(ran)
    handle = model.inner[0].register_forward_hook(lambda m, a, out: out * 3.0 + 1.0)
    try:
        check(model, x, y, F.cross_entropy)
        check(model, x, y, F.cross_entropy)
        assert ran[-1] is True
    finally:
        handle.remove()
    check(model, x, y, F.cross_entropy)


def test_certified_calls_replay_the_draws_of_the_compiled_forward(ran):
    """A certificate asked for every call checks the compiled call's rows against one
    batch forward that draws what it drew."""
    model, y = Logits(bert().train()), torch.randint(0, 3, (B,))
    ids = torch.randint(2, 50, (B, T))
    for _ in range(5):
        persample.per_sample_grads(model, ids, y, F.cross_entropy, check="always")
    assert ran[-2:] == [True, True], ran


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = torch.tanh(self.lin(x))
        return self.head(h)


def test_autocast_entered_inside_keeps_the_program(ran):
    torch.manual_seed(0)
    model = AutocastInside().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(5):
        check(model, x, y, F.cross_entropy)
    assert not any(ran)


def test_compile_calls_off_and_on(ran):
    torch.manual_seed(0)
    model = Scaled().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    before = persample.compile_calls(False)
    try:
        assert before is True
        for _ in range(4):
            check(model, x, y, F.cross_entropy)
        assert not ran and not any(isinstance(k, Compiled) for k in kept(model))
    finally:
        persample.compile_calls(before)
    for _ in range(3):
        check(model, x, y, F.cross_entropy)
    assert ran[-1] is True
    with pytest.raises(TypeError, match="takes a bool"):
        persample.compile_calls("no")


def test_the_model_is_left_as_it_was(ran):
    """TorchDynamo's tracing marks the parameters it reads; the marks are taken off."""
    model, x, y = _scaled_steady(ran)
    assert all(not vars(p) for p in model.parameters())


def test_a_global_hook_added_later_is_followed(ran):
    """TorchDynamo guards no global module hook: with one registered, the forward runs
    under the program, and the answer follows the hook."""
    model, x, y = _scaled_steady(ran)
    done = len(ran)

    def hook(module, args, out):
        return out * 2.0 + 1.0 if isinstance(module, nn.Linear) else None

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        for _ in range(3):
            check(model, x, y, F.cross_entropy)
        assert len(ran) == done
    finally:
        handle.remove()
    check(model, x, y, F.cross_entropy)
    assert ran[-1] is True


@pytest.mark.parametrize("when", ["after the trace", "before the trace"])
def test_a_patched_torch_function_is_followed(monkeypatch, ran, when):
    """TorchDynamo guards none of torch's functions, and the graph's code calls them by
    name: a patched one (after the trace, or before it: the trace inlined the patch)
    keeps the program, and the answer follows the patch."""
    torch.manual_seed(0)
    model = Scaled().double()
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    original = torch.tanh
    if when == "before the trace":
        monkeypatch.setattr(torch, "tanh", lambda t: original(t) * 0.5)
    for _ in range(4):
        check(model, x, y, F.cross_entropy)
    if when == "after the trace":
        assert ran[-1] is True
        monkeypatch.setattr(torch, "tanh", lambda t: original(t) * 0.5)
    done = sum(ran)
    for _ in range(3):
        check(model, x, y, F.cross_entropy)
    assert sum(ran) == done


def test_bfloat16_autocast_gives_the_programs_answer(ran):
    """Under bfloat16 autocast (entered around the call), the compiled call's records
    carry the autocast state its ops ran under: its answer is the program's, to the bit,
    and near the loop's (bfloat16's precision)."""
    torch.manual_seed(0)
    model = Scaled()
    x, y = torch.randn(B, D), torch.randint(0, 3, (B,))

    def grads():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return persample.per_sample_grads(model, x, y, F.cross_entropy, method="rules")

    for _ in range(4):
        compiled = grads()
    assert ran[-1] is True
    before = persample.compile_calls(False)
    try:
        program = grads()
    finally:
        persample.compile_calls(before)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slow = persample.loop_per_sample_grads(model, x, y, F.cross_entropy)
    for name in slow:
        assert torch.equal(compiled[name], program[name]), name
        torch.testing.assert_close(compiled[name], slow[name], rtol=2e-2, atol=2e-2)


class NewTensor(nn.Module):
    """``x.new_tensor(y)``: ``torch.tensor`` in TorchDynamo's graph, an op with no data
    flow rule, where the eager forward's op has one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):  # (B, D)
        fresh = x.new(x.shape[0], 2).fill_(0.5)  # (B, 2), no sample's data
        return self.lin(x) * fresh + x.new_tensor(x[:, :2])


@pytest.mark.filterwarnings("ignore:To copy construct")
def test_a_graph_whose_ops_have_another_data_flow_runs_eagerly(ran):
    model, y = NewTensor().double(), torch.randint(0, 2, (B,))
    x = torch.randn(B, D, dtype=torch.float64)
    for _ in range(4):  # (the graph's analysis finds no layout for its output: not taken)
        check(model, x, y, F.cross_entropy)
    assert ran == [], ran
    assert kept(model) and all(isinstance(found, Program) for found in kept(model))


# ---------------------------------------------------------------------------
# a model the user compiled


@pytest.mark.parametrize("where", ["model", "block"])
def test_a_model_the_user_compiled_runs_compiled(ran, where):
    """A model ``torch.compile`` returned (or one holding such a block) takes the
    compiled call like any other: TorchDynamo traces the module it wraps into a graph of
    persample's own; every answer is the loop's, and the user's compiled model still
    answers as its eager module does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Scaled().double()
    if where == "model":
        model = torch.compile(eager, backend="eager")
    else:
        model = nn.Sequential(torch.compile(eager, backend="eager"), nn.Linear(3, 3).double())
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(5):
        check(model, x, y, F.cross_entropy)
    assert ran[-2:] == [True, True], ran
    assert persample.verify(model, x, y, F.cross_entropy).plan.startswith("cached: compiled")
    torch.testing.assert_close(model(x), eager(x) if where == "model" else
                               model[1](eager(x)), rtol=0, atol=0)


def test_a_model_the_user_compiled_changed_between_calls(ran):
    """The staleness checks hold through the wrapper: the module it wraps changed between
    calls (buffers, parameters, a replaced layer, an attribute choosing the path)."""
    torch._dynamo.reset()
    inner, (x, y) = Switch(values=False).double(), data()
    model, loss = torch.compile(inner, backend="eager"), nn.CrossEntropyLoss()
    _steady(model, x, y, loss, ran)
    inner.perm = torch.arange(T - 1, -1, -1)  # (rows of each sample reversed)
    check(model, x, y, loss)
    inner.perm = None
    changed_between_calls(model, x, y, loss, owner=inner)


def test_a_hook_on_the_users_compiled_wrapper_is_followed(ran):
    """TorchDynamo traces a ``torch.compile`` wrapper as the module it wraps, without the
    wrapper's own hooks: a call of a wrapper holding one is not compiled, and the answer
    follows the hook."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(Scaled().double(), backend="eager")
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(4):
        check(model, x, y, F.cross_entropy)
    assert ran[-1] is True
    done = len(ran)
    handle = model.register_forward_hook(lambda m, a, out: out * 3.0 + 1.0)
    try:
        for _ in range(3):
            check(model, x, y, F.cross_entropy)
        assert len(ran) == done  # (no compiled call ran)
    finally:
        handle.remove()
    check(model, x, y, F.cross_entropy)
    assert ran[-1] is True


class RelativeBias(nn.Module):
    """A shared index built in place and changed again after a lookup read it (as
    transformers' BEiT builds its relative position index): decisions on shared tensors
    read no values, so the graph's plan holds."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * T - 1))
        self.head = nn.Linear(D, 3)

    def forward(self, x):  # (B, T, D)
        coords = torch.arange(T, device=x.device)
        offsets = coords[:, None] - coords[None, :]  # (T, T)
        index = torch.zeros(T, T, dtype=torch.long, device=x.device)
        index[:, :] = offsets  # (a write that reads the offsets)
        index += T - 1
        offsets.mul_(2)  # (changed after that write read them)
        bias = self.table[index]  # (T, T), read at the index's values
        att = torch.softmax(x @ x.transpose(1, 2) + bias + offsets, -1)  # (B, T, T)
        return self.head((att @ x).mean(1))


def _runs_compiled(make, ran):
    """``make()`` in float64 and its data, after the calls that compile it and two
    compiled calls (every answer the loop's)."""
    torch.manual_seed(0)
    model = make().double()
    x, y = torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    for _ in range(5):
        check(model, x, y, F.cross_entropy)
    assert ran[-2:] == [True, True], ran
    return model, x, y


def test_a_shared_index_written_after_a_lookup_keeps_the_plan(ran):
    _runs_compiled(RelativeBias, ran)


class Inverted(nn.Module):
    """A mask inverted with ``~`` (DeBERTa's attention mask): ``__invert__`` begins as the
    augmented assignments do and writes nothing."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):  # (B, T, D)
        keep = x[..., 0] > 0  # (B, T)
        h = torch.tanh(self.lin(x)).masked_fill(~keep[..., None], 0.0)
        return self.head(h.sum(1))


def test_an_inverted_mask_keeps_the_plan(ran):
    _runs_compiled(Inverted, ran)


class MaskToken(nn.Module):
    """A parameter no op reads unless asked (a masked-image model's mask token, a
    pooler the head skips): confirmed unused by each call's backward."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 3)
        self.token = nn.Parameter(torch.randn(D))
        self.masked = False

    def forward(self, x):  # (B, T, D)
        if self.masked:
            x = torch.cat([x[:, :1] * 0 + self.token, x[:, 1:]], 1)
        return self.head(torch.tanh(self.lin(x)).mean(1))


def test_an_unused_parameter_keeps_the_cached_path(ran):
    """Every call, cached or not, answers zeros for the parameter no op read, and a call
    that reads it after all (a flag flipped) still gets the loop's answer."""
    model, x, y = _runs_compiled(MaskToken, ran)
    got = persample.per_sample_grads(model, x, y, F.cross_entropy)
    assert not got["token"].any()
    model.masked = True
    for _ in range(3):
        check(model, x, y, F.cross_entropy)
    assert not persample.per_sample_grads(model, x, y, F.cross_entropy)["token"].eq(0).all()


class AddedBias(nn.Module):
    """Biases made of parameters alone added in place to attention scores (MPNet's and
    T5's ``scores += position_bias``, a table widened to the batch; a shift subtracted):
    a shift's rule reads no value of what it overwrites, so its record keeps no copy and
    the program holds it. A scale multiplied in place (``flags['scale']``) is no shift:
    its record keeps the scores it overwrote, and its calls leave the cached paths."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, T, T))
        self.shift = nn.Parameter(torch.randn(T))
        self.scale = nn.Parameter(torch.rand(T) + 0.5)
        self.head = nn.Linear(D, 3)
        self.scaled = False

    def forward(self, x):  # (B, T, D)
        scores = x @ x.transpose(1, 2)  # (B, T, T)
        scores += self.table.expand(x.shape[0], T, T).contiguous()
        scores -= self.shift
        if self.scaled:
            scores *= self.scale
        return self.head((torch.softmax(scores, -1) @ x).mean(1))


def _flagged_off_the_plan(model, flag, x, y, ran):
    """With ``flag`` set, calls that leave the compiled call (none of them runs it), each
    still the loop's."""
    setattr(model, flag, True)
    before = len(ran)
    for _ in range(3):
        check(model, x, y, F.cross_entropy)
    assert not any(ran[before:]), ran


def test_a_bias_added_in_place_keeps_the_plan(ran):
    model, x, y = _runs_compiled(AddedBias, ran)
    _flagged_off_the_plan(model, "scaled", x, y, ran)  # (a scale in place: no program)


def test_a_shift_in_place_keeps_no_copy_of_its_target():
    """The full capture's records: ``+=`` and ``-=`` of a parameter keep nothing of the
    scores they overwrite, ``*=`` keeps the scores as they were."""
    model = AddedBias().double()
    model.scaled = True
    x = torch.randn(B, T, D, dtype=torch.float64)
    with Capture(model, {id(p): p for p in model.parameters()}, B, [x]) as cap:
        model(x)
    kept_copy = {op.func.__name__: op.before is not None for op in cap.ops
                 if op.func.__name__.endswith("_")}
    assert kept_copy == {"add_": False, "sub_": False, "mul_": True}, kept_copy


class ProductAdded(nn.Module):
    """``baddbmm`` of a bias made from the batch and two per-sample operands (BLOOM's
    ALiBi scores): reading no parameter, it is one op with a data flow of its own, not
    its expansion, and the program holds it. Of a table widened to the batch
    (``flags: table``), it runs as its expansion, whose ops' rules give the table's."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.table = nn.Parameter(torch.randn(1, T, T))
        self.tabled = False

    def forward(self, x):  # (B, T, D)
        bias = x[..., :1] * x[..., 1:2].transpose(1, 2)  # (B, T, T)
        if self.tabled:
            bias = self.table.expand(x.shape[0], T, T)
        scores = torch.baddbmm(bias, self.q(x), self.k(x).transpose(1, 2), beta=0.5,
                               alpha=D ** -0.5)
        return self.head((torch.softmax(scores, -1) @ x).mean(1))


def test_a_product_with_an_added_term_keeps_the_plan(ran):
    model, x, y = _runs_compiled(ProductAdded, ran)
    _flagged_off_the_plan(model, "tabled", x, y, ran)  # (its expansion: no program)
    assert persample.per_sample_grads(model, x, y, F.cross_entropy)["table"].any()
