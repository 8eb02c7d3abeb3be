"""Faults and awkward input: a clear error or a documented result, and an untouched model.

Complements test_bad_input.py (wrong shapes and options) and test_model_state.py
(the state of the model after ``per_sample_grads`` succeeds or raises): here the
other public functions when the forward or the loss raises, no torch function
mode left behind, inputs that require grad, out-of-range embedding ids, NaN and
Inf in inputs, low-precision models, a module called on a sub-batch, two threads
at once, and an in-place activation with the norms, the Jacobian and DP.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from battery import TOL, assert_grads_equal, flat
from cases import Scale
from persample import (
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grad_norms,
    per_sample_grads,
)
from persample.dp import private_grad
from persample.errors import CertificateError

N = 4
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class Boom(Exception):
    pass


class Inner(nn.Module):
    """A captured submodule that can raise in the middle of its own forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.fail = [False]  # a list: the snapshot sees the same attribute

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.fail[0]:
            raise Boom("inner forward failed")
        return torch.tanh(h)


class Net(nn.Module):
    """Conv (rule), Scale (no rule), a nested Linear that may raise, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 5, 3)
        self.scale = Scale(5)
        self.inner = Inner()
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.scale(self.conv(x).mean(-1))
        return self.head(self.inner(h))


def net_data(n: int = N) -> tuple[Tensor, Tensor]:
    return torch.randn(n, 2, 6), torch.randint(0, 3, (n,))


def assert_nothing_left(model: nn.Module) -> None:
    """No hook of any kind on any submodule, no torch function mode active, grad mode on."""
    for name, m in model.named_modules():
        for attr in _HOOK_DICTS:
            assert len(getattr(m, attr)) == 0, f"module {name!r}: {attr} not empty"
    assert _get_current_function_mode_stack() == []
    assert torch.is_grad_enabled()


# ---------------------------------------------------------------------------
# the forward or the loss raises: every public function cleans up


def _norms(model, x, y, loss_fn, method):
    return per_sample_grad_norms(model, x, y, loss_fn, method=method, per_layer=True)[1]


def _private(model, x, y, loss_fn, method):
    private_grad(model, x, y, loss_fn, max_grad_norm=1e9, noise_multiplier=0.0)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _grads(model, x, y, loss_fn, method):
    return per_sample_grads(model, x, y, loss_fn, method=method)


LOSS_FUNCTIONS = {"per_sample_grads": _grads, "per_sample_grad_norms": _norms,
                  "private_grad": _private}


def _expected(name: str, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    ref = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    if name == "per_sample_grad_norms":
        return {k: g.flatten(1).norm(dim=1) for k, g in ref.items()}
    if name == "private_grad":  # no clipping (huge C), no noise: the mean
        return {k: g.sum(0) / len(g) for k, g in ref.items()}
    return ref


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("func", list(LOSS_FUNCTIONS))
def test_forward_raises_inside_a_submodule(func, method, snapshot):
    """The exception escapes from inside a captured call (its hooks' stack half done)."""
    model = Net()
    x, y = net_data()
    state = snapshot(model)
    model.inner.fail[0] = True
    with pytest.raises(Boom, match="inner forward failed"):
        LOSS_FUNCTIONS[func](model, x, y, nn.CrossEntropyLoss(), method)
    model.inner.fail[0] = False
    state.assert_unchanged()
    assert_nothing_left(model)
    got = LOSS_FUNCTIONS[func](model, x, y, nn.CrossEntropyLoss(), method)
    assert_grads_equal(got, _expected(func, model, x, y))
    state.assert_unchanged()
    assert_nothing_left(model)


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("func", list(LOSS_FUNCTIONS))
def test_loss_raises(func, method, snapshot):
    model = Net()
    x, y = net_data()
    state = snapshot(model)

    def bad_loss(out, target):
        raise Boom("loss failed")

    with pytest.raises(Boom, match="loss failed"):
        LOSS_FUNCTIONS[func](model, x, y, bad_loss, method)
    state.assert_unchanged()
    assert_nothing_left(model)
    got = LOSS_FUNCTIONS[func](model, x, y, nn.CrossEntropyLoss(), method)
    assert_grads_equal(got, _expected(func, model, x, y))
    state.assert_unchanged()


class CountingNet(Net):
    """Raises on forward call number ``fail_on[0]`` (param_jacobian first runs one
    sample without capture to learn the output shape, then the captured batch)."""

    def __init__(self):
        super().__init__()
        self.fail_on = [0]
        self.count = [0]

    def forward(self, x: Tensor) -> Tensor:
        self.count[0] += 1
        self.inner.fail[0] = self.count[0] == self.fail_on[0]
        try:
            return super().forward(x)
        finally:
            self.inner.fail[0] = False


@pytest.mark.parametrize("fail_on", [1, 2], ids=["shape-probe", "captured-forward"])
@pytest.mark.parametrize("method", ["rules", "auto"])
def test_param_jacobian_forward_raises(method, fail_on, snapshot):
    model = CountingNet()
    x, _ = net_data()
    state = snapshot(model)
    model.fail_on[0] = fail_on
    with pytest.raises(Boom, match="inner forward failed"):
        param_jacobian(model, x, method=method)
    assert model.count[0] == fail_on
    model.fail_on[0] = 0
    state.assert_unchanged()
    assert_nothing_left(model)
    assert_grads_equal(param_jacobian(model, x, method=method), loop_param_jacobian(model, x))
    assert_nothing_left(model)


class Recorder(TorchFunctionMode):
    """A user's own torch function mode, active around the call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["rules", "auto", "vmap", "loop"])
def test_users_function_mode_stays_on_top_after_a_failure(method):
    """The capture's mode is pushed over the user's and popped again, also on an error."""
    model = Net()
    x, y = net_data()
    with Recorder() as mode:
        model.inner.fail[0] = True
        with pytest.raises(Boom):
            per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
        model.inner.fail[0] = False
        assert _get_current_function_mode_stack() == [mode]
        before = mode.calls
        got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
        assert _get_current_function_mode_stack() == [mode]
        assert mode.calls > before  # the user's mode still sees the ops
    assert _get_current_function_mode_stack() == []
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))


# ---------------------------------------------------------------------------
# inputs that require grad


@pytest.mark.parametrize("method", ["rules", "auto", "vmap", "loop"])
def test_inputs_that_require_grad(method, snapshot):
    model = Net()
    x, y = net_data()
    want = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    want_jac = loop_param_jacobian(model, x)
    x.requires_grad_(True)
    x_before = x.detach().clone()
    state = snapshot(model)
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert_grads_equal({k: g.detach() for k, g in got.items()}, want)
    norms = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(), method=method)
    torch.testing.assert_close(norms.detach(), flat(want).norm(dim=1), **TOL)
    jac = param_jacobian(model, x, method=method)
    assert_grads_equal({k: g.detach() for k, g in jac.items()}, want_jac)
    assert x.grad is None and x.requires_grad and x.is_leaf
    assert torch.equal(x.detach(), x_before)
    state.assert_unchanged()


def test_input_that_is_not_a_leaf():
    """An input computed from another tensor that requires grad: nothing flows back to it."""
    model = Net()
    x0, y = net_data()
    want = loop_per_sample_grads(model, x0, y, nn.CrossEntropyLoss())
    base = x0.clone().requires_grad_(True)
    x = base * 1.0
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")
    assert_grads_equal(got, want)
    assert base.grad is None


# ---------------------------------------------------------------------------
# out-of-range embedding ids


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.emb(ids).mean(1))


@pytest.mark.parametrize("bad", [-1, 5, 100], ids=["negative", "num_embeddings", "far"])
@pytest.mark.parametrize("method", ["rules", "auto", "vmap", "loop"])
def test_embedding_ids_out_of_range(method, bad, snapshot):
    """torch's IndexError from the embedding lookup reaches the caller; nothing is left."""
    model = Tokens()
    ids = torch.randint(0, 5, (N, 4))
    ids[2, 1] = bad
    y = torch.randn(N, 2)
    state = snapshot(model)
    with pytest.raises(IndexError, match="index out of range"):
        per_sample_grads(model, ids, y, nn.MSELoss(), method=method)
    with pytest.raises(IndexError, match="index out of range"):
        per_sample_grad_norms(model, ids, y, nn.MSELoss(), method=method)
    with pytest.raises(IndexError, match="index out of range"):
        param_jacobian(model, ids, method=method)
    state.assert_unchanged()
    assert_nothing_left(model)
    ids[2, 1] = 4
    got = per_sample_grads(model, ids, y, nn.MSELoss(), method=method)
    assert_grads_equal(got, loop_per_sample_grads(model, ids, y, nn.MSELoss()))


@pytest.mark.parametrize("bad", [-1, 5])
@pytest.mark.parametrize("method", ["rules", "auto"])
def test_embedding_ids_out_of_range_name_the_module(method, bad):
    model = Tokens()
    ids = torch.randint(0, 5, (N, 4))
    ids[2, 1] = bad
    with pytest.raises((IndexError, ValueError),
                       match=rf"(?s)module 'emb' \(Embedding\).*{bad}.*num_embeddings=5"):
        per_sample_grads(model, ids, torch.randn(N, 2), nn.MSELoss(), method=method)


def test_embedding_ids_out_of_range_in_private_grad(snapshot):
    model = Tokens()
    ids = torch.randint(0, 5, (N, 4))
    ids[0, 0] = -3
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state = snapshot(model)
    with pytest.raises(IndexError, match="index out of range"):
        private_grad(model, ids, torch.randn(N, 2), nn.MSELoss(), max_grad_norm=1.0,
                     noise_multiplier=1.0)
    state.assert_unchanged()  # every p.grad kept (identity and values)
    assert_nothing_left(model)


# ---------------------------------------------------------------------------
# NaN and Inf in the inputs


class Mixed(nn.Module):
    """Layers whose rules batch over samples: conv2d (unfold and grouped forms),
    GroupNorm, a Linear over a sequence (ghost norm), LayerNorm, a module without a rule."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)  # grey image, tiny patch: the unfold form
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)  # the grouped-backward form
        self.gn = nn.GroupNorm(2, 4)
        self.seq = nn.Linear(4, 6)  # over (B, 16, 4): a sequence
        self.ln = nn.LayerNorm(6)
        self.scale = Scale(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.gn(self.conv2(torch.tanh(self.conv1(x))))  # (B, 4, 4, 4)
        h = self.ln(torch.tanh(self.seq(h.flatten(2).transpose(1, 2))))  # (B, 16, 6)
        return self.head(self.scale(h).mean(1))


@pytest.mark.parametrize("method", ["rules", "auto", "vmap"])
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_nan_and_inf_inputs_stay_in_their_samples(poison, method, snapshot):
    model = Mixed()
    x, y = torch.randn(N, 1, 6, 6), torch.randint(0, 3, (N,))
    x[1, 0, 2, 3] = float(poison)
    state = snapshot(model)
    want = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert_grads_equal(got, want, equal_nan=True)
    got_rows = flat(got)
    assert not got_rows[1].isfinite().all()  # the poisoned sample is poisoned
    clean = [0, 2, 3]
    assert got_rows[clean].isfinite().all()
    torch.testing.assert_close(got_rows[clean], flat(want)[clean], **TOL)

    norms = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(), method=method)
    torch.testing.assert_close(norms[clean], flat(want)[clean].norm(dim=1), **TOL)
    assert not norms[1].isfinite()

    jac = param_jacobian(model, x, method=method, flat=True)  # (B, 3, P)
    want_jac = torch.cat([j.flatten(2) for j in loop_param_jacobian(model, x).values()], 2)
    torch.testing.assert_close(jac, want_jac, **TOL, equal_nan=True)
    assert jac[clean].isfinite().all() and not jac[1].isfinite().all()
    state.assert_unchanged()


# ---------------------------------------------------------------------------
# dtypes


def small_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 6), nn.LayerNorm(6), Scale(6), nn.Tanh(),
                         nn.Linear(6, 3))


# relative error of a sample's flat gradient against the float64 loop of the same
# (rounded) weights and inputs; measured here: bf16 ~ 8e-3, fp16 ~ 1e-3, fp32 ~ 3e-7
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2,
           torch.bfloat16: 6e-2}


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("dtype", list(REL_TOL), ids=lambda d: str(d).split(".")[1])
def test_results_in_the_models_dtype(dtype, method, snapshot):
    model64 = small_model()
    x64, y = torch.randn(N, 1, 6, 6), torch.randint(0, 3, (N,))
    model, x = copy.deepcopy(model64).to(dtype), x64.to(dtype)
    # the reference: the float64 loop on exactly the same (rounded) numbers
    ref_model, ref_x = copy.deepcopy(model).double(), x.double()
    want = flat(loop_per_sample_grads(ref_model, ref_x, y, nn.CrossEntropyLoss()))
    want_jac = torch.cat([j.flatten(2) for j in loop_param_jacobian(ref_model, ref_x).values()],
                         2)
    state = snapshot(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        grads = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
        got_rows = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method,
                                    flat=True)
        norms = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(), method=method)
        jac = param_jacobian(model, x, method=method, flat=True)
    assert not [w for w in record if "Falling back" in str(w.message)]
    assert {g.dtype for g in grads.values()} == {dtype}
    assert got_rows.dtype == jac.dtype == dtype
    assert norms.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(flat(grads), got_rows)
    tol = REL_TOL[dtype]
    rel = (got_rows.double() - want).norm(dim=1) / want.norm(dim=1)
    assert (rel < tol).all(), rel
    assert ((norms.double() - want.norm(dim=1)).abs() / want.norm(dim=1) < tol).all()
    rel_jac = (jac.double() - want_jac).flatten(1).norm(dim=1) / want_jac.flatten(1).norm(dim=1)
    assert (rel_jac < tol).all(), rel_jac
    state.assert_unchanged()


# ---------------------------------------------------------------------------
# a module called on a sub-batch


class SubBatch(nn.Module):
    """``fc`` runs on the batch and again on its first sample only: samples interact."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.body.add_module("fc", nn.Linear(4, 3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.body[:2](x)
        return self.body.fc(h) + self.body.fc(h[:1])


def test_module_called_on_a_sub_batch(snapshot):
    """Sample 0's ``fc(h[:1])`` is added to every sample's output: the samples interact.
    The rules refuse, naming where; ``auto`` refuses too (the loop's each-sample-alone
    answer fails the certificate), and ``method="loop"`` gives that answer when asked."""
    model = SubBatch()
    x, y = torch.randn(N, 4), torch.randn(N, 3)
    state = snapshot(model)
    pattern = r"spreads one sample's data over others, in module '<root>' \(SubBatch\)"
    with pytest.raises(ValueError, match=pattern):
        per_sample_grads(model, x, y, nn.MSELoss(), method="rules")
    with pytest.raises(ValueError, match=pattern):
        per_sample_grad_norms(model, x, y, nn.MSELoss(), method="rules")
    with pytest.raises(Exception, match="spreads one sample"):
        param_jacobian(model, x, method="rules")
    with pytest.warns(UserWarning, match=pattern):
        with pytest.raises(CertificateError, match="the model mixes samples.*" + pattern):
            per_sample_grads(model, x, y, nn.MSELoss())
    got = per_sample_grads(model, x, y, nn.MSELoss(), method="loop")
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.MSELoss()))
    state.assert_unchanged()
    assert_nothing_left(model)


def test_module_called_on_a_sub_batch_in_private_grad():
    """private_grad, like method="auto", refuses: a sample's gradient, its clipping and
    the guarantee are not defined; ``p.grad`` is left as it was."""
    model = SubBatch()
    x, y = torch.randn(N, 4), torch.randn(N, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CertificateError, match="mixes samples"):
            private_grad(model, x, y, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=0.0)
    assert all(p.grad is None for p in model.parameters())
    assert_nothing_left(model)


# ---------------------------------------------------------------------------
# two threads at once


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.fc = nn.Linear(12, 4)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.emb(ids).flatten(1))


def test_two_threads_two_models():
    """Each thread captures its own model; the calls overlap (a barrier before each)."""
    models = {"net": Net(), "tagger": Tagger()}
    data = {"net": net_data(5), "tagger": (torch.randint(0, 7, (6, 4)),
                                            torch.randint(0, 4, (6,)))}
    want = {k: loop_per_sample_grads(models[k], *data[k], nn.CrossEntropyLoss())
            for k in models}
    want_norms = {k: flat(w).norm(dim=1) for k, w in want.items()}
    rounds = 6
    barrier = threading.Barrier(2, timeout=60)
    got: dict = {}
    errors: list = []
    dtype = torch.get_default_dtype()

    def work(key: str) -> None:
        torch.set_default_dtype(dtype)  # process-wide anyway; harmless
        try:
            for r in range(rounds):
                barrier.wait()
                method = "rules" if r % 2 == 0 else "auto"
                got[key, r] = per_sample_grads(models[key], *data[key], nn.CrossEntropyLoss(),
                                               method=method)
                barrier.wait()
                got[key, r, "norms"] = per_sample_grad_norms(
                    models[key], *data[key], nn.CrossEntropyLoss(), method=method)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for key in models:
        for r in range(rounds):
            assert_grads_equal(got[key, r], want[key])
            torch.testing.assert_close(got[key, r, "norms"], want_norms[key], **TOL)
        assert_nothing_left(models[key])


def test_two_threads_one_model():
    """One model run by two threads at once, each on its own batch: each capture
    records only its own thread's calls (the hooks sit on the shared modules)."""
    model = Net()
    batches = [net_data(5), net_data(3)]
    want = [loop_per_sample_grads(model, *b, nn.CrossEntropyLoss()) for b in batches]
    barrier = threading.Barrier(2, timeout=60)
    got: dict = {}
    errors: list = []

    def work(k: int) -> None:
        try:
            for r in range(8):
                barrier.wait()
                got[k, r] = per_sample_grads(model, *batches[k], nn.CrossEntropyLoss(),
                                             method="rules")
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for k in range(2):
        for r in range(8):
            assert_grads_equal(got[k, r], want[k])
    assert_nothing_left(model)


# ---------------------------------------------------------------------------
# activations modified in place: the backprops come from autograd's own nodes


def inplace_relu_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))


def out_of_place(model: nn.Sequential) -> nn.Module:
    return nn.Sequential(model[0], nn.ReLU(), model[2])


def test_inplace_relu_norms_and_jacobian_on_the_rules(snapshot):
    model = inplace_relu_model()
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    want = flat(loop_per_sample_grads(out_of_place(model), x, y, nn.CrossEntropyLoss()))
    state = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(), method="rules")
        jac = param_jacobian(model, x, method="rules")
    torch.testing.assert_close(got, want.norm(dim=1), **TOL)
    assert_grads_equal(jac, loop_param_jacobian(out_of_place(model), x))
    state.assert_unchanged()
    assert_nothing_left(model)


def test_inplace_relu_private_grad(snapshot):
    """Noise 0: the clipped sum of the loop's per-sample gradients."""
    model = inplace_relu_model()
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    want = flat(loop_per_sample_grads(out_of_place(model), x, y, nn.CrossEntropyLoss()))
    c = (1.0 / (want.norm(dim=1) + 1e-6)).clamp(max=1.0)
    private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=0.0)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, (c[:, None] * want).sum(0) / N, **TOL)
    assert_nothing_left(model)


class InPlaceAfterNoRule(nn.Module):
    """``F.relu_`` on the output of a module whose parameter enters an elementwise scale."""

    def __init__(self):
        super().__init__()
        self.scale = Scale(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.relu_(self.scale(x)))


@pytest.mark.parametrize("method", ["rules", "auto"])
def test_inplace_op_after_a_scale(method, snapshot):
    model = InPlaceAfterNoRule()
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    want = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    state = snapshot(model)
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert_grads_equal(got, want)
    state.assert_unchanged()


# ---------------------------------------------------------------------------
# method="vmap" (and auto's fallback to it) with inputs that require grad


@pytest.mark.parametrize("kind", ["dict", "flat", "out"])
def test_vmap_with_inputs_that_require_grad(kind):
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    want = flat(loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))
    x.requires_grad_(True)
    kwargs = {"flat": True} if kind == "flat" else {}
    if kind == "out":
        kwargs["out"] = torch.zeros(N, want.shape[1])
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="vmap", **kwargs)
    if kind == "dict":
        assert not any(g.requires_grad for g in got.values())
        got = flat(got)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, **TOL)
    assert x.grad is None


def test_vmap_param_jacobian_flat_with_inputs_that_require_grad():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(N, 4)
    want = torch.cat([j.flatten(2) for j in loop_param_jacobian(model, x).values()], 2)
    got = param_jacobian(model, x.requires_grad_(True), method="vmap", flat=True)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, **TOL)


def test_auto_inplace_flat_with_inputs_that_require_grad():
    """An in-place ReLU and inputs that require grad: the rules, flat, no graph left."""
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    ref_model = nn.Sequential(model[0], nn.ReLU(), model[2])
    want = flat(loop_per_sample_grads(ref_model, x, y, nn.CrossEntropyLoss()))
    got = per_sample_grads(model, x.requires_grad_(True), y, nn.CrossEntropyLoss(),
                           method="auto", flat=True)
    assert not got.requires_grad and x.grad is None
    torch.testing.assert_close(got, want, **TOL)


class AddsInPlace(nn.Module):
    """A parameter added in place to a batched tensor: ``h += self.shift``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.shift = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        h = h * 1.0  # a fresh tensor, so the in-place add does not touch fc's output
        h += self.shift
        return h * h


@pytest.mark.parametrize("method", ["rules", "auto"])
def test_parameter_added_in_place_is_not_replayed_in_place(method, snapshot):
    """The op's per-sample VJP must not replay an in-place op on captured tensors: the
    parameter takes the per-module fallback, the results match the loop, and the
    inputs are not modified."""
    model = AddsInPlace()
    x, y = torch.randn(N, 4), torch.randn(N, 3)
    x0 = x.clone()
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    state = snapshot(model)
    got = per_sample_grads(model, x, y, nn.MSELoss(), method=method)
    assert_grads_equal(got, want)
    assert torch.equal(x, x0)
    state.assert_unchanged()
