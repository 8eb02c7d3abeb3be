"""The cached call of a model of torch's own layers (persample.capture.stock): no op of
its forward intercepted, every answer the loop's in float64, and anything changed
between calls (a layer, a parameter, a flag, a hook, a patched function, a mode) either
keeps the template's guards or takes the full capture again."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import persample
from persample.capture import Capture

B = D = 5  # the batch size equals the width: nothing may be inferred from sizes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(D, D), nn.ReLU(inplace=True),
                         nn.Sequential(nn.Linear(D, D, bias=False), nn.Tanh()),
                         nn.Linear(D, 3), nn.GELU()).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(B, 1, D, dtype=torch.float64), torch.randint(0, 3, (B,))


LOSS = nn.CrossEntropyLoss()


def SQUARES(out, y):  # (any output shape: a changed Flatten keeps the positions' dim)
    return out.pow(2).flatten(1).sum(1)


def _check(model, x, y, loss_fn=LOSS):
    fast = persample.per_sample_grads(model, x, y, loss_fn, method="rules")
    slow = persample.loop_per_sample_grads(model, x, y, loss_fn)
    assert fast.keys() == slow.keys()
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


def _plan(model, x, y, loss_fn=LOSS) -> str:
    return persample.verify(model, x, y, loss_fn).plan


def _unintercepted(plan: str, compiled: bool = False) -> bool:
    """Did the call run its forward with no op intercepted (by the stock template, or
    where ``compiled`` also compiled)?"""
    return plan.startswith("cached: torch's own layers only") or (
        compiled and plan.startswith("cached: compiled"))


def test_a_second_call_runs_the_forward_unintercepted_and_stays_exact():
    model, (x, y) = _model(), _data()
    persample.clear_plans()
    assert _plan(model, x, y).startswith("new")
    for _ in range(3):
        _check(model, x, y)
    assert _unintercepted(_plan(model, x, y))
    _check(model, torch.randn_like(x), y)  # other values, same shapes


def test_the_unintercepted_forward_runs_no_per_op_python(monkeypatch):
    """No op of the forward reaches the capture (the loss's may); the full capture sees
    every one."""
    model, (x, y) = _model(), _data()
    _check(model, x, y)
    seen = {"forward": 0, "loss": 0}
    record = Capture.record

    def counted(self, func, args, kwargs):
        seen["loss" if self.following else "forward"] += 1
        return record(self, func, args, kwargs)

    monkeypatch.setattr(Capture, "record", counted)
    persample.per_sample_grads(model, x, y, LOSS)
    assert seen["forward"] == 0
    persample.clear_plans()
    persample.per_sample_grads(model, x, y, LOSS)  # (the full capture, for contrast)
    assert seen["forward"] >= 7


def _replace_layer(model):
    model[1] = nn.Linear(D, D).double()


def _replace_weight(model):
    model[4].weight = nn.Parameter(torch.randn(3, D, dtype=torch.float64))


def _freeze(model):
    model[1].weight.requires_grad_(False)


def _append(model):
    model.append(nn.Linear(3, 3).double())


def _hook_output(model):
    model[3][0].register_forward_hook(lambda m, args, out: out * 2)


def _hook_input(model):
    model.register_forward_pre_hook(lambda m, args: (args[0] * -1,))


def _flatten_less(model):
    model[0].end_dim = 1  # (B, 1, D) stays (B, 1, D): the linears read another shape


def _instance_forward(model):
    relu = model[2]
    relu.forward = lambda h: torch.sigmoid(h) * h


def _in_place(model):
    with torch.no_grad():
        model[1].weight.mul_(3)


def _double_to_float_and_back(model):
    model.float()
    model.double()


CHANGES = [_replace_layer, _replace_weight, _freeze, _append, _hook_output, _hook_input,
           _flatten_less, _instance_forward, _in_place, _double_to_float_and_back]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_model_changed_between_calls_is_answered_for_what_it_is_now(change):
    model, (x, y) = _model(), _data()
    for _ in range(2):
        _check(model, x, y, SQUARES)
    change(model)
    for _ in range(2):
        _check(model, x, y, SQUARES)


def test_hooks_and_patches_take_the_full_capture():
    model, (x, y) = _model(), _data()
    _check(model, x, y)
    assert _unintercepted(_plan(model, x, y))
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        assert not _unintercepted(_plan(model, x, y))
        _check(model, x, y)
    finally:
        handle.remove()
    for _ in range(3):  # (the program the hooked call traced, compiled after a few calls)
        _check(model, x, y)
    assert _unintercepted(_plan(model, x, y), compiled=True)

    class Counted(TorchFunctionMode):  # the user's own mode: it sees the forward's ops
        ops = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counted.ops += 1
            return func(*args, **(kwargs or {}))

    with Counted():
        assert not _unintercepted(_plan(model, x, y))
        _check(model, x, y)
    assert Counted.ops > 0


def test_an_input_of_a_tensor_subclass_takes_the_full_capture():
    """A subclass's ``__torch_function__`` runs code of its own on every op."""

    class Tagged(torch.Tensor):
        pass

    model, (x, y) = _model(), _data()
    for _ in range(2):
        _check(model, x, y)
    tagged = x.as_subclass(Tagged)
    assert not _unintercepted(_plan(model, tagged, y))
    _check(model, tagged, y)


def test_a_patched_function_that_mixes_samples_is_refused(monkeypatch):
    """``nn.ReLU`` calls ``F.relu``: patched to subtract the batch mean, the model mixes
    samples, which the full capture sees and refuses; the template must not answer."""
    model, (x, y) = _model(), _data()
    _check(model, x, y)
    monkeypatch.setattr(F, "relu", lambda h, inplace=False: h - h.mean(0))
    with pytest.raises(Exception, match="mix"):
        persample.per_sample_grads(model, x, y, LOSS, method="rules")


def test_jacobians_and_norms_take_it_too():
    model, (x, _) = _model(), _data()
    for _ in range(2):
        fast = persample.param_jacobian(model, x, method="rules")
        slow = persample.param_jacobian(model, x, method="loop")
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-10, atol=1e-12)


def test_the_model_is_not_kept_alive():
    model, (x, y) = _model(), _data()
    _check(model, x, y)
    _check(model, x, y)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(3),
        nn.Conv2d(4, B, 3), nn.Flatten(), nn.Dropout(0.5), nn.LayerNorm(B),
        nn.Linear(B, 3)).double().eval()


def _text() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, D), nn.LayerNorm(D), nn.Flatten(),
                         nn.Linear(D * D, 3)).double()


def test_convolutions_norms_and_embeddings_take_it_too():
    torch.manual_seed(2)
    images, tokens = torch.randn(B, 1, 6, 6, dtype=torch.float64), torch.randint(0, 11, (B, D))
    y = torch.randint(0, 3, (B,))
    for model, x in ((_cnn(), images), (_text(), tokens)):
        for _ in range(3):
            _check(model, x, y)
        assert _unintercepted(_plan(model, x, y)), model


def test_a_layer_argument_changed_between_calls_is_read_anew():
    """A LayerNorm's ``eps`` changes no shape: the arguments other than tensors are
    compared with the template's after the forward, and the full capture runs again."""
    torch.manual_seed(2)
    x, y = torch.randn(B, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    model = _cnn()
    for _ in range(2):
        _check(model, x, y)
    model[7].eps = 0.5
    _check(model, x, y)
    model[0].stride = (2, 2)  # (the same shapes after the adaptive pooling)
    for _ in range(2):
        _check(model, x, y)
    assert _unintercepted(_plan(model, x, y))


def test_dropout_that_draws_takes_the_full_capture():
    torch.manual_seed(2)
    x, y = torch.randn(B, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    model = _cnn()
    for _ in range(2):
        _check(model, x, y)
    assert _unintercepted(_plan(model, x, y))
    model.train()  # (dropout draws: each call's masks are recorded by the full capture)
    for _ in range(2):
        assert not _unintercepted(_plan(model, x, y))
