"""Nothing is left on the model after a call, also when the forward, loss or backward raises.

The ``snapshot`` fixture (conftest.py) records hooks of every kind, every
module's ``__dict__``, ``training`` flags, parameter identities, values,
``requires_grad``, attributes and ``.grad`` (``None`` stays ``None``, an existing
tensor keeps its identity and values), and buffers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from battery import METHODS, assert_grads_equal
from cases import BY_ID, N, Scale, as_tuple, build, randn
from persample import loop_per_sample_grads, per_sample_grads

STATE_CASES = [
    "mlp", "simple-cnn", "custom-scale", "parent-param-and-children", "multihead-attention",
    "tied-embedding-output", "linear-called-twice", "frozen-params", "unused-params",
    "two-inputs", "batchnorm-eval", "embedding-repeated-ids-padding-idx", "groupnorm-2d-groups2",
    "layernorm-last-2-dims", "conv2d-replicate-same-even",
    # cases_layers.py
    "convT2d-output-size", "conv-convT-encoder-decoder", "conv-instancenorm-net",
    "mlp-batchnorm1d-eval", "rmsnorm-last-2-dims", "bilinear-prelu-tuple-inputs",
    "embeddingbag-per-sample-weights", "embeddingbag-offsets-max-last-offset-lengths",
]


def _user_hook(module, args, output):
    return None


def _user_pre_hook(module, args):
    return None


def dress(model: nn.Module) -> None:
    """Give the model state a careless engine could clobber: grads, hooks, mixed flags."""
    for k, p in enumerate(p for p in model.parameters() if p.requires_grad):
        if k % 2 == 0:
            p.grad = torch.randn_like(p)  # an existing .grad keeps its values
    model.register_forward_hook(_user_hook)
    model.register_forward_pre_hook(_user_pre_hook)
    children = list(model.children())
    if children and not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                            for m in model.modules()):
        model.train()
        children[0].eval()  # mixed training flags stay mixed


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case_id", STATE_CASES)
def test_model_unchanged_after_a_call(case_id, method, snapshot):
    c = BY_ID[case_id]
    model, inputs, targets = build(c)
    dress(model)
    state = snapshot(model)
    loss_fn = c["loss_fn"]("mean")
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method)
    state.assert_unchanged()
    assert torch.is_grad_enabled()
    assert_grads_equal(got, loop_per_sample_grads(model, inputs, targets, loss_fn))
    state.assert_unchanged()


@pytest.mark.parametrize("method", METHODS)
def test_model_unchanged_with_chunks_and_out(method, snapshot):
    model, inputs, targets = build(BY_ID["parent-param-and-children"], 5)
    dress(model)
    state = snapshot(model)
    out = torch.empty(5, sum(p.numel() for p in model.parameters()))
    per_sample_grads(model, inputs, targets, nn.CrossEntropyLoss(), method=method,
                     chunk_size=2, out=out)
    state.assert_unchanged()


class Boom(Exception):
    pass


class Stop(BaseException):
    """Not an Exception (like KeyboardInterrupt): cleanup must still happen."""


class Tripwire(nn.Module):
    """Runs a few layers, then raises ``self.error`` if set, or on forward call number
    ``self.fail_on[0]`` (counted in ``self.count[0]``; lists, so the attributes keep
    their identity and the snapshot sees no change)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.scale = Scale(3)  # the fallback path too
        self.fc = nn.Linear(3, 4)
        self.error: BaseException | None = None
        self.fail_on: list[int | None] = [None]
        self.count = [0]

    def forward(self, x):
        h = self.scale(self.conv(x).mean(-1))  # (B, 3)
        out = self.fc(torch.tanh(h))
        self.count[0] += 1
        if self.error is not None:
            raise self.error
        if self.count[0] == self.fail_on[0]:
            raise Boom(f"failed on call {self.count[0]}")
        return out


def tripwire_data(n: int = N):
    return randn(n, 2, 5), torch.randint(0, 4, (n,))


@pytest.mark.parametrize("error", [Boom("forward failed"), Stop("interrupted")],
                         ids=["exception", "base-exception"])
@pytest.mark.parametrize("method", METHODS)
def test_forward_raises(method, error, snapshot):
    model = Tripwire().double()
    x, y = tripwire_data()
    dress(model)
    model.error = error
    state = snapshot(model)
    with pytest.raises(type(error), match=str(error)):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    state.assert_unchanged()
    assert torch.is_grad_enabled()
    # It works again afterwards, with nothing left over from the failed call.
    model.error = None
    state = snapshot(model)
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    state.assert_unchanged()
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))


@pytest.mark.parametrize("method", METHODS)
def test_forward_raises_in_a_later_chunk(method, snapshot):
    """The first chunk (the first sample for "loop") succeeds, the next forward raises."""
    model = Tripwire().double()
    x, y = tripwire_data(5)
    dress(model)
    model.fail_on[0] = 2
    state = snapshot(model)
    out = torch.zeros(5, sum(p.numel() for p in model.parameters()))
    with pytest.raises(Boom, match="failed on call 2"):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method, chunk_size=2,
                         out=out)
    state.assert_unchanged()
    model.fail_on[0] = None
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method, chunk_size=2)
    state.assert_unchanged()
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))


@pytest.mark.parametrize("method", METHODS)
def test_loss_raises(method, snapshot):
    model = Tripwire().double()
    x, y = tripwire_data()
    dress(model)
    state = snapshot(model)

    def bad_loss(out, target):
        raise Boom("loss failed")

    with pytest.raises(Boom, match="loss failed"):
        per_sample_grads(model, x, y, bad_loss, method=method)
    state.assert_unchanged()
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    state.assert_unchanged()
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("backward failed")


@pytest.mark.parametrize("method", ["rules", "auto", "loop"])
def test_backward_raises(method, snapshot):
    """The loss goes through a function whose backward raises, between two layers."""
    inner = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner[1](FailingBackward.apply(self.inner[0](x)))

    model = Net().double()
    x, y = randn(3, 3), randn(3, 2)
    dress(model)
    state = snapshot(model)
    with pytest.raises(Boom, match="backward failed"):
        per_sample_grads(model, x, y, nn.MSELoss(), method=method)
    state.assert_unchanged()
    assert torch.is_grad_enabled()


def test_hooks_are_gone_and_user_hooks_kept():
    """Explicitly: the hook dicts of every module hold exactly the user's hooks."""
    model, inputs, targets = build(BY_ID["simple-cnn"])
    calls = []
    handle = model.conv1.register_forward_hook(lambda m, a, o: calls.append(o.shape[0]))
    per_sample_grads(model, inputs, targets, nn.CrossEntropyLoss(), method="rules")
    assert calls  # the user's hook still ran
    for name, m in model.named_modules():
        expected = 1 if name == "conv1" else 0
        assert len(m._forward_hooks) == expected, name
        assert len(m._forward_hooks_with_kwargs) == 0, name
        assert len(m._forward_pre_hooks) == 0, name
        assert len(m._backward_hooks) == 0, name
        assert len(m._backward_pre_hooks) == 0, name
    handle.remove()
    assert not model.conv1._forward_hooks


def test_module_dicts_identical_after_call():
    """No new attribute on any module or parameter (compare every ``__dict__``)."""
    model, inputs, targets = build(BY_ID["tied-embedding-output"])
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    params_before = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for method in METHODS:
        per_sample_grads(model, *[inputs, targets], nn.CrossEntropyLoss(), method=method)
        for name, m in model.named_modules():
            assert vars(m).keys() == before[name].keys(), (method, name)
            for key in ("_parameters", "_buffers", "_modules"):
                assert vars(m)[key] == before[name][key], (method, name, key)
        for name, p in model.named_parameters():
            assert vars(p) == params_before[name], (method, name)
            assert p.grad is None, (method, name)


def test_inputs_and_targets_unchanged(snapshot):
    model, inputs, targets = build(BY_ID["two-inputs"])
    copies = [a.clone() for a in as_tuple(inputs)], targets.clone()
    for method in METHODS:
        per_sample_grads(model, inputs, targets, nn.MSELoss(), method=method)
        for a, b in zip(as_tuple(inputs), copies[0]):
            assert torch.equal(a, b) and not a.requires_grad
        assert torch.equal(targets, copies[1])


@pytest.mark.parametrize("method", METHODS)
def test_works_under_no_grad_and_keeps_grad_mode(method, snapshot):
    """Called inside ``torch.no_grad()`` (as in an eval loop): same rows, mode still off."""
    model, inputs, targets = build(BY_ID["custom-scale"])
    want = loop_per_sample_grads(model, inputs, targets, nn.CrossEntropyLoss())
    state = snapshot(model)
    with torch.no_grad():
        got = per_sample_grads(model, inputs, targets, nn.CrossEntropyLoss(), method=method)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    assert_grads_equal(got, want)
    state.assert_unchanged()
