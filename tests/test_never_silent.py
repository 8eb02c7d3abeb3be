"""Never a silent wrong number, never a raw crash from inside persample.

- Every function that assumes independent samples (the input Jacobian, its diagonal,
  the parameter Jacobian) refuses, or answers exactly, on every mixing model that
  ``per_sample_grads`` refuses.
- ``method="auto"`` answers wherever a slower exact method does: a fault injected in
  turn into each data-flow handler, op rule, norm rule, weighted-sum rule, module rule
  and expansion that a model uses must leave every public function's answer the loop's,
  with a warning naming the fault as persample's bug. An error in the user's own
  ``forward`` or ``loss_fn`` propagates as it is.
- Inputs persample cannot slice are refused by name; dataclasses are opened.
- Common mistakes get one line naming the argument and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from battery import TOL, assert_exact, clipped_mean, flat
from persample import (
    input_jacobian,
    jacobian_diagonal,
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grad_norms,
    per_sample_grads,
)
from persample.dp import PrivateStep, private_grad
from persample.errors import InternalError

B = 4


def clipped_sum(grads: dict[str, Tensor], c: float) -> dict[str, Tensor]:
    """``sum_i c_i g_i``: the clipped sum, not divided by the batch size."""
    return clipped_mean(grads, c, divisor=1)[1]


# ---------------------------------------------------------------------------
# models that mix samples


class Centre(nn.Module):
    """Subtracts the batch mean: every output reads every sample."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return torch.tanh(h - h.mean(0))


class ShiftOneWay(nn.Module):
    """Sample i's output reads sample i - 1's input (one way only)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h + torch.cat([h[:1] * 0, h[:-1]]) ** 2


class AttendAcrossBatch(nn.Module):
    """Each sample attends to every sample of the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)  # (B, 3)
        return torch.softmax(h @ h.T, -1) @ h


def batchnorm_train() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 3)).train()


MIXING = {"centre": Centre, "shift-one-way": ShiftOneWay, "attend-across-batch": AttendAcrossBatch,
          "batchnorm-train": batchnorm_train}


@pytest.mark.parametrize("make", MIXING.values(), ids=MIXING.keys())
def test_per_sample_grads_refuses_every_mixing_model_on_the_rules(make):
    model, x, y = make(), torch.randn(B, 3), torch.randn(B, 3)
    with pytest.raises((ValueError, persample.NeedsWholeModel), match="mix|batch"):
        per_sample_grads(model, x, y, F.mse_loss, method="rules")


@pytest.mark.parametrize("fn", [input_jacobian, jacobian_diagonal],
                         ids=["input_jacobian", "jacobian_diagonal"])
@pytest.mark.parametrize("make", MIXING.values(), ids=MIXING.keys())
def test_input_jacobians_refuse_or_are_exact_on_every_mixing_model(make, fn, snapshot):
    """Refused where the data flow sees samples mixed; where it cannot follow them,
    the exact diagonal blocks of the full Jacobian, one sample at a time."""
    model, x = make(), torch.randn(B, 3)
    state = snapshot(model)
    try:
        with warnings.catch_warnings(record=True):
            got = fn(model, x)
    except ValueError as err:
        assert "mixes samples" in str(err) and "module" in str(err)  # names where
    else:
        full = torch.autograd.functional.jacobian(model, x)  # (B, 3, B, 3)
        blocks = torch.stack([full[i, :, i] for i in range(B)])
        want = blocks if fn is input_jacobian else blocks.diagonal(0, 1, 2)
        torch.testing.assert_close(got, want, **TOL)
    state.assert_unchanged()


@pytest.mark.parametrize("make", MIXING.values(), ids=MIXING.keys())
def test_param_jacobian_refuses_or_is_exact_on_every_mixing_model(make):
    model, x = make(), torch.randn(B, 3)
    try:
        with warnings.catch_warnings(record=True):
            got = param_jacobian(model, x)
    except (ValueError, persample.CertificateError) as err:
        assert "mix" in str(err)
        return
    assert_exact(got, loop_param_jacobian(model, x))


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
                                  lambda: nn.Sequential(nn.Conv1d(1, 2, 2), nn.Flatten())],
                         ids=["mlp", "conv"])
def test_input_jacobians_of_independent_models_are_the_diagonal_blocks(make):
    model, x = make(), torch.randn(B, 3)
    if isinstance(model[0], nn.Conv1d):
        x = x[:, None]
    full = torch.autograd.functional.jacobian(model, x)  # (B, *out, B, *in)
    blocks = torch.stack([full[i, ..., i, :, :] if x.dim() == 3 else full[i, :, i]
                          for i in range(B)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(input_jacobian(model, x), blocks, **TOL)


def test_unfollowed_outputs_get_the_exact_diagonal_blocks_with_a_warning():
    """TorchScript code the capture cannot see: each sample's block on its own."""
    scripted = torch.jit.script(nn.Linear(3, 3))

    def model(x: Tensor) -> Tensor:
        return torch.tanh(scripted(x))

    x = torch.randn(B, 3)
    full = torch.autograd.functional.jacobian(model, x)
    with pytest.warns(UserWarning, match="on its own"):
        got = input_jacobian(model, x)
    torch.testing.assert_close(got, torch.stack([full[i, :, i] for i in range(B)]), **TOL)
    with pytest.warns(UserWarning, match="on its own"):
        diag = jacobian_diagonal(model, x)
    torch.testing.assert_close(diag, got.diagonal(0, 1, 2), **TOL)


# ---------------------------------------------------------------------------
# fault injection: persample's own failures are answered by the next method


class Tokens(nn.Module):
    """Embedding, position parameter, Linear, LayerNorm, GELU, mean over positions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.pos = nn.Parameter(torch.randn(B, 4) * 0.1)  # T == B
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids) + self.pos
        h = F.gelu(self.norm(self.fc(h)))
        return self.head(h.mean(1))


class Images(nn.Module):
    """Conv2d, GroupNorm, ReLU, max pool, Linear; float inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return self.head(h.flatten(1))


class Attending(nn.Module):
    """A Transformer encoder layer (multi-head attention expanded into its ops)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


class Recurrent(nn.Module):
    """An LSTM (a module rule) and a Linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Assorted(nn.Module):
    """EmbeddingBag, Bilinear, PReLU, a Conv1D-style addmm, RMSNorm, a transposed
    convolution, BatchNorm in eval mode and scaled dot-product attention."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 4, mode="mean")
        self.bilinear = nn.Bilinear(4, 4, 4)
        self.prelu = nn.PReLU()
        self.w = nn.Parameter(torch.randn(4, 8) * 0.3)  # addmm(b, x, w), as GPT-2's Conv1D
        self.b = nn.Parameter(torch.zeros(8))
        self.norm = nn.RMSNorm(8)
        self.up = nn.ConvTranspose1d(2, 2, 2, stride=2)
        self.bn = nn.BatchNorm1d(2).eval()
        self.head = nn.Linear(16, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.bag(ids)  # (B, 4)
        h = self.prelu(self.bilinear(h, h))
        h = self.norm(torch.addmm(self.b, h, self.w))  # (B, 8)
        h = self.bn(self.up(h.view(-1, 2, 4)))  # (B, 2, 8)
        q = h.view(-1, 1, 4, 4)  # (B, heads, T, E), T == E == B
        h = F.scaled_dot_product_attention(q, q, q)
        return self.head(h.flatten(1))


FAULT_MODELS = {
    "assorted": (Assorted, lambda: torch.randint(0, 7, (B, 3))),
    "tokens": (Tokens, lambda: torch.randint(0, 7, (B, B))),
    "images": (Images, lambda: torch.randn(B, 1, 6, 6)),
    "attending": (Attending, lambda: torch.randn(B, B, 4)),
    "recurrent": (Recurrent, lambda: torch.randn(B, B, 3)),
}


def _tables() -> dict[str, tuple[dict, str | None]]:
    """Every registry of persample's own code, by name: ``(table, field)``, the function
    being the entry itself (``field`` ``None``) or that field of it (a spec's)."""
    from persample.batch import flow
    from persample.rules import spec

    return {"data-flow handler": (flow.HANDLERS, None), "op rule": (spec.SPECS, "grad"),
            "norm rule": (spec.SPECS, "norm"), "weighted-sum rule": (spec.SPECS, "sum"),
            "factor rule": (spec.SPECS, "factors"), "expansion": (spec.EXPANSIONS, None),
            "module rule": (spec.MODULE_SPECS, "grad"),
            "module norm rule": (spec.MODULE_SPECS, "norm")}


def _fn_of(entry, field: str | None):
    return entry if field is None else getattr(entry, field)


def _with_fn(entry, field: str | None, fn):
    return fn if field is None else dataclasses.replace(entry, **{field: fn})


def _used(run: Callable[[], None]) -> list[tuple[str, Callable]]:
    """The (table, function) pairs that ``run`` calls."""
    used: dict[tuple[str, int], tuple[str, Callable]] = {}
    saved = {name: dict(table) for name, (table, _) in _tables().items()}

    def spy(kind: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            used[(kind, id(fn))] = (kind, fn)
            return fn(*args, **kwargs)
        return wrapper

    try:
        for kind, (table, field) in _tables().items():
            for key, entry in list(table.items()):
                fn = _fn_of(entry, field)
                if fn is not None:
                    table[key] = _with_fn(entry, field, spy(kind, fn))
        run()
    finally:
        for kind, (table, _) in _tables().items():
            table.clear()
            table.update(saved[kind])
    return list(used.values())


def _linear_rule() -> Callable:
    from persample.rules import spec_of

    return spec_of(F.linear).grad


class _Injected(Exception):
    pass


def _inject(kind: str, fn: Callable):
    """A context in which every entry of ``kind`` calling ``fn`` raises."""
    table, field = _tables()[kind]

    def boom(*args, **kwargs):
        raise _Injected(f"fault injected into {fn.__name__}")

    class Context:
        def __enter__(self):
            self.saved = dict(table)
            for key, entry in table.items():
                if _fn_of(entry, field) is fn:
                    table[key] = _with_fn(entry, field, boom)

        def __exit__(self, *exc):
            table.clear()
            table.update(self.saved)

    return Context()


def _answers(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, object]:
    """Every public function's answer on one batch."""
    loss = nn.CrossEntropyLoss()
    found = {"grads": per_sample_grads(model, x, y, loss),
             "norms": per_sample_grad_norms(model, x, y, loss)}
    for p in model.parameters():
        p.grad = None
    private_grad(model, x, y, loss, max_grad_norm=0.5, noise_multiplier=0.0)
    found["private"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    step = PrivateStep(model, loss, max_grad_norm=0.5, noise_multiplier=0.0,
                       expected_batch_size=B)
    step.accumulate(x[:2], y[:2])
    step.accumulate(x[2:], y[2:])
    step.release()
    found["step"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    found["jacobian"] = param_jacobian(model, x)
    if x.is_floating_point():
        found["input_jacobian"] = input_jacobian(model, x)
    return found


def _expected(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, object]:
    grads = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    clipped = {name: g / B for name, g in clipped_sum(grads, 0.5).items()}
    found = {"grads": grads, "norms": flat(grads).norm(dim=1), "private": clipped,
             "step": clipped, "jacobian": loop_param_jacobian(model, x)}
    if x.is_floating_point():
        full = torch.autograd.functional.jacobian(model, x)  # (B, Y, B, *in)
        found["input_jacobian"] = torch.stack([full[i, :, i] for i in range(B)])
    return found


def _compare(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, dict):
            assert_exact(got[key], value)
        else:
            torch.testing.assert_close(got[key], value, **TOL, msg=key)


def _faults() -> list:
    found = []
    for name, (make, data) in FAULT_MODELS.items():
        torch.manual_seed(0)
        model, x = make(), data()
        y = torch.randint(0, 3, (B,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = _used(lambda m=model, x=x, y=y: _answers(m, x, y))
        found += [pytest.param(name, kind, fn, id=f"{name}-{kind}-{fn.__name__}")
                  for kind, fn in used]
    return found


@pytest.mark.parametrize("name, kind, fn", _faults())
def test_a_fault_in_persample_is_answered_by_the_next_method(
        name, kind, fn, snapshot, fallbacks_answer_internal_errors):
    make, data = FAULT_MODELS[name]
    model, x = make(), data()
    y = torch.randint(0, 3, (B,))
    want = _expected(model, x, y)
    state = snapshot(model)
    with _inject(kind, fn), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _answers(model, x, y)
    _compare(got, want)
    state.assert_unchanged()
    said = [str(w.message) for w in caught]
    assert any("bug" in m and "fault injected" in m for m in said), said[:3]


def test_the_rules_method_raises_persamples_bug_as_such():
    with _inject("op rule", _linear_rule()):
        with pytest.raises(InternalError, match="bug in persample") as err:
            per_sample_grads(Images(), torch.randn(B, 1, 6, 6), torch.randint(0, 3, (B,)),
                             nn.CrossEntropyLoss(), method="rules")
    assert isinstance(err.value.__cause__, _Injected)


class Faulty(nn.Module):
    """A forward that raises on its own (the user's bug)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        raise KeyError("the user's own error")


@pytest.mark.parametrize("call", [
    lambda m, x, y: per_sample_grads(m, x, y, nn.CrossEntropyLoss()),
    lambda m, x, y: per_sample_grad_norms(m, x, y, nn.CrossEntropyLoss()),
    lambda m, x, y: private_grad(m, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
                                 noise_multiplier=0.0),
    lambda m, x, y: param_jacobian(m, x),
], ids=["grads", "norms", "private", "jacobian"])
def test_the_users_own_errors_propagate_unchanged(call, snapshot):
    model = Faulty()
    state = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(KeyError, match="the user's own error"):
            call(model, torch.randn(B, 3), torch.randint(0, 3, (B,)))
    state.assert_unchanged()


def test_the_users_loss_errors_propagate_unchanged():
    def loss_fn(out, y):
        raise ArithmeticError("the loss's own error")

    with pytest.raises(ArithmeticError, match="the loss's own error"):
        per_sample_grads(nn.Linear(3, 3), torch.randn(B, 3), torch.randn(B, 3), loss_fn)


def test_verify_reports_the_path_the_call_took(fallbacks_answer_internal_errors):
    with _inject("op rule", _linear_rule()):
        with pytest.warns(UserWarning, match="bug"):
            report = persample.verify(Images(), torch.randn(B, 1, 6, 6),
                                      torch.randint(0, 3, (B,)), nn.CrossEntropyLoss())
    assert report.ok and report.method.startswith("vmap: ")
    assert persample.verify(Images(), torch.randn(B, 1, 6, 6), torch.randint(0, 3, (B,)),
                            nn.CrossEntropyLoss()).method == "rules"


# ---------------------------------------------------------------------------
# inputs persample cannot slice, and dataclasses


@dataclass
class Pair:
    a: Tensor
    b: Tensor


class ReadsPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, pair: Pair, z: Tensor) -> Tensor:
        return self.fc(pair.a * pair.b + z)


class Opaque:
    """An object holding tensors in a form persample does not open."""

    def __init__(self, a: Tensor, b: Tensor):
        self.a, self.b = a, b


@pytest.mark.parametrize("method", ["auto", "rules", "vmap", "loop"])
def test_a_dataclass_input_is_opened_and_sliced(method):
    model = ReadsPair()
    inputs = (Pair(torch.randn(B, 3), torch.randn(B, 3)), torch.randn(B, 3))
    y = torch.randint(0, 2, (B,))
    want = {"fc.weight": [], "fc.bias": []}
    for i in range(B):  # by hand: the pair's rows of sample i
        out = model(Pair(inputs[0].a[i:i + 1], inputs[0].b[i:i + 1]), inputs[1][i:i + 1])
        grads = torch.autograd.grad(F.cross_entropy(out, y[i:i + 1]), list(model.parameters()))
        for name, g in zip(want, grads):
            want[name].append(g)
    want = {name: torch.stack(g) for name, g in want.items()}
    assert_exact(per_sample_grads(model, inputs, y, nn.CrossEntropyLoss(), method=method), want)
    torch.testing.assert_close(
        per_sample_grad_norms(model, inputs, y, nn.CrossEntropyLoss(), method=method),
        flat(want).norm(dim=1), **TOL)


@pytest.mark.parametrize("call", [
    lambda m, i, y: per_sample_grads(m, i, y, nn.CrossEntropyLoss()),
    lambda m, i, y: per_sample_grad_norms(m, i, y, nn.CrossEntropyLoss()),
    lambda m, i, y: private_grad(m, i, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
                                 noise_multiplier=0.0),
    lambda m, i, y: param_jacobian(m, i),
    lambda m, i, y: loop_per_sample_grads(m, i, y, nn.CrossEntropyLoss()),
], ids=["grads", "norms", "private", "jacobian", "loop"])
def test_an_object_holding_tensors_is_refused_by_name(call, snapshot):
    class ReadsOpaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, obj: Opaque, z: Tensor) -> Tensor:
            return self.fc(obj.a + obj.b + z)

    model = ReadsOpaque()
    state = snapshot(model)
    inputs = (Opaque(torch.randn(B, 3), torch.randn(B, 3)), torch.randn(B, 3))
    with pytest.raises(TypeError, match=r"inputs\[0\] is a Opaque that holds tensors"):
        call(model, inputs, torch.randint(0, 2, (B,)))
    state.assert_unchanged()


@dataclass
class Targets:
    y: Tensor


@pytest.mark.parametrize("method", ["auto", "rules", "vmap", "loop"])
def test_dataclass_targets_are_sliced_in_every_method(method):
    """torch.func's in_dims cannot describe a dataclass: it must not see it whole."""
    model, x = nn.Linear(3, 2), torch.randn(B, 3)
    targets = Targets(torch.randn(B, 2))

    def loss_fn(out, t):
        return ((out - t.y) ** 2).sum()

    residual = 2 * (model(x).detach() - targets.y)  # (B, 2), by hand
    got = per_sample_grads(model, x, targets, loss_fn, method=method)
    torch.testing.assert_close(got["weight"], torch.einsum("no,ni->noi", residual, x), **TOL)
    torch.testing.assert_close(got["bias"], residual, **TOL)


def test_an_object_in_targets_is_refused_by_name():
    with pytest.raises(TypeError, match="targets is a Opaque that holds tensors"):
        per_sample_grads(nn.Linear(3, 2), torch.randn(B, 3),
                         Opaque(torch.randn(B, 2), torch.randn(B, 2)), lambda o, t: o.sum())


# ---------------------------------------------------------------------------
# common mistakes


@pytest.mark.parametrize("fn", [per_sample_grads, per_sample_grad_norms])
def test_a_loss_class_instead_of_an_instance(fn, snapshot):
    model = nn.Linear(3, 2)
    state = snapshot(model)
    with pytest.raises(TypeError, match=r"loss_fn=CrossEntropyLoss\(\)"):
        fn(model, torch.randn(B, 3), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss)
    state.assert_unchanged()


def test_a_loss_class_in_private_grad_and_private_step():
    model, x, y = nn.Linear(3, 2), torch.randn(B, 3), torch.randint(0, 2, (B,))
    with pytest.raises(TypeError, match=r"loss_fn=CrossEntropyLoss\(\)"):
        private_grad(model, x, y, nn.CrossEntropyLoss, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(TypeError, match=r"loss_fn=MSELoss\(\)"):
        PrivateStep(model, nn.MSELoss, max_grad_norm=1.0, noise_multiplier=0.0,
                    expected_batch_size=4)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fn", [per_sample_grads, per_sample_grad_norms])
def test_targets_and_loss_fn_swapped(fn, snapshot):
    model = nn.Linear(3, 2)
    state = snapshot(model)
    with pytest.raises(TypeError, match=r"targets and loss_fn are swapped.*\(model, inputs, "
                                        r"targets, loss_fn\)"):
        fn(model, torch.randn(B, 3), nn.CrossEntropyLoss(), torch.randint(0, 2, (B,)))
    state.assert_unchanged()


def test_loss_fn_that_is_not_callable():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        per_sample_grads(nn.Linear(3, 2), torch.randn(B, 3), None, "cross_entropy")


def test_inputs_on_another_device_are_named_before_the_model_runs(snapshot):
    model = nn.Linear(3, 2)
    state = snapshot(model)
    x = torch.randn(B, 3, device="meta")
    with pytest.raises(ValueError, match=r"inputs is on meta but the model's parameters are "
                                         r"on cpu: move it with \.to\('cpu'\)"):
        per_sample_grads(model, x, None, lambda o, t: o.sum(1))
    state.assert_unchanged()


class _Summed(nn.Module):
    """``a(x + z)``: the sum is a normal tensor, whatever ``z`` is."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return self.a(x + z)


@pytest.mark.parametrize("method", ["auto", "rules", "vmap", "loop"])
def test_an_input_made_in_inference_mode_is_named_with_the_fix(method, snapshot):
    """An inference tensor cannot be saved for a backward (a plain step fails on most
    models given one) and keeps no version, which the rules read: named with the fix,
    not answered as a bug of persample's."""
    model = _Summed()
    state = snapshot(model)
    with torch.inference_mode():
        z = torch.randn(B, 3)
    with pytest.raises(ValueError, match=r"inputs\[1\] was made under "
                                         r"torch\.inference_mode\(\).*torch\.no_grad\(\)"
                                         r".*inputs\[1\]\.clone\(\)"):
        per_sample_grads(model, (torch.randn(B, 3), z), None, lambda o, t: o.sum(1),
                         method=method)
    state.assert_unchanged()
    got = per_sample_grads(model, (torch.ones(B, 3), z.clone()), None, lambda o, t: o.sum(1),
                           method=method)  # (the fix it names)
    assert got["a.weight"].shape == (B, 2, 3)


def test_inputs_in_another_dtype_are_named_when_the_model_fails():
    model = nn.Linear(3, 2).float()
    x = torch.randn(B, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError) as err:
        per_sample_grads(model, x, torch.randint(0, 2, (B,)), nn.CrossEntropyLoss())
    assert "inputs is torch.float64 but the model's parameters are torch.float32" in "\n".join(
        getattr(err.value, "__notes__", []))


# ---------------------------------------------------------------------------
# samples packed in other forms


class OnPacked(nn.Module):
    """A recurrent layer given a PackedSequence as the model's own input."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(width, 3)

    def forward(self, packed) -> Tensor:
        out, _ = self.rnn(packed)
        padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / lengths[:, None])


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("make", [
    lambda: nn.LSTM(3, 4, batch_first=True),
    lambda: nn.GRU(3, 4, num_layers=2, batch_first=True),
    lambda: nn.RNN(3, 4, bidirectional=True, batch_first=True),
], ids=["lstm", "gru-2-layers", "rnn-bidirectional"])
def test_a_packed_sequence_as_the_models_input(make, sort, snapshot):
    """Its samples are its sequences (B = batch_sizes[0], not the number of rows), each
    given to the loop as a one-sequence packed sequence; lengths up to T == B."""
    lengths = torch.tensor([4, 3, 3, 1]) if sort else torch.tensor([3, 1, 4, 3])
    x = torch.randn(B, B, 3)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                     enforce_sorted=sort)
    model, y = OnPacked(make()), torch.randint(0, 3, (B,))
    state = snapshot(model)
    want = loop_per_sample_grads(model, packed, y, nn.CrossEntropyLoss())
    assert want["head.bias"].shape == (B, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(per_sample_grads(model, packed, y, nn.CrossEntropyLoss()), want)
        torch.testing.assert_close(per_sample_grad_norms(model, packed, y,
                                                         nn.CrossEntropyLoss()),
                                   flat(want).norm(dim=1), **TOL)
        private_grad(model, packed, y, nn.CrossEntropyLoss(), max_grad_norm=0.5,
                     noise_multiplier=0.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, clipped_sum(want, 0.5)[name] / B, **TOL)
        p.grad = None
    state.assert_unchanged()
    assert {r.path for r in persample.supported(model, packed, y, nn.CrossEntropyLoss())} \
        == {"module rule", "rule"}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_loss_that_cannot_be_vmapped_in_norms_and_the_dp_step(reduction):
    """A scalar loss calling .item(): each sample's own loss, whatever its reduction."""
    def loss_fn(out, y):
        loss = F.cross_entropy(out, y, reduction=reduction)
        return loss if loss.item() == loss.item() else loss * 0

    model, x, y = Images(), torch.randn(B, 1, 6, 6), torch.randint(0, 3, (B,))
    want = loop_per_sample_grads(model, x, y, loss_fn)
    torch.testing.assert_close(per_sample_grad_norms(model, x, y, loss_fn),
                               flat(want).norm(dim=1), **TOL)
    private_grad(model, x, y, loss_fn, max_grad_norm=0.5, noise_multiplier=0.0)
    step = PrivateStep(model, loss_fn, max_grad_norm=0.5, noise_multiplier=0.0,
                       expected_batch_size=B)
    private = {name: p.grad.clone() for name, p in model.named_parameters()}
    step.accumulate(x, y)
    step.release()
    for name, p in model.named_parameters():
        torch.testing.assert_close(private[name], clipped_sum(want, 0.5)[name] / B, **TOL)
        torch.testing.assert_close(p.grad, private[name], **TOL)


class PackedOut(nn.Module):
    """Returns the LSTM's packed output as it is."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)

    def forward(self, packed):
        return self.rnn(packed)[0]


def _packed_loss(out, _) -> Tensor:  # (B,): each sequence's own mean square
    padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    return (padded.sum(2) ** 2).sum(1) / lengths


@pytest.mark.parametrize("reduce", [False, True], ids=["per-sample", "scalar"])
def test_a_packed_output_read_by_the_loss(reduce):
    """Per-sample losses from a packed output stay on the rules; a scalar loss over it
    cannot be cut by sample there, and auto gives the loop's answer."""
    x = torch.randn(B, B, 3)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([3, 1, 4, 2]),
                                                     batch_first=True, enforce_sorted=False)
    loss_fn = (lambda out, y: _packed_loss(out, y).mean()) if reduce else _packed_loss
    model = PackedOut()
    want = loop_per_sample_grads(model, packed, None, loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_exact(per_sample_grads(model, packed, None, loss_fn), want)
    assert bool(caught) == reduce
    if reduce:
        with pytest.raises(persample.NeedsWholeModel, match="rows are packed"):
            per_sample_grads(model, packed, None, loss_fn, method="rules")


# ---------------------------------------------------------------------------
# an empty batch and non-finite samples: never a silent result


def _edge_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


_EDGE_CALLS = {
    "per_sample_grads": lambda m, x, y: per_sample_grads(m, x, y, nn.CrossEntropyLoss()),
    "per_sample_grad_norms": lambda m, x, y: per_sample_grad_norms(m, x, y,
                                                                   nn.CrossEntropyLoss()),
    "input_jacobian": lambda m, x, y: input_jacobian(m, x),
    "jacobian_diagonal": lambda m, x, y: jacobian_diagonal(lambda v: torch.tanh(v) * 2, x),
    "per_sample_ggn_diag": lambda m, x, y: persample.per_sample_ggn_diag(
        m, x, y, nn.CrossEntropyLoss()),
    "ggn_diag": lambda m, x, y: persample.ggn_diag(m, x, y, nn.CrossEntropyLoss()),
    "per_sample_grad_dots": lambda m, x, y: persample.per_sample_grad_dots(
        m, x, y, nn.CrossEntropyLoss()),
    "GradientProjector": lambda m, x, y: persample.GradientProjector(m, 5, seed=0)(
        x, y, nn.CrossEntropyLoss()),
}


@pytest.mark.parametrize("name", sorted(_EDGE_CALLS))
def test_an_empty_batch_is_named(name):
    x, y = torch.randn(0, 4), torch.zeros(0, dtype=torch.long)
    with pytest.warns(UserWarning, match=f"{name} got an empty batch"):
        _EDGE_CALLS[name](_edge_net(), x, y)
    with pytest.raises(ValueError, match="at least one sample"):
        param_jacobian(_edge_net(), x)


def test_an_empty_batch_on_either_side_of_the_dots_or_projected_is_an_empty_result():
    """The inner products with an empty batch on either side, and the projections of an
    empty batch, are empty results of the right shape (they crashed in the factor rules:
    a reshape of no rows)."""
    full = torch.randn(3, 4), torch.randint(0, 3, (3,))
    empty = torch.randn(0, 4), torch.zeros(0, dtype=torch.long)
    loss = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match="got an empty batch"):
        assert persample.per_sample_grad_dots(_edge_net(), *full, loss, other=empty).shape == (
            3, 0)
    with pytest.warns(UserWarning, match="got an empty batch"):
        assert persample.per_sample_grad_dots(_edge_net(), *empty, loss, other=full).shape == (
            0, 3)
    with pytest.warns(UserWarning, match="got an empty batch"):
        got = persample.GradientProjector(_edge_net(), 5, seed=0)(*empty, loss)
    assert got.shape == (0, 5) and got.dtype == torch.get_default_dtype()


def test_a_non_finite_sample_with_an_output_dim_the_batch_size_is_named():
    """A NaN loss where the output has another dim of the batch's size (4 classes, B = 4)
    is named as at other sizes; the certificate's comparison of the losses took the NaN
    for its tolerance and raised."""
    torch.manual_seed(0)
    net = nn.Linear(3, 4)
    x, y = torch.randn(4, 3), torch.randint(0, 4, (4,))
    x[2, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"of samples \[2\] is not finite"):
        got = per_sample_grads(net, x, y, nn.CrossEntropyLoss(reduction="none"))
    assert got["weight"][2].isnan().all() and got["weight"][[0, 1, 3]].isfinite().all()


def test_a_non_finite_sample_of_the_other_batch_is_named_on_its_side():
    """With a second batch, a NaN in its sample 1 makes column 1 of the inner products
    NaN: that sample is named, as the other batch's, and no sample of the first."""
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    x2, y2 = torch.randn(3, 4), torch.randint(0, 3, (3,))
    x2[1, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        persample.per_sample_grad_dots(_edge_net(), x, y, nn.CrossEntropyLoss(), other=(x2, y2))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and said[0].startswith(
        "per_sample_grad_dots (other): the result of samples [1]")


_NAN_CALLS = {**{k: v for k, v in _EDGE_CALLS.items() if "ggn" not in k},
              "param_jacobian": lambda m, x, y: param_jacobian(m, x),
              "per_sample_grads (loop)": lambda m, x, y: per_sample_grads(
                  m, x, y, nn.CrossEntropyLoss(), method="loop"),
              "per_sample_grads (chunks of 2)": lambda m, x, y: per_sample_grads(
                  m, x, y, nn.CrossEntropyLoss(), chunk_size=2)}


@pytest.mark.parametrize("name", sorted(_NAN_CALLS))
def test_a_non_finite_sample_is_named(name):
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a clean batch: no warning of ours
        _NAN_CALLS[name](_edge_net(), x, y)
    x[3, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"of samples \[3\] is not finite"):
        _NAN_CALLS[name](_edge_net(), x, y)


def test_a_jacobian_whose_float32_row_sum_overflows_is_not_taken_for_an_inf():
    """param_jacobian sums each sample's rows in the result's dtype: a sample whose entries
    are finite but sum past float32's largest (3.4e38) is read again entry by entry and not
    named; one with an Inf entry is."""
    net = nn.Linear(8, 2).float()
    x = torch.randn(4, 8, dtype=torch.float32)
    x[1] = 1e38  # its weight Jacobian rows: eight entries of 1e38, each finite
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rows = param_jacobian(net, x)["weight"]
    assert torch.isfinite(rows).all() and rows[1].sum() == float("inf")
    x[2, 5] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"the result of samples \[2\] is not finite"):
        param_jacobian(net, x)


@pytest.mark.parametrize("name", ["per_sample_ggn_diag", "ggn_diag"])
def test_the_ggn_refuses_a_non_finite_output_by_sample(name):
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    x[4, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=rf"{name}: the output of samples \[4\]"):
        _EDGE_CALLS[name](_edge_net(), x, y)


@pytest.mark.parametrize("which", ["influence", "self_influence"])
def test_influence_names_a_non_finite_sample_by_its_place_in_the_whole_set(which):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    q = (torch.randn(3, 4), torch.randint(0, 3, (3,)))
    from persample.influence import fit_preconditioner

    fit = fit_preconditioner(net, (x, y), nn.CrossEntropyLoss(), batch_size=5)
    x[7, 2] = float("nan")  # the third batch of five holds it at its own index 2
    call = {"influence": lambda: persample.influence(
                net, (x, y), q, nn.CrossEntropyLoss(), preconditioner=fit, batch_size=5),
            "self_influence": lambda: persample.self_influence(
                net, (x, y), nn.CrossEntropyLoss(), preconditioner=fit, batch_size=5)}[which]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and f"{which}: the " in messages[0], messages
    assert "of samples [7] is not finite" in messages[0], messages


def test_under_a_cuda_graph_capture_no_value_is_read(monkeypatch):
    """While a CUDA graph is captured a read of values on the host would end the capture
    (and a replay runs no Python): the non-finite warning checks nothing then; the DP
    step, whose refusal of non-finite gradients cannot be skipped, refuses to be captured
    by name, before reading any value and with p.grad untouched."""
    from persample import checks

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    x[3, 1] = float("nan")
    monkeypatch.setattr(checks, "capturing", lambda: True)
    monkeypatch.setattr(checks, "non_finite_samples", None)  # any read of values: fails
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        grads = per_sample_grads(_edge_net(), x, y, nn.CrossEntropyLoss())
    assert torch.isnan(grads["0.weight"][3]).all()
    net = _edge_net()
    before = {k: p.detach().clone() for k, p in net.named_parameters()}
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
                     noise_multiplier=1.0)
    assert all(p.grad is None and torch.equal(p, before[k]) for k, p in net.named_parameters())


class TiedPaddedTable(nn.Module):
    """A table with a padding row, tied to the output layer, whose padded positions get
    a NaN backprop (the norm of their zero vector: 0/0): the loop's table gradient is
    finite there (an embedding's backward skips the padding row), and the rules' must be
    (a NaN times a zero mask is NaN)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=1)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, 10)
        h = self.emb(ids)
        return self.head(h + h.pow(2).sum(-1, keepdim=True).sqrt())


def test_a_nan_backprop_at_padded_positions_of_a_tied_table_stays_out():
    """transformers' LED (a sliding window of masked keys gives NaN before its fill) had
    NaN rows where the loop's are finite."""
    torch.manual_seed(0)
    model = TiedPaddedTable()
    ids = torch.tensor([[3, 4, 5], [6, 7, 1], [1, 1, 8]])  # (B = T = 3)

    def loss(out: Tensor, y: Any) -> Tensor:
        return out.pow(2).flatten(1).mean(1)

    want = persample.loop_per_sample_grads(model, ids, None, loss)
    assert bool(want["emb.weight"].isfinite().all())
    for method in ("rules", "auto"):
        got = persample.per_sample_grads(model, ids, None, loss, method=method)
        assert_exact(got, want)
    norms = persample.per_sample_grad_norms(model, ids, None, loss, method="rules")
    torch.testing.assert_close(norms, flat(want).norm(dim=1), rtol=1e-10, atol=1e-12)
