"""Models whose forward returns a ``torch.distributions`` object, and GFNet's global
filter (a complex weight through ``view_as_complex`` times an image's spectrum), each
against the loop over samples in float64: per-sample gradients (``auto`` and
``rules``), their norms and the DP step (:func:`battery.check`), the paths
``supported`` reports, and no warning where the rules answer.

The sizes coincide with the batch size on purpose (``B`` = actions = mixture
components = the filter's height): where the samples are is never read from a size.

- Distributions broadcast their parameters with ``torch.broadcast_tensors``: a
  state-independent ``log_std`` beside batched means is widened to the batch, and its
  reads are pulled back through that widening. A ``(B,)`` loss whose ops keep the
  samples apart (``log_prob``, ``entropy``, ``logsumexp`` of a mixture) is summed as it
  is; a scalar loss needs each sample's part of the output, which a distribution (no
  pytree opens it) cannot give: the rules refuse, ``auto`` answers by torch.func or the
  loop, never with every sample's loss of the whole batch.
- A ``TransformedDistribution``'s affine transform evaluates its parameters in
  ``log_prob``, inside ``loss_fn``: followed as ops like the forward's.
- Complex tensors follow PyTorch's convention (``g * conj(x)``): the elementwise rules
  hold for them; rules written for real tensors (``F.linear``, ``matmul``) leave a
  complex call to its exact per-sample VJP.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributions import (
    Categorical,
    Independent,
    MixtureSameFamily,
    Normal,
    TransformedDistribution,
)
from torch.distributions.transforms import AffineTransform, TanhTransform

import persample
from battery import ANY, assert_exact, check, norms_of
from persample.batch import SHARED, Batched
from persample.capture import Capture

B = 4  # = actions = mixture components = the filter's height
D = 5  # input features
ON_RULES = {"rule", "op vjp"}  # the engine's own paths (no whole-model fallback)


def paths(model: nn.Module, x, y, loss_fn) -> dict[str, str]:
    """``{parameter: path}`` as ``supported`` reports the call."""
    return {f"{r.module}.{p}" if r.module else p: r.path
            for r in persample.supported(model, x, y, loss_fn) for p in r.params}


def exact_on_the_rules(model: nn.Module, x, y, loss_fn, *, rule: set[str] | None = None,
                       dp: bool = True) -> dict[str, Tensor]:
    """The battery (``rules`` and ``auto``, norms, the DP step) with no warning at all,
    then ``supported``: every parameter on the engine's own paths, those of ``rule`` (all
    where ``None``) by their ops' rules; returns the loop's gradients."""
    want = check(model, x, y, loss_fn, paths=None, forbid=ANY, dp=dp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = paths(model, x, y, loss_fn)
        assert_exact(persample.per_sample_grads(model, x, y, loss_fn, method="rules"), want)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable, got
    assert set(got.values()) <= ON_RULES, got
    for name in trainable if rule is None else rule:
        assert got[name] == "rule", got
    return want


# ---------------------------------------------------------------------------
# distributions


class ActorCritic(nn.Module):
    """A2C/PPO's Gaussian policy: batched means, a state-independent ``log_std``, and a
    value head."""

    def __init__(self, actions: int = B):
        super().__init__()
        self.lin = nn.Linear(D, 8)
        self.head = nn.Linear(8, actions)
        self.value_head = nn.Linear(8, 1)
        self.log_std = nn.Parameter(torch.linspace(-0.5, 0.5, actions))

    def forward(self, x: Tensor) -> tuple[Normal, Tensor]:
        h = torch.tanh(self.lin(x))
        mu = self.head(h)
        return Normal(mu, self.log_std.exp()), self.value_head(h).squeeze(-1)


def a2c_loss(out: tuple[Normal, Tensor], y: Tensor) -> Tensor:
    """``(B,)``: policy gradient, value regression and an entropy bonus; ``y`` holds each
    sample's action ``(A,)``, advantage and return."""
    dist, value = out
    a, adv, ret = y[:, :B], y[:, B], y[:, B + 1]
    return (-dist.log_prob(a).sum(-1) * adv + (value - ret) ** 2
            - 0.01 * dist.entropy().sum(-1))


def _a2c_batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(B, D), torch.randn(B, B + 2)


def test_actor_critic_is_exact_on_the_rules():
    """Every parameter's rows as the loop's (the value head's were ``B`` times too large
    when each sample's loss was evaluated on the whole batch's distribution)."""
    torch.manual_seed(0)
    model = ActorCritic()
    x, y = _a2c_batch()
    exact_on_the_rules(model, x, y, a2c_loss,
                       rule={"lin.weight", "lin.bias", "head.weight", "head.bias",
                             "value_head.weight", "value_head.bias"})


class MixtureDensity(nn.Module):
    """A mixture density network: ``K`` Gaussian components in 2-d, mixed by logits."""

    def __init__(self, k: int = B):
        super().__init__()
        self.k = k
        self.body = nn.Linear(D, 8)
        self.logits = nn.Linear(8, k)
        self.loc = nn.Linear(8, 2 * k)
        self.log_scale = nn.Linear(8, 2 * k)

    def forward(self, x: Tensor) -> MixtureSameFamily:
        h = torch.tanh(self.body(x))
        loc = self.loc(h).view(-1, self.k, 2)
        scale = self.log_scale(h).view(-1, self.k, 2).exp()
        return MixtureSameFamily(Categorical(logits=self.logits(h)),
                                 Independent(Normal(loc, scale), 1))


def test_mixture_density_network_is_exact_on_the_rules():
    torch.manual_seed(0)
    model = MixtureDensity()
    x, y = torch.randn(B, D), torch.randn(B, 2)
    exact_on_the_rules(model, x, y, lambda dist, y: -dist.log_prob(y))


class Policy(nn.Module):
    def __init__(self, actions: int = B):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, actions))

    def forward(self, x: Tensor) -> Categorical:
        return Categorical(logits=self.net(x))


def test_categorical_policy_is_exact_on_the_rules():
    """REINFORCE with an entropy bonus, the actions as targets."""
    torch.manual_seed(0)
    model = Policy()
    x, a = torch.randn(B, D), torch.tensor([3, 0, 3, 1])

    def loss_fn(dist: Categorical, a: Tensor) -> Tensor:
        return -dist.log_prob(a) - 0.1 * dist.entropy()

    exact_on_the_rules(model, x, a, loss_fn)


class DiagonalGaussian(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(D, B)
        self.log_std = nn.Parameter(torch.linspace(-0.3, 0.3, B))

    def forward(self, x: Tensor) -> Independent:
        return Independent(Normal(self.mean(x), self.log_std.exp()), 1)


def test_independent_normal_is_exact_on_the_rules():
    torch.manual_seed(0)
    model = DiagonalGaussian()
    x, y = torch.randn(B, D), torch.randn(B, B)
    exact_on_the_rules(model, x, y, lambda dist, y: -dist.log_prob(y),
                       rule={"mean.weight", "mean.bias"})


class SquashedGaussian(nn.Module):
    """SAC's tanh-squashed Gaussian behind a learned affine map: the transform's
    parameters are evaluated in ``log_prob``, inside ``loss_fn``."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(D, B)
        self.log_std = nn.Parameter(torch.linspace(-0.3, 0.3, B))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, B))
        self.scale = nn.Parameter(torch.linspace(0.8, 1.2, B))

    def forward(self, x: Tensor) -> TransformedDistribution:
        base = Normal(self.mean(x), self.log_std.exp())
        return TransformedDistribution(base, [AffineTransform(self.shift, self.scale),
                                              TanhTransform()])


def _squashed_batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(B, D), torch.rand(B, B) * 1.6 - 0.8


def test_transformed_distribution_is_exact_on_the_rules():
    torch.manual_seed(0)
    model = SquashedGaussian()
    x, y = _squashed_batch()
    exact_on_the_rules(model, x, y, lambda dist, y: -dist.log_prob(y).sum(-1),
                       rule={"mean.weight", "mean.bias", "shift", "scale"})


@pytest.mark.parametrize("build, targets", [
    (Policy, lambda: torch.tensor([3, 0, 3, 1])),
    (SquashedGaussian, lambda: _squashed_batch()[1]),
], ids=["categorical", "transformed"])
def test_a_scalar_loss_over_a_distribution_is_refused_then_answered(build, targets):
    """A scalar loss is each sample's loss evaluated on its part of the output, which a
    distribution cannot give: the rules refuse (naming it), ``auto`` warns and answers
    exactly, ``supported`` says the whole model's method."""
    torch.manual_seed(0)
    model, x, y = build(), torch.randn(B, D), targets()

    def loss_fn(dist, y: Tensor) -> Tensor:
        return -dist.log_prob(y).reshape(len(y), -1).sum(1).mean()

    want = persample.loop_per_sample_grads(model, x, y, loss_fn)
    with pytest.raises(persample.NeedsWholeModel, match="cannot cut by sample"):
        persample.per_sample_grads(model, x, y, loss_fn, method="rules")
    with pytest.warns(UserWarning, match="cannot cut by sample"):
        got = persample.per_sample_grads(model, x, y, loss_fn)
    assert_exact(got, want)
    with pytest.warns(UserWarning, match="cannot cut by sample"):
        norms = persample.per_sample_grad_norms(model, x, y, loss_fn)
    torch.testing.assert_close(norms, norms_of(want), rtol=1e-10, atol=1e-12)
    assert not set(paths(model, x, y, loss_fn).values()) & ON_RULES


def test_a_parameter_read_in_a_followed_loss_is_attributed():
    """A ``(B,)`` loss reading a parameter (an L2 penalty written into each sample's
    loss) is followed as the forward is: exact on the rules. ``torch.func`` would not see
    that read (it differentiates the copies ``functional_call`` gives the forward):
    ``method="vmap"`` refuses it."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)

    def penalised(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y, reduction="none") + net.weight.square().sum()

    x, y = torch.randn(B, 3), torch.randint(0, 2, (B,))
    want = persample.loop_per_sample_grads(net, x, y, penalised)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact(persample.per_sample_grads(net, x, y, penalised, method="rules"), want)
        assert_exact(persample.per_sample_grads(net, x, y, penalised), want)
    with pytest.raises(persample.UnsupportedModuleError, match="reads parameter 'weight'"):
        persample.per_sample_grads(net, x, y, penalised, method="vmap")


# ---------------------------------------------------------------------------
# the data flow of broadcast_tensors


def test_broadcast_tensors_keeps_each_input_s_layout():
    """Output ``k`` is input ``k`` widened: a shared input stays shared beside a batched
    one (``(B, A)`` means with ``A == B``, a ``(A,)`` scale), whatever the sizes."""
    mu, scale, col = torch.randn(B, B), torch.rand(B) + 0.5, torch.randn(B, 1)
    with Capture(None, {}, B, [mu, col], shared=(scale,)) as cap:
        a, b = torch.broadcast_tensors(mu, scale)
        c, d = torch.broadcast_tensors(col, mu.t())
    assert [cap.layout(t) for t in (a, b)] == [Batched(0), SHARED]
    assert cap.layout(c) == Batched(0)
    assert cap.layout(d) == Batched(1)  # (mu.t(): its samples along dim 1)


SIZES = st.integers(1, 4)  # the batch size and every other dim: they coincide often


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_broadcast_tensors_layouts_are_what_the_op_does(data):
    """Each output position depends on its own sample's input only, a shared output on
    none (the derivative at the forward that ran, as in ``test_flow_properties``)."""
    n = data.draw(SIZES, label="batch size")
    shape = data.draw(st.lists(SIZES, min_size=1, max_size=3), label="other dims")
    d = data.draw(st.integers(0, len(shape)), label="batch dim")
    shape.insert(d, n)
    x = torch.randn(shape, dtype=torch.float64)
    keep = [data.draw(st.booleans()) for _ in shape]
    other = [s if k else 1 for s, k in zip(shape, keep)][data.draw(st.integers(0, len(shape))):]
    lead = data.draw(st.lists(SIZES, max_size=1), label="new leading dims")
    w = torch.rand(other, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def fn(t: Tensor) -> tuple[Tensor, ...]:
        return torch.broadcast_tensors(t.expand(*lead, *t.shape), w * 1)

    with Capture(None, {}, n, [(x, Batched(d))], shared=(w,)) as cap:
        outs = fn(x)
    layouts = [cap.layout(o) for o in outs]
    assert layouts[1] is SHARED
    if n > 1:
        assert isinstance(layouts[0], Batched), layouts
    jacobians = torch.autograd.functional.jacobian(fn, x)
    sample = torch.arange(n).view([-1 if k == d else 1 for k in range(x.dim())]).expand(shape)
    for out, lay, jac in zip(outs, layouts, jacobians):
        reads = jac.reshape(out.numel(), x.numel()) != 0
        if lay is SHARED:
            assert not reads.any()
        elif isinstance(lay, Batched):
            owner = torch.arange(n).view([-1 if k == lay.dim else 1
                                          for k in range(out.dim())]).expand(out.shape)
            assert not (reads & (owner.reshape(-1, 1) != sample.reshape(1, -1))).any(), lay


# ---------------------------------------------------------------------------
# GFNet's global filter: a complex weight times the spectrum


class GlobalFilter(nn.Module):
    """GFNet's global filter layer (Rao et al. 2021): ``irfft2(rfft2(x) * W)`` over the
    ``(h, w)`` grid of a ``(B, h, w, dim)`` input, ``W`` a complex weight stored as
    ``(h, w // 2 + 1, dim, 2)`` real pairs."""

    def __init__(self, dim: int, h: int, w: int):
        super().__init__()
        self.h, self.w = h, w
        self.complex_weight = nn.Parameter(torch.randn(h, w // 2 + 1, dim, 2) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
        weight = torch.view_as_complex(self.complex_weight)
        x = x * weight
        return torch.fft.irfft2(x, s=(self.h, self.w), dim=(1, 2), norm="ortho")


class GFNetBlock(nn.Module):
    """A filter between two linear maps; the head reads every position (a mean over the
    grid would read the spectrum's real DC term alone)."""

    def __init__(self, h: int = B, w: int = 6, dim: int = 3, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.filter = GlobalFilter(dim, h, w)
        self.head = nn.Linear(h * w * dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.filter(self.embed(x))).flatten(1))


def _image() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(B, B, 6, 3), torch.randint(0, 5, (B,))


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(),
                                     nn.CrossEntropyLoss(reduction="none")],
                         ids=["mean", "none"])
def test_gfnet_global_filter_is_exact_on_the_rules(loss_fn):
    torch.manual_seed(0)
    model = GFNetBlock()
    x, y = _image()
    want = check(model, x, y, loss_fn, paths={"rule"}, forbid=ANY, jacobian=True)
    assert want["filter.complex_weight"].abs().amax((0, 1, 2, 3)).min() > 0  # both parts


class RealFilter(nn.Module):
    """A real weight times the spectrum (its gradient the real part of ``g * conj(X)``)."""

    def __init__(self, h: int = B, w: int = 6, classes: int = 5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h, w // 2 + 1) + 0.5)
        self.head = nn.Linear(h * w, classes)

    def forward(self, x: Tensor) -> Tensor:
        spectrum = torch.fft.rfft2(x, norm="ortho") * self.weight
        return self.head(torch.fft.irfft2(spectrum, s=x.shape[-2:], norm="ortho").flatten(1))


def test_a_real_weight_on_a_spectrum_is_exact_on_the_rules():
    torch.manual_seed(0)
    model = RealFilter()
    x, y = torch.randn(B, B, 6), torch.randint(0, 5, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), paths={"rule"}, forbid=ANY)


class ComplexLinear(nn.Module):
    """Complex weights in ops whose rules are written for real tensors (``F.linear``,
    ``matmul``): their exact per-sample VJPs answer."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(3, D, 2))
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        z, w = torch.fft.fft(x), torch.view_as_complex(self.weight)
        h = F.linear(z, w) if self.kind == "linear" else z @ w.t()
        return self.head(h.abs())


@pytest.mark.parametrize("kind", ["linear", "matmul"])
def test_complex_weights_in_real_rules_take_their_exact_vjp(kind):
    torch.manual_seed(0)
    model = ComplexLinear(kind)
    x, y = torch.randn(B, D), torch.randint(0, 2, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), paths=None, forbid=ANY)
    got = paths(model, x, y, nn.CrossEntropyLoss())
    assert got == {"weight": "op vjp", "head.weight": "rule", "head.bias": "rule"}, got
