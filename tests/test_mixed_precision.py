"""Mixed precision: every public function under ``torch.autocast`` (bfloat16, and
float16 where the CPU kernels have it) and on models whose weights are bfloat16 or
float16, on the rules, against the loop run the same way.

The reference is the model as autocast runs it: ``loop_per_sample_grads`` (or
``loop_param_jacobian``, or each sample's ``torch.autograd.functional.jacobian``)
under the same autocast. The two differ by rounding only: the loop rounds every
activation and backprop to the low-precision dtype inside autograd, op by op, and
rounds each sample's gradient once more at the end; persample reads the same rounded
backprops and sums in float32. So each parameter's result is compared relative to
its largest entry (:func:`errors`), with ten units of roundoff of the dtype:
``RTOL[torch.bfloat16] = 2e-2`` (8 significand bits, unit roundoff ``2**-9``) and
``RTOL[torch.float16] = 5e-3`` (11 bits, ``2**-11``). The largest difference seen on
these models is about half of that (a bidirectional LSTM's recurrent weights under
bfloat16), and :func:`test_comparison_fails_on_swapped_samples_and_a_dropped_use`
checks that the comparison still rejects samples swapped and one use of a tied weight
dropped. DP sums are compared relative to the largest clipped per-sample gradient
(:func:`assert_dp_close`): each sample's rounding is relative to its own gradient,
however much the samples cancel in the sum.

Dtypes checked everywhere: per-sample results in the parameter's dtype; norms,
clip factors and clipped sums in float32 (``p.grad`` in the parameter's dtype); input
Jacobians in the model output's dtype. "On the rules" is checked with
``persample.supported`` (every parameter "rule" or "module rule") and by the absence
of the warning ``method="auto"`` gives when it leaves them.

The tests' conftest makes float64 the default dtype: every model here is made
float32 (``.float()``) or low precision explicitly, with inputs to match.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

import persample
from persample.cli import real_models
from persample.dp import PrivateStep, private_grad

B = 4  # = T = heads: sizes chosen to coincide
BF16, FP16 = torch.bfloat16, torch.float16
RTOL = {BF16: 2e-2, FP16: 5e-3}


def _onednn_runs_low_precision_lstm() -> bool:
    """Does torch's own oneDNN LSTM kernel run under CPU autocast on this machine? On CPUs
    whose oneDNN has no low-precision RNN primitive (AMD EPYC here) a plain
    ``lstm(x)`` under ``torch.autocast("cpu")`` raises "could not create a primitive
    descriptor for the LSTM forward propagation primitive", persample or not."""
    lstm = nn.LSTM(2, 3)
    try:
        for dtype in (BF16, FP16):
            with torch.autocast("cpu", dtype=dtype):
                lstm(torch.randn(2, 1, 2))
    except RuntimeError:
        return False
    return True


@pytest.fixture(autouse=True)
def _lstm_kernel_that_runs():
    """Where torch's oneDNN LSTM kernel cannot run under autocast, the tests run torch's
    native kernels instead (``torch.backends.mkldnn`` off), for the model and the
    reference alike: what is tested is persample, not oneDNN's coverage of this CPU."""
    if _ONEDNN_LSTM:
        yield
    else:
        with torch.backends.mkldnn.flags(enabled=False):
            yield


_ONEDNN_LSTM = _onednn_runs_low_precision_lstm()


# ---------------------------------------------------------------------------
# models: each builder returns (model, inputs, targets, loss_fn) in float32


class MLP(nn.Module):  # F.linear
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class CNN(nn.Module):  # conv2d, conv1d
    def __init__(self):
        super().__init__()
        self.c2, self.c1 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv1d(4, 4, 3, stride=2)
        self.out = nn.Linear(4 * 7, 3)

    def forward(self, x):  # (B, 2, 4, 4)
        h = F.relu(self.c2(x)).flatten(2)  # (B, 4, 16)
        return self.out(torch.tanh(self.c1(h)).flatten(1))  # (B, 4, 7) -> (B, 3)


class Norms(nn.Module):  # group_norm, batch_norm (eval), prelu, layer_norm
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), \
            nn.BatchNorm2d(4)
        self.act, self.ln, self.out = nn.PReLU(4), nn.LayerNorm(64), nn.Linear(64, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.normal_()
            self.act.weight.uniform_(0.1, 0.5)

    def forward(self, x):  # (B, 2, 4, 4)
        h = self.act(self.bn(self.gn(self.conv(x))))
        return self.out(self.ln(h.flatten(1)))


class Recurrent(nn.Module):  # module rules
    def __init__(self, kind: type):
        super().__init__()
        self.rnn, self.out = kind(4, 6, batch_first=True, bidirectional=True), nn.Linear(12, 3)

    def forward(self, x):  # (B, T, 4)
        h, _ = self.rnn(x)
        return self.out(h[:, -1])


class Attention(nn.Module):
    """A class token joined to the tokens (cat, expand), learned positions and a
    LayerScale (elementwise shift and scale), nn.MultiheadAttention, then a fused qkv
    projection into F.scaled_dot_product_attention (causal); B = T = heads."""

    def __init__(self):
        super().__init__()
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, 8)), nn.Parameter(torch.randn(5, 8))
        self.mha = nn.MultiheadAttention(8, B, batch_first=True)
        self.gamma, self.qkv = nn.Parameter(torch.full((8,), 0.5)), nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 8)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos  # (B, T+1, 8)
        a, _ = self.mha(h, h, h)
        h = h + self.gamma * a
        q, k, v = self.qkv(h).unflatten(2, (3, B, 2)).permute(2, 0, 3, 1, 4)  # (B, heads, T+1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2).mean(1))


def _classes(model: nn.Module, x: Tensor, n_classes: int = 3):
    return model, x, torch.randint(0, n_classes, (x.shape[0],)), nn.CrossEntropyLoss()


def mlp():
    torch.manual_seed(0)
    return _classes(MLP().float(), torch.randn(B, 6, dtype=torch.float32))


def cnn():
    torch.manual_seed(0)
    return _classes(CNN().float(), torch.randn(B, 2, 4, 4, dtype=torch.float32))


def norms():
    torch.manual_seed(0)
    return _classes(Norms().float().eval(), torch.randn(B, 2, 4, 4, dtype=torch.float32))


def lstm():
    torch.manual_seed(0)
    return _classes(Recurrent(nn.LSTM).float(), torch.randn(B, B, 4, dtype=torch.float32))


def gru():
    torch.manual_seed(0)
    return _classes(Recurrent(nn.GRU).float(), torch.randn(B, B, 4, dtype=torch.float32))


def attention():
    torch.manual_seed(0)
    return _classes(Attention().float(), torch.randn(B, B, 8, dtype=torch.float32))


def _tokens(vocab: int) -> tuple[dict, Tensor]:
    ids = torch.randint(0, vocab, (B, B))
    mask = torch.ones(B, B, dtype=torch.long)
    mask[0, -1] = 0  # one padded position
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def gpt2():
    """transformers' GPT-2 (embedding tied to the output layer), T = heads = B."""
    model = real_models.gpt2(11, seq_len=B, layers=1, width=16, heads=B).float()
    torch.manual_seed(1)
    inputs, labels = _tokens(11)
    return model, inputs, labels, real_models.causal_lm_loss


def gpt2_lora():
    """peft's LoRA on GPT-2's fused attention projection; B made non-zero (peft starts it
    at zero, which would leave A's gradient zero)."""
    model = real_models.with_lora(real_models.gpt2(11, seq_len=B, layers=1, width=16,
                                                   heads=B), rank=2).float()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    inputs, labels = _tokens(11)
    return model, inputs, labels, real_models.causal_lm_loss


MODELS: dict[str, Callable] = {"mlp": mlp, "cnn": cnn, "norms": norms, "lstm": lstm,
                               "gru": gru, "attention": attention, "gpt2": gpt2,
                               "gpt2-lora": gpt2_lora}
# torch 2.13 has no float16 LSTM kernel on the CPU (oneDNN: "could not create a primitive
# descriptor"): the model itself cannot run under float16 autocast, so that pair is left out
AUTOCAST = [(name, BF16) for name in MODELS] + [(name, FP16) for name in MODELS
                                                 if name != "lstm"]
WITH_OUTPUTS = ["mlp", "cnn", "norms", "lstm", "attention"]  # small outputs: param_jacobian


# ---------------------------------------------------------------------------
# comparisons


def errors(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, float]:
    """Per parameter, the largest difference relative to the reference's largest entry."""
    assert list(got) == list(want)
    found = {}
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        diff = (got[name].double() - w.double()).abs().max().item()
        scale = w.double().abs().max().item()
        found[name] = diff / scale if scale > 0 else diff
    return found


def close(got: dict[str, Tensor], want: dict[str, Tensor], dtype: torch.dtype) -> bool:
    return all(e <= RTOL[dtype] for e in errors(got, want).values())


def assert_close(got: dict[str, Tensor], want: dict[str, Tensor], dtype: torch.dtype) -> None:
    bad = {name: f"{e:.2e}" for name, e in errors(got, want).items() if e > RTOL[dtype]}
    assert not bad, f"relative errors above {RTOL[dtype]}: {bad}"


def clipped(ref: dict[str, Tensor], max_grad_norm: float) -> tuple[Tensor, dict, dict]:
    """The loop's norms, and its per-sample gradients clipped and their mean, in float32."""
    g32 = {name: g.float() for name, g in ref.items()}
    norms = torch.cat([g.flatten(1) for g in g32.values()], 1).norm(dim=1)  # (B,)
    c = (max_grad_norm / (norms + 1e-6)).clamp(max=1)
    each = {name: g * c.view(-1, *[1] * (g.dim() - 1)) for name, g in g32.items()}
    return norms, each, {name: g.mean(0) for name, g in each.items()}


def assert_dp_close(model: nn.Module, each: dict, mean: dict, dtype: torch.dtype) -> None:
    """``p.grad`` in the parameter's dtype, within ``RTOL`` of the largest clipped
    per-sample gradient of the loop's mean of them."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        scale = each[name].abs().max().item()
        err = (p.grad.double() - mean[name].double()).abs().max().item()
        assert err <= RTOL[dtype] * scale or err < 1e-12, f"{name}: {err:.2e} of {scale:.2e}"


@contextmanager
def no_fallback():
    """Fail on the warning ``method="auto"`` gives where it leaves the rules."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    left = [str(w.message) for w in caught if "Falling back" in str(w.message)]
    assert not left, left


def assert_on_rules(model, inputs, targets, loss_fn) -> None:
    routes = persample.supported(model, inputs, targets, loss_fn)
    paths = {r.path for r in routes}
    assert paths <= {"rule", "module rule"}, [r for r in routes if r.path not in paths]


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------
# under autocast


@pytest.mark.parametrize(("name", "dtype"), AUTOCAST)
def test_per_sample_grads_under_autocast(name, dtype, snapshot):
    model, x, y, loss_fn = MODELS[name]()
    state = snapshot(model)
    with torch.autocast("cpu", dtype=dtype):
        assert_on_rules(model, x, y, loss_fn)
        with no_fallback():
            got = persample.per_sample_grads(model, x, y, loss_fn)
            flat = persample.per_sample_grads(model, x, y, loss_fn, flat=True, chunk_size=3)
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
    assert {g.dtype for g in got.values()} == {torch.float32} and flat.dtype == torch.float32
    assert_close(got, ref, dtype)
    columns = flat.split([g[0].numel() for g in ref.values()], 1)
    assert_close({k: c.view(ref[k].shape) for k, c in zip(ref, columns)}, ref, dtype)
    state.assert_unchanged()


@pytest.mark.parametrize(("name", "dtype"), AUTOCAST)
def test_norms_under_autocast(name, dtype, snapshot):
    model, x, y, loss_fn = MODELS[name]()
    state = snapshot(model)
    with torch.autocast("cpu", dtype=dtype):
        with no_fallback():
            total, layers = persample.per_sample_grad_norms(model, x, y, loss_fn, per_layer=True)
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
    assert total.dtype == torch.float32 and {v.dtype for v in layers.values()} == {torch.float32}
    want = {name: g.float().flatten(1).norm(dim=1) for name, g in ref.items()}
    assert_close(layers, want, dtype)
    assert_close({"total": total}, {"total": clipped(ref, 1.0)[0]}, dtype)
    state.assert_unchanged()


@pytest.mark.parametrize(("name", "dtype"), AUTOCAST)
def test_private_grad_under_autocast(name, dtype):
    model, x, y, loss_fn = MODELS[name]()
    with torch.autocast("cpu", dtype=dtype):
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
        c = clipped(ref, 1.0)[0].median().item()  # some samples clipped, some not
        norms, each, mean = clipped(ref, c)
        with no_fallback():
            _, got = private_grad(model, x, y, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    assert got.dtype == torch.float32
    assert_close({"norms": got}, {"norms": norms}, dtype)
    assert_dp_close(model, each, mean, dtype)


@pytest.mark.parametrize(("name", "dtype"), [(n, BF16) for n in MODELS] + [("gpt2", FP16)])
def test_private_step_under_autocast(name, dtype):
    """Two micro-batches accumulated, then released: the clipped mean of the loop's."""
    model, x, y, loss_fn = MODELS[name]()
    with torch.autocast("cpu", dtype=dtype):
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
        c = clipped(ref, 1.0)[0].median().item()
        _, each, mean = clipped(ref, c)
        step = PrivateStep(model, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                           expected_batch_size=B)
        with no_fallback():
            for part in (slice(0, 1), slice(1, B)):
                xs = {k: v[part] for k, v in x.items()} if isinstance(x, dict) else x[part]
                step.accumulate(xs, y[part])
        step.release()
    assert_dp_close(model, each, mean, dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("name", WITH_OUTPUTS)
def test_param_jacobian_under_autocast(name, dtype, snapshot):
    if name == "lstm" and dtype == FP16:
        return  # no float16 LSTM kernel on the CPU (see AUTOCAST); bfloat16 runs
    model, x, _, _ = MODELS[name]()
    state = snapshot(model)
    with torch.autocast("cpu", dtype=dtype):
        with no_fallback():
            got = persample.param_jacobian(model, x)
        ref = persample.loop_param_jacobian(model, x)
    assert {g.dtype for g in got.values()} == {torch.float32}
    assert_close(got, ref, dtype)
    state.assert_unchanged()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_vmap_and_loop_methods_under_autocast(dtype):
    """``method="vmap"`` runs a BatchNorm (eval) and a LayerNorm reading low-precision
    outputs (a convolution's, a linear layer's) with float32 parameters, which torch.func
    cannot batch as they are; and ``method="loop"`` is the loop."""
    torch.manual_seed(0)
    net = Norms()  # without its PReLU: vmap(jacrev) refuses PReLU in this torch version
    model = nn.Sequential(net.conv, net.gn, net.bn, nn.Tanh(), nn.Flatten(), nn.Linear(64, 8),
                          nn.LayerNorm(8), nn.Linear(8, 3)).float().eval()
    model, x, y, loss_fn = _classes(model, torch.randn(B, 2, 4, 4, dtype=torch.float32))
    with torch.autocast("cpu", dtype=dtype):
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
        by_vmap = persample.per_sample_grads(model, x, y, loss_fn, method="vmap")
        by_loop = persample.per_sample_grads(model, x, y, loss_fn, method="loop")
        jac_ref = persample.loop_param_jacobian(model, x)
        jac_vmap = persample.param_jacobian(model, x, method="vmap")
    assert {g.dtype for g in by_vmap.values()} == {torch.float32}
    assert_close(by_vmap, ref, dtype)
    assert_close(jac_vmap, jac_ref, dtype)
    assert all(torch.equal(by_loop[k], ref[k]) for k in ref)


def test_instance_norm_under_autocast_by_vmap():
    """``F.instance_norm`` (made of batch_norm) after a convolution, by torch.func."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.Tanh(),
                          nn.Flatten(), nn.Linear(12, 3)).float()
    model, x, y, loss_fn = _classes(model, torch.randn(B, 2, 4, 4, dtype=torch.float32))
    with torch.autocast("cpu", dtype=BF16):
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
        got = persample.per_sample_grads(model, x, y, loss_fn, method="vmap")
    ref.pop("0.bias"), got.pop("0.bias")  # zero up to rounding: the norm removes it
    assert_close(got, ref, BF16)


def test_verify_under_autocast():
    model, x, y, loss_fn = attention()
    with torch.autocast("cpu", dtype=BF16):
        report = persample.verify(model, x, y, loss_fn)
    assert report.ok and report.rtol == 2e-2 and report.method == "rules", str(report)
    with torch.autocast("cpu", dtype=FP16):
        assert persample.verify(model, x, y, loss_fn).rtol == 1e-2


def test_comparison_fails_on_swapped_samples_and_a_dropped_use():
    """The tolerance still sees a wrong answer: GPT-2's per-sample gradients with two
    samples swapped, and the tied embedding's gradient with either of its two uses (the
    lookup, the output layer) missing."""
    model, x, y, loss_fn = gpt2()
    untied = copy.deepcopy(model)
    wte = untied.transformer.wte
    untied.lm_head.weight = nn.Parameter(wte.weight.detach().clone())
    with torch.autocast("cpu", dtype=BF16):
        got = persample.per_sample_grads(model, x, y, loss_fn)
        ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
        parts = persample.loop_per_sample_grads(untied, x, y, loss_fn)
    assert close(got, ref, BF16)
    swapped = {name: g[[1, 0, *range(2, B)]] for name, g in got.items()}
    assert not close(swapped, ref, BF16)
    name = "transformer.wte.weight"
    assert close({name: parts[name] + parts["lm_head.weight"]}, {name: ref[name]}, BF16)
    for one_use in (parts[name], parts["lm_head.weight"]):
        assert not close({name: one_use}, {name: ref[name]}, BF16)


# ---------------------------------------------------------------------------
# input Jacobians under autocast


class _CubeWithoutDoubleBackward(torch.autograd.Function):
    """``x ** 3`` whose backward is not differentiable but which has a forward-mode
    formula: ``input_jacobian``'s forward mode then takes ``torch.func.jvp``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * t


class Cubed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 5)

    def forward(self, x):
        return _CubeWithoutDoubleBackward.apply(self.lin(x))


class Scripted(nn.Module):
    """TorchScript inside: the samples of the output cannot be followed (blockwise)."""

    def __init__(self, features: int = 4):
        super().__init__()
        self.lin = nn.Linear(features, features)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated
            self.act = torch.jit.script(nn.Tanh())

    def forward(self, x):
        return self.act(self.lin(x))


class ConvBN(nn.Module):  # square: (B, 2, 5) -> (B, 2, 5)
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv1d(2, 2, 3, padding=1), nn.BatchNorm1d(2)

    def forward(self, x):
        return torch.tanh(self.bn(self.conv(x)))


class SeqOut(nn.Module):  # the LSTM's outputs (B, T, H) from (B, T, I)
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(2, 3, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


def _jacobian_models() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 4)), (B, 3)),
        "conv-bn": (ConvBN().eval(), (B, 2, 5)),
        "attention": (nn.TransformerEncoderLayer(4, B, 8, dropout=0.0, batch_first=True),
                      (B, B, 4)),
        "lstm": (SeqOut(), (B, B, 2)),
        "cubed": (Cubed(), (B, 2)),
        "scripted": (Scripted(), (B, 4)),
    }


def per_sample_jacobian(model: Callable, x: Tensor) -> Tensor:
    """Each sample's Jacobian alone, by ``torch.autograd.functional.jacobian``."""
    return torch.stack([torch.autograd.functional.jacobian(lambda xi: model(xi[None])[0], xi)
                        for xi in x])


# the encoder layer in eval mode has no forward mode in torch (its fused kernel, also in
# float32: mode="forward" raises NotImplementedError as documented)
@pytest.mark.parametrize(("name", "mode"), [
    (name, mode) for name in ("mlp", "conv-bn", "attention", "lstm", "cubed", "scripted")
    for mode in ("reverse", "forward", "auto") if (name, mode) != ("attention", "forward")])
def test_input_jacobian_under_autocast(name, mode, snapshot):
    model, shape = _jacobian_models()[name]
    model = model.float().eval()
    x = torch.randn(*shape, dtype=torch.float32)
    state = snapshot(model)
    with torch.autocast("cpu", dtype=BF16):
        out_dtype = model(x).dtype
        want = per_sample_jacobian(model, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = persample.input_jacobian(model, x, mode=mode)
    blockwise = [w for w in caught if "cannot be followed" in str(w.message)]
    assert bool(blockwise) == (name == "scripted")
    assert got.dtype == out_dtype and got.shape == want.shape
    assert_close({"jacobian": got}, {"jacobian": want}, BF16)
    state.assert_unchanged()


@pytest.mark.parametrize("name", ["mlp", "conv-bn", "scripted"])
def test_jacobian_diagonal_under_autocast(name):
    torch.manual_seed(0)
    model, shape = {"mlp": (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)), (B, 4)),
                    "conv-bn": (ConvBN().eval(), (B, 2, 5)),
                    "scripted": (Scripted(), (B, 4))}[name]
    model = model.float()
    x = torch.randn(*shape, dtype=torch.float32)
    with torch.autocast("cpu", dtype=BF16):
        out_dtype = model(x).dtype
        d = x[0].numel()
        want = per_sample_jacobian(model, x).reshape(B, d, d).diagonal(0, 1, 2).reshape(x.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the blockwise warning (scripted)
            got = persample.jacobian_diagonal(model, x)
    assert got.dtype == out_dtype == BF16
    assert_close({"diagonal": got}, {"diagonal": want}, BF16)


# ---------------------------------------------------------------------------
# bfloat16 and float16 weights

LOW_WEIGHTS = [(name, dtype) for dtype in (BF16, FP16)
               for name in ("mlp", "cnn", "norms", "lstm", "attention", "gpt2")]


def low(name: str, dtype: torch.dtype):
    """The model and its floating inputs in ``dtype``."""
    model, x, y, loss_fn = MODELS[name]()
    x = x if isinstance(x, dict) else x.to(dtype)
    return model.to(dtype), x, y, loss_fn


@pytest.mark.parametrize(("name", "dtype"), LOW_WEIGHTS)
def test_low_precision_weights(name, dtype, snapshot):
    """Per-sample gradients in the weights' dtype, norms in float32, ``p.grad`` in the
    weights' dtype, each against the loop on the same low-precision model."""
    model, x, y, loss_fn = low(name, dtype)
    state = snapshot(model)
    assert_on_rules(model, x, y, loss_fn)
    with no_fallback():
        got = persample.per_sample_grads(model, x, y, loss_fn)
        total = persample.per_sample_grad_norms(model, x, y, loss_fn)
    ref = persample.loop_per_sample_grads(model, x, y, loss_fn)
    assert {g.dtype for g in got.values()} == {dtype} and total.dtype == torch.float32
    assert_close(got, ref, dtype)
    norms, _, _ = clipped(ref, 1.0)
    assert_close({"norms": total}, {"norms": norms}, dtype)
    state.assert_unchanged()
    c = norms.median().item()
    _, each, mean = clipped(ref, c)
    with no_fallback():
        private_grad(model, x, y, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    assert_dp_close(model, each, mean, dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("name", WITH_OUTPUTS)
def test_param_jacobian_low_precision_weights(name, dtype):
    model, x, _, _ = low(name, dtype)
    with no_fallback():
        got = persample.param_jacobian(model, x)
    ref = persample.loop_param_jacobian(model, x)
    assert {g.dtype for g in got.values()} == {dtype}
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_input_jacobians_low_precision_weights(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)).to(dtype)
    x = torch.randn(B, 4, dtype=dtype)
    want = per_sample_jacobian(model, x)
    for mode in ("reverse", "forward"):
        got = persample.input_jacobian(model, x, mode=mode)
        assert got.dtype == dtype
        assert_close({"jacobian": got}, {"jacobian": want}, dtype)
    diag = persample.jacobian_diagonal(model, x)
    assert diag.dtype == dtype
    assert_close({"diagonal": diag}, {"diagonal": want.diagonal(0, 1, 2)}, dtype)


def test_noise_in_float32_added_once_for_bfloat16_weights():
    """``private_grad`` on bfloat16 weights: the noise is N(0, (sigma C)^2) drawn in
    float32 and added once, so ``(p.grad - clean) * B / (sigma C)`` has unit spread
    (twice the noise would give sqrt(2)), and ``p.grad`` is bfloat16."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(BF16)
    x, y = torch.randn(B, 64, dtype=BF16), torch.randn(B, 64, dtype=BF16)
    loss_fn = nn.MSELoss(reduction="sum")
    private_grad(model, x, y, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0)
    clean = {name: p.grad.float() for name, p in trainable(model).items()}
    sigma = 10.0
    private_grad(model, x, y, loss_fn, max_grad_norm=1.0, noise_multiplier=sigma,
                 generator=torch.Generator().manual_seed(0))
    z = torch.cat([((p.grad.float() - clean[name]) * B / sigma).flatten()
                   for name, p in trainable(model).items()])  # 4160 draws
    assert {p.grad.dtype for p in model.parameters()} == {BF16}
    assert abs(z.std().item() - 1) < 0.05 and abs(z.mean().item()) < 0.05
