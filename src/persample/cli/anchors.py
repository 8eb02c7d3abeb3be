"""The methods ``persample bench`` compares, per workload, as :class:`Case` objects.

Each method is a function ``(buf) -> Tensor`` returning the workload's result
(per-sample gradients ``(B, P)``, a parameter Jacobian ``(B, Y, P)`` or an input
Jacobian ``(B, Y, D)``); ``buf`` is a preallocated, already touched tensor of
the result's shape that persample's ``out=`` writes into and the others ignore.
A method that cannot run here has ``fn=None`` and a note saying why.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacfwd, jacrev, vmap

from ..api import param_jacobian, per_sample_grads
from ..inputs import as_batch
from ..reference import loop_param_jacobian, loop_per_sample_grads
from ..vmap import vmap_per_sample_grads
from .workloads import Workload

MEMORY_LIMIT_BYTES = 8e9  # a method estimated to need more is skipped with a note


@dataclass
class Method:
    name: str
    fn: Callable[[Tensor], Tensor] | None
    note: str = ""
    ours: bool = False


@dataclass
class Case:
    workload: Workload
    base_label: str  # what t_plain is: "plain backward" or "one backward"
    base: Callable[[], object]
    result_shape: tuple[int, ...]
    reference_label: str
    reference: Callable[[], Tensor]
    methods: list[Method] = field(default_factory=list)
    after_check: Callable[[], None] = lambda: None  # run once every result is checked


def flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in grads], dim=1)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- per-sample gradients (cnn-grads, deep-mlp-grads) -------------------------------------


def grads_case(w: Workload) -> Case:
    n, model = w.inputs.shape[0], w.model

    def plain() -> None:
        for p in model.parameters():
            p.grad = None
        w.loss_fn(model(w.inputs), w.targets).backward()

    def loop(_: Tensor) -> Tensor:
        return flat(list(loop_per_sample_grads(model, w.inputs, w.targets, w.loss_fn).values()))

    def torch_func(_: Tensor) -> Tensor:
        params = dict(model.named_parameters())
        grads = vmap_per_sample_grads(model, as_batch(w.inputs), w.targets, w.loss_fn, params)
        return flat(list(grads.values()))

    return Case(w, "plain backward", plain, (n, num_params(model)), "loop", lambda: loop(None), [
        Method("loop", loop),
        Method("torch.func vmap", torch_func),
        opacus(w),
        backpack(w),
        Method("persample (out=)", lambda buf: per_sample_grads(
            model, w.inputs, w.targets, w.loss_fn, out=buf), ours=True),
        Method("persample (new tensor)", lambda _: per_sample_grads(
            model, w.inputs, w.targets, w.loss_fn, flat=True)),
    ])


def opacus(w: Workload) -> Method:
    """Opacus ``GradSampleModule`` (hooks mode): ``p.grad_sample`` after one backward."""
    try:
        from opacus import GradSampleModule
    except ImportError:
        return Method("Opacus hooks", None, "not installed (pip install -e '.[bench]')")
    # Opacus records activations only in training mode; the workloads have no
    # dropout or BatchNorm, so train() computes the same function.
    model = GradSampleModule(copy.deepcopy(w.model).train(), loss_reduction="mean")

    def run(_: Tensor) -> Tensor:
        model.zero_grad(set_to_none=True)
        w.loss_fn(model(w.inputs), w.targets).backward()
        return flat([p.grad_sample for p in model.parameters()])

    return Method("Opacus hooks", run)


def backpack(w: Workload) -> Method:
    """BackPACK ``BatchGrad``: ``p.grad_batch`` (of the mean loss's terms, times B)."""
    try:
        from backpack import backpack as context
        from backpack import extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return Method("BackPACK BatchGrad", None,
                      "not installed (pip install --no-deps backpack-for-pytorch)")
    model = extend(copy.deepcopy(w.model))
    loss_fn = extend(nn.CrossEntropyLoss())
    n = w.inputs.shape[0]

    def run(_: Tensor) -> Tensor:
        model.zero_grad(set_to_none=True)
        with context(BatchGrad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # full backward hooks on modules without input grads
            loss_fn(model(w.inputs), w.targets).backward()
        return flat([p.grad_batch for p in model.parameters()]).mul_(n)

    return Method("BackPACK BatchGrad", run)


# --- per-sample parameter Jacobian (mlp-param-jac) ----------------------------------------


def param_jacobian_case(w: Workload) -> Case:
    model, x = w.model, w.inputs
    n, y, p = x.shape[0], model(x[:1]).shape[1:].numel(), num_params(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one_backward() -> None:
        for q in model.parameters():
            q.grad = None
        model(x).sum().backward()

    def seed_loop(_: Tensor) -> Tensor:  # seed 000's calculate_gradients
        jac = loop_param_jacobian(model, x)
        return torch.cat([t.flatten(2) for t in jac.values()], dim=2)

    def sample_output(th: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, th, (xi.unsqueeze(0),))[0]

    def transform(jac_fn) -> Callable[[Tensor], Tensor]:
        def run(_: Tensor) -> Tensor:  # seed 000's answer
            jac = vmap(jac_fn(sample_output), in_dims=(None, 0))(params, x)
            return torch.cat([t.flatten(2) for t in jac.values()], dim=2)

        return run

    # jacfwd pushes P one-hot tangents; under vmap over the batch its largest
    # intermediate is about (B, P, largest parameter) numbers.
    need = n * p * max(q.numel() for q in params.values()) * x.element_size()
    fwd = (Method("vmap(jacfwd)", transform(jacfwd)) if need <= MEMORY_LIMIT_BYTES else
           Method("vmap(jacfwd)", None, f"skipped: would need about {need / 1e9:,.0f} GB"))
    return Case(w, "one backward", one_backward, (n, y, p), "seed 000 loop",
                lambda: seed_loop(None), [
        Method("seed 000 loop", seed_loop),
        Method("vmap(jacrev)", transform(jacrev)),
        fwd,
        Method("persample (out=)", lambda buf: param_jacobian(model, x, out=buf), ours=True),
        Method("persample (new tensor)", lambda _: param_jacobian(model, x, flat=True)),
    ])


# --- batched input Jacobian (pinn-input-jac, clf-input-jac) --------------------------------


def input_jacobian_case(w: Workload) -> Case:
    from ..jacobian import input_jacobian

    model, x = w.model, w.inputs
    n, d, y = x.shape[0], x.shape[1], model(x[:1]).shape[1]

    def one_backward() -> None:
        xg = x.detach().requires_grad_()
        torch.autograd.grad(model(xg).sum(), xg)

    def sample_fn(xi: Tensor) -> Tensor:
        return model(xi.unsqueeze(0))[0]

    def seed_002(_: Tensor) -> Tensor:  # the full (B, Y, B, D) Jacobian, then its diagonal blocks
        full = torch.autograd.functional.jacobian(model, x)  # (B, Y, B, D)
        return torch.diagonal(full, dim1=0, dim2=2).permute(2, 0, 1)

    def seed_003(_: Tensor) -> Tensor:  # a loop over the classes
        xg = x.detach().requires_grad_()
        out = model(xg)
        rows = [torch.autograd.grad(out[:, k], xg, torch.ones(n), retain_graph=True)[0]
                for k in range(y)]
        return torch.stack(rows, dim=1)

    seed_fn = seed_002 if w.seed == "002" else seed_003
    seed_label = f"seed {w.seed}'s code"
    return Case(w, "one backward", one_backward, (n, y, d), seed_label, lambda: seed_fn(None), [
        Method(seed_label, seed_fn),
        Method("vmap(jacrev)", lambda _: vmap(jacrev(sample_fn))(x)),
        Method("vmap(jacfwd)", lambda _: vmap(jacfwd(sample_fn))(x)),
        Method("persample", lambda _: input_jacobian(model, x), ours=True),
    ])


# --- per-sample gradient norms and one DP-SGD step (cnn-norms, cnn-dp-step) ---------------

DP_MAX_GRAD_NORM = 1.0


def norms_case(w: Workload) -> Case:
    from ..norms import per_sample_grad_norms

    grads = grads_case(w)  # the plain backward and the per-sample gradient methods
    by_name = {m.name: m for m in grads.methods}

    def norm_of(method: Method) -> Method:
        if method.fn is None:
            return method
        return Method(method.name, lambda buf: method.fn(None).norm(dim=1))

    def opacus_ghost(_: Tensor) -> Tensor:
        return _opacus_ghost_step(w)(None, norms=True)

    def backpack_l2(_: Tensor) -> Tensor:
        return _backpack_l2(w)()

    return Case(w, "plain backward", grads.base, (w.inputs.shape[0],), "loop",
                lambda: by_name["loop"].fn(None).norm(dim=1), [
        norm_of(by_name["loop"]),
        norm_of(by_name["torch.func vmap"]),
        norm_of(by_name["Opacus hooks"]),
        _optional(opacus_ghost, "Opacus ghost clipping", "opacus"),
        _optional(backpack_l2, "BackPACK BatchL2Grad", "backpack"),
        Method("persample", lambda _: per_sample_grad_norms(
            w.model, w.inputs, w.targets, w.loss_fn), ours=True),
    ])


def _optional(fn, name: str, module: str) -> Method:
    try:
        __import__(module)
    except ImportError:
        return Method(name, None, "not installed")
    return Method(name, fn)


def _backpack_l2(w: Workload):
    from backpack import backpack as context
    from backpack import extend
    from backpack.extensions import BatchL2Grad

    model, loss_fn, n = extend(copy.deepcopy(w.model)), extend(nn.CrossEntropyLoss()), len(w.inputs)

    def run() -> Tensor:
        model.zero_grad(set_to_none=True)
        with context(BatchL2Grad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(model(w.inputs), w.targets).backward()
        return sum(p.batch_l2 for p in model.parameters()).sqrt() * n  # of the mean's terms

    return run


def dp_step_case(w: Workload) -> Case:
    """One DP-SGD step (clip, sum, noise, SGD step); results are the noised ``p.grad``."""
    from ..dp import private_grad

    n, model = w.inputs.shape[0], w.model
    noise = {"sigma": 0.0}  # 0 while results are checked, then 1.0 for the timed rounds
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        w.loss_fn(plain_model(w.inputs), w.targets).backward()
        plain_opt.step()

    def clipped_mean(per_sample: Tensor) -> Tensor:  # (B, P) -> (P,)
        c = (DP_MAX_GRAD_NORM / (per_sample.norm(dim=1) + 1e-6)).clamp(max=1.0)
        total = c @ per_sample
        noise_ = torch.randn(total.shape) * (noise["sigma"] * DP_MAX_GRAD_NORM)
        return (total + noise_) / n

    def manual(per_sample_fn) -> Callable[[Tensor], Tensor]:
        return lambda _: clipped_mean(per_sample_fn(None))

    own = copy.deepcopy(model)
    own_opt = torch.optim.SGD(own.parameters(), lr=0.0)

    def persample_step(_: Tensor) -> Tensor:
        private_grad(own, w.inputs, w.targets, w.loss_fn, max_grad_norm=DP_MAX_GRAD_NORM,
                     noise_multiplier=noise["sigma"])
        own_opt.step()
        return flat_grad(own)

    grads = {m.name: m for m in grads_case(w).methods}
    case = Case(w, "plain SGD step", plain_step, (num_params(model),), "loop + clipping",
                lambda: manual(grads["loop"].fn)(None), [
        Method("loop + clipping", manual(grads["loop"].fn)),
        Method("torch.func vmap + clipping", manual(grads["torch.func vmap"].fn)),
        _opacus_dp_method(w, noise, ghost=False),
        _opacus_dp_method(w, noise, ghost=True),
        Method("persample", persample_step, ours=True),
    ])
    case.after_check = lambda: noise.update(sigma=1.0)
    return case


def flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _opacus_dp_method(w: Workload, noise: dict, ghost: bool) -> Method:
    name = "Opacus ghost clipping" if ghost else "Opacus hooks"
    try:
        import opacus  # noqa: F401
    except ImportError:
        return Method(name, None, "not installed (pip install -e '.[bench]')")
    step = _opacus_ghost_step(w, noise) if ghost else _opacus_hooks_step(w, noise)
    return Method(name, lambda _: step(None))


def _opacus_hooks_step(w: Workload, noise: dict):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(copy.deepcopy(w.model).train())
    state = {}

    def run(_: Tensor | None) -> Tensor:
        if state.get("sigma") != noise["sigma"]:  # Opacus fixes sigma at construction
            state["opt"] = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       noise_multiplier=noise["sigma"],
                                       max_grad_norm=DP_MAX_GRAD_NORM,
                                       expected_batch_size=len(w.inputs))
            state["sigma"] = noise["sigma"]
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        w.loss_fn(model(w.inputs), w.targets).backward()
        opt.step()
        return flat_grad(model)

    return run


def _opacus_ghost_step(w: Workload, noise: dict | None = None):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    noise = noise if noise is not None else {"sigma": 0.0}
    model = GradSampleModuleFastGradientClipping(
        copy.deepcopy(w.model).train(), max_grad_norm=DP_MAX_GRAD_NORM, use_ghost_clipping=True)
    state = {}

    def run(_: Tensor | None, norms: bool = False) -> Tensor:
        if state.get("sigma") != noise["sigma"]:
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=noise["sigma"],
                max_grad_norm=DP_MAX_GRAD_NORM, expected_batch_size=len(w.inputs))
            state.update(sigma=noise["sigma"], opt=opt, loss=DPLossFastGradientClipping(
                model, opt, nn.CrossEntropyLoss(), "mean"))
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        loss = state["loss"](model(w.inputs), w.targets)
        if norms:  # the first of Opacus's two backwards gives the norms
            torch.mean(loss.loss_per_sample).backward()
            return model.get_norm_sample()
        loss.backward()
        opt.step()
        return flat_grad(model)

    return run
