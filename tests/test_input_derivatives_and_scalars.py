"""0-dim parameters, input derivatives inside the forward or the loss, and two data-flow
handlers (``Tensor.unfold`` by keyword, ``index_select`` by a 0-dim index), against the
loop over samples (float64, at most ``1e-8`` of the largest entry).

- A learned temperature, ``nn.Parameter(torch.tensor(1.0))`` (CLIP's ``logit_scale``):
  its per-sample gradient is ``(B,)``, on the rules, through the per-module fallback and
  over the whole model, in every function: gradients (dict and flat), norms (per
  parameter too), the parameter Jacobian, inner products, projections, the DP step (per
  sample and per user), ``verify``, influence scores; a linear map's bias of one entry
  (0-dim or ``(1,)``) broadcast over its outputs, whose gradient sums them.
- ``torch.autograd.grad(..., create_graph=True)`` in the loss or the forward (a PINN's
  residual from ``u_t`` and ``u_xx``, a WGAN-GP gradient penalty, a MAML-like inner step):
  the rules cannot follow the backward ops of a gradient's own graph and refuse by name
  (``supported`` reports it, never raises), ``torch.func`` refuses a derivative by an
  input by name, and ``method="auto"`` answers with the exact method that can.
  A PINN's ``autograd.grad(u.sum(), xt)`` gives each sample's own input derivatives
  because the samples are independent; the loop, which runs each sample alone, is the
  definition.
- PatchTST's patches ``x.unfold(dimension=-1, size=P, step=S)`` on a ``(B, C, L)``
  series, and ``nn.AdaptiveLogSoftmaxWithLoss`` (``log_prob``; the call with targets,
  whose ``index_select`` by a cluster's rows gets a 0-dim index where one sample falls
  in a cluster): on the rules, or refused by name.

``B`` = 4 = features = channels = patches = the first cutoff: nothing can find the batch
by its size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from battery import (
    METHODS,
    assert_exact,
    check,
    clipped_sum_by_hand,
    dp_grads,
    flat,
    module_paths,
    rows,
)
from persample import (
    GradientProjector,
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grad_dots,
    per_sample_grad_norms,
    per_sample_grads,
)
from persample.dp import private_grad
from persample.errors import REFUSALS

B = E = 4


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


# ---------------------------------------------------------------------------
# 0-dim parameters


class Scaled(torch.autograd.Function):
    """``x * s`` as a custom Function that torch.func can batch: the capture cannot see
    its gradient path, so the module reading ``s`` takes the per-module fallback."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, s: Tensor) -> Tensor:
        return x * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s, (g * x).sum_to_size(s.shape)


@torch.jit.script
def _halved(x: Tensor) -> Tensor:  # TorchScript: the capture cannot see where its samples are
    return 0.5 * x


class Temperature(nn.Module):
    """Two towers and CLIP's learned temperature ``logit_scale`` (0-dim) beside another
    0-dim gain: each sample's ``E`` logits are its own towers' product, scaled.

    ``via``: ``"rules"`` (every op has a rule), ``"fallback"`` (the temperature applied
    by a custom Function: the per-module fallback for it, the rules for the rest),
    ``"whole"`` (TorchScript on per-sample data: the whole-model methods)."""

    def __init__(self, via: str):
        super().__init__()
        self.image, self.text = nn.Linear(E, E), nn.Linear(E, E)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))
        self.shift = nn.Parameter(torch.tensor(-0.2))  # (a constant shift has no gradient)
        self.via = via

    def forward(self, x: Tensor) -> Tensor:
        u, v = F.normalize(self.image(x), dim=-1), F.normalize(self.text(x), dim=-1)
        if self.via == "whole":
            u = _halved(u)
        scale = self.logit_scale.exp()
        logits = Scaled.apply(u * v, scale) if self.via == "fallback" else scale * (u * v)
        return logits + self.shift * v  # (B, E)


VIAS = ["rules", "fallback", "whole"]
PATHS = {"rules": {"": "rule", "image": "rule", "text": "rule"},
         "fallback": None,  # (logit_scale: the fallback; the rest: the rules)
         "whole": {"": "vmap", "image": "vmap", "text": "vmap"}}


def temperature(via: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    return Temperature(via), torch.randn(B, E), torch.randint(0, E, (B,))


@pytest.mark.parametrize("via", VIAS)
def test_a_0_dim_parameter_on_every_path(via):
    model, x, y = temperature(via)
    paths = PATHS[via]
    if via == "whole":
        with pytest.raises(persample.NeedsWholeModel, match="TorchScript"):
            per_sample_grads(model, x, y, ce, method="rules")
    check(model, x, y, ce, methods=[m for m in METHODS if via != "whole" or m != "rules"],
          jacobian=True,
          paths=None if paths is None else module_paths(model, paths),
          forbid=None if via == "whole" else "performance")
    if via == "fallback":
        routes = {p: r.path for r in persample.supported(model, x, y, ce) for p in r.params}
        assert routes["logit_scale"] == "fallback" and routes["shift"] == "rule", routes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = per_sample_grads(model, x, y, ce)
    assert grads["logit_scale"].shape == grads["shift"].shape == (B,)


@pytest.mark.parametrize("via, method", [
    (via, method) for method in METHODS for via in VIAS
    if not (via == "whole" and method == "rules")])  # (the rules refuse that model:
# test_a_0_dim_parameter_on_every_path)
def test_a_0_dim_parameter_in_flat_results_dots_projections_and_verify(via, method):
    model, x, y = temperature(via)
    want = loop_per_sample_grads(model, x, y, ce)
    g = flat(want)  # (B, P)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (auto leaving the rules: test_a_0_dim_parameter...)
        got = per_sample_grads(model, x, y, ce, method=method, flat=True)
        assert got.shape == g.shape
        assert_exact({"flat": got}, {"flat": g})
        assert_exact({"dots": per_sample_grad_dots(model, x, y, ce, method=method)},
                     {"dots": g @ g.T})
        x2, y2 = torch.randn(B + 1, E), torch.randint(0, E, (B + 1,))
        g2 = flat(loop_per_sample_grads(model, x2, y2, ce))
        assert_exact({"dots": per_sample_grad_dots(model, x, y, ce, other=(x2, y2),
                                                   method=method)}, {"dots": g @ g2.T})
        for kind in ("kronecker", "gaussian"):
            proj = GradientProjector(model, 6, kind=kind, seed=1)
            assert_exact({kind: proj(x, y, ce, method=method)}, {kind: proj.project(want)})
        jac = param_jacobian(model, x, method=method, flat=True)  # (B, E, P)
        ref = loop_param_jacobian(model, x)
        assert_exact({"jacobian": jac}, {"jacobian": torch.cat(
            [t.reshape(B, E, -1) for t in ref.values()], 2)})
        result = persample.verify(model, x, y, ce, method=method)
    assert result.ok, str(result)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("per_layer", [False, True])
def test_a_0_dim_parameter_in_the_dp_step_by_sample_and_by_user(via, per_layer):
    """Clipped per sample (flat and per layer), and per user (each user's gradient the sum
    of its records', through the norms of groups of samples)."""
    model, x, y = temperature(via)
    want = loop_per_sample_grads(model, x, y, ce)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norms, got = dp_grads(model, x, y, ce, 0.5, per_layer=per_layer)
    assert_exact({"norms": norms}, {"norms": rows(flat(want)).norm(dim=1)})
    assert_exact(got, clipped_sum_by_hand(want, 0.5, per_layer=per_layer, divisor=B))
    users = torch.tensor([7, 3, 7, 3])  # two users of two records each
    per_user = {k: torch.stack([g[users == 3].sum(0), g[users == 7].sum(0)])
                for k, g in want.items()}  # (2, *shape), users in sorted order
    for p in model.parameters():
        p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        released = private_grad(model, x, y, ce, max_grad_norm=0.5, noise_multiplier=0.0,
                                per_layer=per_layer, user_ids=users)
    got = {k: p.grad for k, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    user_norms = rows(flat(per_user)).norm(dim=1)  # (2,)
    assert_exact({"norms": released.norms}, {"norms": user_norms[(users == 7).long()]})
    assert_exact(got, clipped_sum_by_hand(per_user, 0.5, per_layer=per_layer, divisor=2))


class OneEntryBias(nn.Module):
    """Linear maps whose bias is one entry broadcast over the ``E`` outputs (0-dim or
    ``(1,)``): ``F.linear``, ``torch.addmm`` (with ``beta`` and ``alpha``), or one 0-dim
    bias shared by two maps, on a sequence ``(B, T, E)`` (T = 3) or rows ``(B, E)``."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(0.3 * torch.randn(E, E))
        if form == "shared":
            self.v = nn.Parameter(0.3 * torch.randn(E, E))
        self.b = nn.Parameter(torch.full((1,) if form.endswith("(1,)") else (), 0.4))

    def forward(self, x: Tensor) -> Tensor:
        if self.form.startswith("addmm"):
            return torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0)  # (B, E)
        h = F.linear(x, self.w, self.b)  # (B, T, E)
        if self.form == "shared":
            h = F.linear(torch.tanh(h), self.v, self.b)
        return h.sum(1)  # (B, E)


def squared_error(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


@pytest.mark.parametrize("form", ["linear", "linear (1,)", "addmm", "addmm (1,)", "shared"])
def test_a_bias_of_one_entry_on_the_rules(form):
    """Its gradient is the sum over the outputs too: in the gradient, norm, weighted-sum and
    factor rules (inner products, projections, the norms of a parameter read twice)."""
    torch.manual_seed(0)
    model = OneEntryBias(form)
    x = torch.randn(B, E) if form.startswith("addmm") else torch.randn(B, 3, E)
    y = torch.randn(B, E)
    want = check(model, x, y, squared_error, methods=METHODS, jacobian=True,
                 paths={"rule"}, forbid="performance")
    g = flat(want)
    assert_exact({"dots": per_sample_grad_dots(model, x, y, squared_error, method="rules")},
                 {"dots": g @ g.T})
    proj = GradientProjector(model, 6, seed=1)
    assert_exact({"kronecker": proj(x, y, squared_error, method="rules")},
                 {"kronecker": proj.project(want)})


def test_a_0_dim_parameter_in_influence_scores():
    model, x, y = temperature("rules")
    want = flat(loop_per_sample_grads(model, x, y, ce))
    got = persample.influence(model, (x, y), (x[:2], y[:2]), ce, curvature="identity",
                              damping=1.0)
    assert_exact({"scores": got}, {"scores": want[:2] @ want.T})
    assert_exact({"self": persample.self_influence(model, (x, y), ce, curvature="identity",
                                                   damping=1.0)},
                 {"self": (want * want).sum(1)})


# ---------------------------------------------------------------------------
# torch.autograd.grad(..., create_graph=True) in the loss or the forward

K = 0.3  # the heat equation's diffusivity: u_t = K u_xx


class Field(nn.Module):
    """``u(x, t)``: an MLP on ``(B, 2)`` points, ``(B, 1)``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, E), nn.Tanh(), nn.Linear(E, E), nn.Tanh(),
                                 nn.Linear(E, 1))

    def forward(self, xt: Tensor) -> tuple[Tensor, Tensor]:
        return self.net(xt), xt  # the points too: the loss differentiates by them


def residual(u: Tensor, xt: Tensor) -> Tensor:
    """``(B,)`` the heat equation's squared residual ``(u_t - K u_xx)^2`` at each point:
    each sample's own derivatives, the samples being independent."""
    (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)  # (B, 2): u_x, u_t
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), xt, create_graph=True)  # (B, 2)
    return (du[:, 1] - K * d2u[:, 0]) ** 2


def pinn_loss(out: tuple[Tensor, Tensor], _targets) -> Tensor:
    return residual(*out)


def slope_weighted(out: tuple[Tensor, Tensor], _targets) -> Tensor:
    """``(B,)`` each point's squared ``u`` weighted by its slope ``u_x``, a constant
    (``autograd.grad`` without a graph)."""
    u, xt = out
    (du,) = torch.autograd.grad(u.sum(), xt, retain_graph=True)  # (B, 2)
    return (u.squeeze(-1) * du[:, 0]) ** 2


class Residual(nn.Module):
    """A PINN whose forward returns the residual itself, ``(B,)``."""

    def __init__(self):
        super().__init__()
        self.field = Field()

    def forward(self, xt: Tensor) -> Tensor:
        return residual(*self.field(xt))


class PenalisedCritic(nn.Module):
    """A WGAN-GP critic: its score and the gradient of the score by the input (the
    interpolated points, which require grad), kept in the graph for the penalty."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(E, E), nn.Tanh(), nn.Linear(E, 1))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        score = self.net(x).squeeze(-1)  # (B,)
        (g,) = torch.autograd.grad(score.sum(), x, create_graph=True)  # (B, E)
        return score, g


def penalised(out: tuple[Tensor, Tensor], sign: Tensor) -> Tensor:
    score, g = out
    return sign * score + 10.0 * (g.norm(dim=1) - 1.0) ** 2


class InnerStep(nn.Module):
    """MAML's inner step in the forward, each sample a task: the fast weights
    ``w_i - lr * dL_i/dw_i`` from each sample's copy of ``body.weight`` and its inner
    loss (``create_graph=True``: the outer gradient goes through the step), then the head
    on them."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        fast = self.body.weight.expand(x.shape[0], E, E)  # (B, E, E): each task's weights
        inner = torch.tanh(torch.einsum("bi,boi->bo", x, fast) + self.body.bias)
        (g,) = torch.autograd.grad(inner.square().sum(), fast, create_graph=True)  # each its own
        fast = fast - 0.1 * g
        return self.head(torch.tanh(torch.einsum("bi,boi->bo", x, fast) + self.body.bias))


def points() -> Tensor:
    return torch.rand(B, 2).requires_grad_()  # the user's collocation points


def interpolates() -> Tensor:
    real, fake, eps = torch.randn(B, E), torch.randn(B, E), torch.rand(B, 1)
    return (eps * real + (1 - eps) * fake).requires_grad_()


DERIVATIVES = {
    # name: (model, inputs, targets, loss, the methods that run it: the rest refuse)
    "pinn-loss": (Field, points, lambda: None, pinn_loss, {"loop"}),
    "pinn-forward": (Residual, points, lambda: None, lambda r, _: r, {"loop"}),
    "slope-weighted": (Field, points, lambda: None, slope_weighted, {"loop"}),
    "gradient-penalty": (PenalisedCritic, interpolates, lambda: torch.randn(B), penalised,
                         {"loop"}),
    "inner-step": (InnerStep, lambda: torch.randn(B, E), lambda: torch.randint(0, E, (B,)),
                   ce, {"vmap", "loop"}),
}


def derivative_case(name: str):
    build, inputs, targets, loss_fn, runs = DERIVATIVES[name]
    torch.manual_seed(0)
    return build(), inputs(), targets(), loss_fn, runs


@pytest.mark.parametrize("name", DERIVATIVES)
def test_create_graph_is_refused_by_the_rules_and_answered_exactly(name):
    model, x, y, loss_fn, runs = derivative_case(name)
    want = loop_per_sample_grads(model, x, y, loss_fn)
    assert bool((rows(flat(want)).norm(dim=1) > 0).all())
    routes = persample.supported(model, x, y, loss_fn)  # reports, never raises
    assert {r.path for r in routes} == {"vmap"}, str(routes)
    assert all("torch.autograd.grad" in r.reason for r in routes), str(routes)
    in_forward = name in ("pinn-forward", "gradient-penalty", "inner-step")
    routes = persample.supported(model, x)  # the sum of the outputs: the forward alone
    assert {r.path for r in routes} == {"vmap" if in_forward else "rule"}, str(routes)
    with pytest.raises(persample.NeedsWholeModel, match=r"torch.autograd.grad"):
        per_sample_grads(model, x, y, loss_fn, method="rules")
    with pytest.raises(persample.NeedsWholeModel, match=r"torch.autograd.grad"):
        per_sample_grad_norms(model, x, y, loss_fn, method="rules")
    if "vmap" not in runs:
        with pytest.raises(persample.UnsupportedModuleError, match=r"method='vmap'.*input"):
            per_sample_grads(model, x, y, loss_fn, method="vmap")
    for method in ["auto", *sorted(runs)]:
        with pytest.warns(UserWarning, match="torch.autograd.grad") if method == "auto" \
                else warnings.catch_warnings():
            got = per_sample_grads(model, x, y, loss_fn, method=method)
        assert_exact(got, want)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            total, layers = per_sample_grad_norms(model, x, y, loss_fn, method=method,
                                                  per_layer=True)
        assert_exact({"total": total, **layers},
                     {"total": rows(flat(want)).norm(dim=1),
                      **{k: rows(g).norm(dim=1) for k, g in want.items()}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = flat(want)
        assert_exact({"dots": per_sample_grad_dots(model, x, y, loss_fn)}, {"dots": g @ g.T})
    assert x.grad is None if isinstance(x, Tensor) else True  # the user's inputs untouched


@pytest.mark.parametrize("name", ["pinn-forward", "inner-step"])
def test_param_jacobian_of_a_forward_with_create_graph(name):
    model, x, _, _, runs = derivative_case(name)
    want = loop_param_jacobian(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ["auto", *sorted(runs)]:
            assert_exact(param_jacobian(model, x, method=method), want)


def test_a_gradient_without_its_graph_is_followed_as_an_op_without_a_rule():
    """``create_graph=False`` gives a constant, followed as the output of an op without a
    data-flow rule (mixed where its inputs are: the inner losses' sum), so the rules
    refuse by name, and the whole-model methods answer exactly."""

    class Detached(InnerStep):
        def forward(self, x: Tensor) -> Tensor:
            fast = self.body.weight.expand(x.shape[0], E, E)
            inner = torch.tanh(torch.einsum("bi,boi->bo", x, fast) + self.body.bias)
            (g,) = torch.autograd.grad(inner.square().sum(), fast)  # (B, E, E), no graph
            fast = fast - 0.1 * g
            return self.head(torch.tanh(torch.einsum("bi,boi->bo", x, fast) + self.body.bias))

    torch.manual_seed(0)
    model, x, y = Detached(), torch.randn(B, E), torch.randint(0, E, (B,))
    want = loop_per_sample_grads(model, x, y, ce)
    routes = persample.supported(model, x, y, ce)
    assert {r.path for r in routes} == {"vmap"}, str(routes)
    with pytest.raises(REFUSALS):
        per_sample_grads(model, x, y, ce, method="rules")
    for method in ("auto", "vmap", "loop"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_exact(per_sample_grads(model, x, y, ce, method=method), want)


# ---------------------------------------------------------------------------
# Tensor.unfold (PatchTST) and index_select (AdaptiveLogSoftmaxWithLoss)


class Patches(nn.Module):
    """PatchTST's embedding: each channel's series cut into ``N`` patches of ``size``
    every ``step`` (``x.unfold(dimension=-1, ...)``, ``(B, C, N, size)``), each patch
    projected by a Linear over the channels' rows ``(B*C, N, size)``, then a head."""

    def __init__(self, size: int, step: int, channels: int = E, patches: int = E):
        super().__init__()
        self.size, self.step = size, step
        self.proj = nn.Linear(size, E)
        self.head = nn.Linear(channels * patches * E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, L)
        b, c, _ = x.shape
        p = x.unfold(dimension=-1, size=self.size, step=self.step)  # (B, C, N, size)
        h = torch.relu(self.proj(p.reshape(b * c, p.shape[2], self.size)))  # (B*C, N, E)
        return self.head(h.reshape(b, -1))  # (B, 3)


@pytest.mark.parametrize("size,step", [(4, 4), (4, 2)])
def test_unfold_by_keyword_on_the_rules(size, step):
    torch.manual_seed(0)
    model = Patches(size, step)
    x = torch.randn(B, E, (E - 1) * step + size)  # B = channels = patches
    y = torch.randint(0, 3, (B,))
    check(model, x, y, ce, methods=METHODS, jacobian=True, paths={"rule"})


def test_unfold_of_the_batch_dim_is_refused_by_name():
    class Windows(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 1)

        def forward(self, x):
            return self.fc(x.unfold(dimension=0, size=2, step=1)).sum((0, 2))

    torch.manual_seed(0)
    model, x = Windows(), torch.randn(B, E)
    with pytest.raises(persample.NeedsWholeModel, match="unfold of the batch dim"):
        per_sample_grads(model, x, torch.randn(E), lambda o, y: (o - y) ** 2,
                         method="rules")


def test_index_select_by_a_0_dim_index_keeps_its_dim_on_the_rules():
    """``index_select`` by a 0-dim index gives a dim of size 1, as the ``(1,)`` index
    does: one feature of every sample's rows (torch.func's Jacobian of it fails in this
    torch version: not checked)."""

    class OneFeature(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(E, E)
            self.register_buffer("k", torch.tensor(2))

        def forward(self, x: Tensor) -> Tensor:  # (B, E, E)
            return torch.tanh(self.fc(x)).index_select(1, self.k).squeeze(1)  # (B, E)

    torch.manual_seed(0)
    model, x, y = OneFeature(), torch.randn(B, E, E), torch.randn(B, E)
    check(model, x, y, squared_error, methods=["rules", "auto", "loop"], jacobian=True,
          paths={"rule"})


def adaptive(**options) -> nn.AdaptiveLogSoftmaxWithLoss:
    return nn.AdaptiveLogSoftmaxWithLoss(E, 12, [4, 8], div_value=2.0, **options)


class LogProbs(nn.Module):
    """An adaptive softmax's ``log_prob`` over all 12 classes, ``(B, 12)``."""

    def __init__(self):
        super().__init__()
        self.inp, self.asm = nn.Linear(E, E), adaptive(head_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.asm.log_prob(torch.tanh(self.inp(x)))


class TargetLogProb(nn.Module):
    """The adaptive softmax called with the targets: each sample's log-probability of its
    target (``.output``, ``(B,)``) and their batch mean (``.loss``); each tail cluster's
    rows taken by ``index_select``."""

    def __init__(self):
        super().__init__()
        self.inp, self.asm = nn.Linear(E, E), adaptive()

    def forward(self, x: Tensor, target: Tensor):
        return self.asm(torch.tanh(self.inp(x)), target)


def nll(out: Tensor, y: Tensor) -> Tensor:
    return F.nll_loss(out, y, reduction="none")


def test_adaptive_log_prob_on_the_rules():
    torch.manual_seed(0)
    model, x = LogProbs(), torch.randn(B, E)
    y = torch.tensor([0, 5, 9, 11])
    check(model, x, y, nll, methods=METHODS, jacobian=True, paths={"rule"})


def own_log_prob(out, _targets) -> Tensor:
    return -out.output  # (B,)


@pytest.mark.parametrize("target", [[0, 5, 6, 1], [4, 5, 9, 10], [0, 1, 2, 3]],
                         ids=["one-tail", "both-tails", "head-only"])
def test_adaptive_softmax_with_targets_on_the_rules(target):
    """Every tail cluster with none or several samples: the rows it takes are a batch."""
    torch.manual_seed(0)
    model = TargetLogProb()
    inputs = ((torch.randn(B, E), torch.tensor(target)), {})
    check(model, inputs, None, own_log_prob, methods=["rules", "auto", "loop"], paths=None,
          paths_within={"rule", "unused"})  # (unused: a cluster no target is in; torch.func
    # cannot batch the nonzero that finds a cluster's rows)


def test_adaptive_softmax_with_one_sample_in_a_cluster_is_refused_by_name():
    """One sample in a cluster: its rows' index is squeezed to 0-dim, one sample's position
    without a batch dim; the rules refuse by name and ``auto`` answers exactly."""
    torch.manual_seed(0)
    model = TargetLogProb()
    inputs = ((torch.randn(B, E), torch.tensor([5, 6, 7, 9])), {})
    want = loop_per_sample_grads(model, inputs, None, own_log_prob)
    with pytest.raises(persample.NeedsWholeModel, match="removes the batch dim"):
        per_sample_grads(model, inputs, None, own_log_prob, method="rules")
    routes = persample.supported(model, inputs, None, own_log_prob)
    assert {r.path for r in routes} == {"vmap"}, str(routes)
    with pytest.warns(UserWarning, match="removes the batch dim"):
        assert_exact(per_sample_grads(model, inputs, None, own_log_prob), want)


def test_adaptive_softmax_batch_mean_loss_is_refused_by_name():
    """``.loss`` is the batch's mean (one sample's own loss in the loop): the rules refuse
    it as a loss that mixes the samples, ``auto`` answers exactly."""
    torch.manual_seed(0)
    model = TargetLogProb()
    inputs = ((torch.randn(B, E), torch.tensor([0, 5, 6, 1])), {})
    loss = lambda out, _: out.loss  # noqa: E731
    want = loop_per_sample_grads(model, inputs, None, loss)
    with pytest.raises(persample.LossNotPerSampleError, match="output.loss"):
        per_sample_grads(model, inputs, None, loss, method="rules")
    with pytest.warns(UserWarning, match="rules cannot split"):
        assert_exact(per_sample_grads(model, inputs, None, loss), want)
