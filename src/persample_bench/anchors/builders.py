"""The case of each kind of workload: its baseline, its floor, its reference and its
rows, in the table's order, from the competitors' modules.

Per-sample gradients (:func:`grads_case`), the per-sample parameter Jacobian
(:func:`param_jacobian_case`), the batched input Jacobian
(:func:`input_jacobian_case`), per-sample gradient norms (:func:`norms_case`), one
DP-SGD step (:func:`dp_step_case`), and the attribution workloads: the Gram matrix
of the per-sample gradients (:func:`gram_case`) and their projection
(:func:`project_case`). A builder given ``only`` (a memory probe of one row)
builds that row alone, with no estimate, no other model copy, no other library
imported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ..workloads import PROJECTED_DIM, Workload
from . import backpack_rows, loop_rows, opacus_rows, persample_rows, torch_func_rows
from .case import Case, Method, num_params, scalar_loss
from .clipping import clipped_step, grad_norms
from .memory import MemoryEstimate, reference_fits, unless_too_big

BACKPROPS_FLOOR = "forward + backprops"


def _built(name: str, only: str | None, build: Callable[[], Method]) -> Method:
    """``build()``, unless ``only`` names another row: a memory probe builds only the row
    it measures (no other model copies, no other library imported).

    Examples:
        >>> _built("loop", "persample", lambda: Method("loop", None)).note
        "not built: only 'persample' was asked for"
    """
    if only is None or only == name:
        return build()
    return Method(name, None, f"not built: only {only!r} was asked for")


def _plain_backward(w: Workload) -> Callable[[], None]:
    """The baseline of the gradients cases: a plain backward of the mean loss."""
    def plain() -> None:
        for p in w.model.parameters():
            p.grad = None
        scalar_loss(w.loss_fn(w.call(), w.targets)).backward()
    return plain


# --- per-sample gradients (cnn-grads, deep-mlp-grads, resnet18-grads, gpt2-grads, ...) ------


def grads_case(w: Workload, only: str | None = None) -> Case:
    """The per-sample gradients rows: loop (the reference), ``torch.func``, Opacus, BackPACK,
    persample's default call (a dict), ``flat=True`` and ``out=`` (where the workload
    has ``layout_rows``). Result ``(B, P)``,
    ``P`` the trainable parameters' entries; the baseline is a plain backward of the
    mean loss. A competitor whose :class:`~persample_bench.anchors.memory.MemoryEstimate`
    is over the memory limit is skipped with a note. ``only``: build that row only (and
    estimate nothing), for a memory probe of a row that ran.

    Raises:
        MemoryError: the loop, the reference, would need over the limit.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> case = grads_case(grads_workload("cnn-grads", 2))
        >>> case.result_shape, [m.name for m in case.methods][-3:]
        ((2, 1199882), ['persample', 'persample (flat=True)', 'persample (out=)'])
    """
    estimate = reference_fits(w) if only is None else None
    loop = loop_rows.loop_grads(w)
    competitors = (("torch.func vmap", torch_func_rows.torch_func),
                   ("Opacus hooks", opacus_rows.opacus),
                   ("BackPACK BatchGrad", backpack_rows.backpack))
    case = Case(w, "plain backward", _plain_backward(w), (w.n, num_params(w.model)), "loop",
                lambda: loop.fn(None), [
        loop,
        *(_competitor(name, build, w, estimate, only) for name, build in competitors),
        *persample_rows.grads_rows(w),
    ])
    case.diagnostics = persample_rows.capture_overhead(w) + persample_rows.new_batches(w)
    case.forward_ops = persample_rows.forward_ops(w)
    return case


def _competitor(name: str, build: Callable[[Workload], Method], w: Workload,
                estimate: MemoryEstimate | None, only: str | None) -> Method:
    """``build(w)``, unless a memory probe asked for another row or ``estimate`` says it
    would not fit."""
    return _built(name, only, lambda: unless_too_big(name, estimate, lambda: build(w)))


# --- per-sample parameter Jacobian (mlp-param-jac) ----------------------------------------


def param_jacobian_case(w: Workload) -> Case:
    """The question's loop (the reference), ``vmap(jacrev)``, ``vmap(jacfwd)`` (dicts), and
    persample's ``param_jacobian`` default (a dict), ``flat=True`` and ``out=``.
    Result ``(B, Y, P)``; the baseline is one backward of ``model(x).sum()``.
    ``vmap(jacfwd)`` is skipped when it would need over the memory limit.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> param_jacobian_case(jacobian_workload("mlp-param-jac", 2)).result_shape
        (2, 10, 15910)

    Source: the question "How to efficiently calculate gradients of all outputs with
    respect to parameters?" (its ``calculate_gradients`` and the ``vmap(jacrev)`` answer).
    """
    model, x = w.model, w.inputs
    n, y, p = x.shape[0], model(x[:1]).shape[1:].numel(), num_params(model)

    def one_backward() -> None:
        for q in model.parameters():
            q.grad = None
        model(x).sum().backward()

    question = loop_rows.question_param_jacobian(w)
    return Case(w, "one backward", one_backward, (n, y, p), question.name,
                lambda: question.fn(None), [
        question, *torch_func_rows.param_jacobian_rows(w),
        *persample_rows.param_jacobian_rows(w)])


# --- batched input Jacobian (pinn-input-jac, clf-input-jac) --------------------------------


def input_jacobian_case(w: Workload) -> Case:
    """The question's own code (the reference), ``vmap(jacrev)``, ``vmap(jacfwd)`` and
    persample's ``input_jacobian``; all return ``(B, Y, D)`` tensors. For the classifier
    the floor is the one ``(B*Y, H) x (H, D)`` product every method needs
    (``H`` the first layer's width), into touched memory.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> input_jacobian_case(jacobian_workload("clf-input-jac", 2)).floor_label
        '(20, 256) x (256, 784) product'
    """
    model, x = w.model, w.inputs
    n, d, y = x.shape[0], x.shape[1], model(x[:1]).shape[1]

    def one_backward() -> None:
        xg = x.detach().requires_grad_()
        torch.autograd.grad(model(xg).sum(), xg)

    question = loop_rows.question_input_jacobian(w)
    case = Case(w, "one backward", one_backward, (n, y, d), question.name,
                lambda: question.fn(None), [
        question, *torch_func_rows.input_jacobian_rows(w), persample_rows.input_jacobian_row(w),
    ])
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if w.name == "clf-input-jac" and first is not None:
        case.floor_label, case.floor = _first_layer_product(x, y, first)
    return case


def _first_layer_product(x: Tensor, y: int, first: nn.Linear) -> tuple[str, Callable]:
    """The label and the call of the ``(B*Y, H) x (H, D)`` product of random cotangents
    with the first layer's weight, into a touched buffer."""
    n, d, h = x.shape[0], x.shape[1], first.out_features
    g = torch.Generator(device=x.device).manual_seed(0)
    cotangents = torch.randn(n * y, h, generator=g, device=x.device, dtype=x.dtype)
    product = torch.zeros(n * y, d, device=x.device, dtype=x.dtype)
    weight = first.weight.detach()
    return (f"({n * y}, {h}) x ({h}, {d}) product",
            lambda: torch.mm(cotangents, weight, out=product))


# --- per-sample gradient norms and one DP-SGD step ----------------------------------------


def _post_processed(method: Method, after: Callable[[object], Tensor],
                    name: str | None = None) -> Method:
    """``method`` followed by ``after`` on its result (renamed ``name`` if given); a row
    that cannot run stays as it is."""
    if method.fn is None:
        return method
    return Method(name or method.name, lambda buf: after(method.fn(None)), method.note)


def norms_case(w: Workload) -> Case:
    """Per-sample gradient norms ``(B,)``: each gradients method followed by
    :func:`~persample_bench.anchors.clipping.grad_norms`, Opacus ghost clipping's norms,
    BackPACK ``BatchL2Grad`` and persample's ``per_sample_grad_norms``.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> norms_case(dp_workload("cnn-norms", 2)).result_shape
        (2,)
    """
    grads = grads_case(w)  # the plain backward and the per-sample gradient methods
    by_name = {m.name: m for m in grads.methods}
    return Case(w, "plain backward", grads.base, (w.n,), "loop",
                lambda: grad_norms(by_name["loop"].fn(None)), [
        *(_post_processed(by_name[name], grad_norms)
          for name in ("loop", "torch.func vmap", "Opacus hooks")),
        opacus_rows.ghost_norms(w),
        backpack_rows.batch_l2(w),
        persample_rows.norms_row(w),
    ])


def dp_step_case(w: Workload, only: str | None = None) -> Case:
    """One DP-SGD step (clip to ``C``, sum, add noise, divide by ``B``, SGD step) on any
    gradients workload. Every row returns the noised gradients ``{name: p.grad}``
    (result ``(P,)``): the loop or ``torch.func`` followed by clipping as users write
    it (:mod:`~persample_bench.anchors.clipping`), Opacus ``DPOptimizer`` with hooks or
    ghost clipping, and persample's ``dp.private_grad``. The baseline is a plain SGD
    step. Noise is off while the results are checked, then ``sigma = 1``; ``lr = 0``, so
    that the weights stay as they are. Opacus is called with the inputs as its users
    pass them (:meth:`~persample_bench.workloads.Workload.opacus_call`), its ghost
    clipping given the loss as an ``nn.CrossEntropyLoss`` of the logits where the
    workload says how (``opacus_ce``); persample's step with correlated noise (BandMF,
    BLT) beside its own. The loop, ``torch.func`` and Opacus hooks are
    subject to the memory estimate as in :func:`grads_case`; ``only`` as there.

    Raises:
        MemoryError: the loop, the reference, would need over the memory limit.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> case = dp_step_case(dp_workload("cnn-dp-step", 2))
        >>> case.base_label, case.result_shape
        ('plain SGD step', (1199882,))

    Source: Abadi et al. 2016 (DP-SGD); Opacus's ``DPOptimizer`` for its rows.
    """
    noise = {"sigma": 0.0}  # 0 while results are checked, then 1.0 for the timed rounds
    plain_step = _plain_sgd_step(w, copy.deepcopy(w.model) if only in (None, "plain SGD step")
                                 else w.model)
    loop = loop_rows.loop_grads(w).fn
    estimate = reference_fits(w) if only is None else None

    def func_method() -> Method:
        func = unless_too_big("torch.func vmap", estimate, lambda: torch_func_rows.torch_func(w))
        return Method("torch.func vmap + clipping",
                      clipped_step(w, func.fn, noise) if func.fn else None, func.note)

    def opacus_hooks() -> Method:
        return unless_too_big("Opacus hooks", estimate,
                              lambda: opacus_rows.opacus_dp_step(w, noise, ghost=False))

    case = Case(w, "plain SGD step", plain_step, (num_params(w.model),), "loop + clipping",
                lambda: clipped_step(w, loop, noise)(None), [
        _built("loop + clipping", only,
              lambda: Method("loop + clipping", clipped_step(w, loop, noise))),
        _built("torch.func vmap + clipping", only, func_method),
        _built("Opacus hooks", only, opacus_hooks),
        _built("Opacus ghost clipping", only,
              lambda: opacus_rows.opacus_dp_step(w, noise, ghost=True)),
        _built("persample", only, lambda: persample_rows.dp_step_row(w, noise)),
        _built("persample PrivacyEngine (Opacus loop)", only,
               lambda: persample_rows.privacy_engine_row(w, noise)),
        *[_built(name, only, lambda name=name: persample_rows.correlated_step_row(w, noise, name))
          for name in persample_rows.MECHANISM_ROWS],
    ])
    case.after_check = lambda: noise.update(sigma=1.0)
    case.floor_label, case.floor = _step_and_draws(w, plain_step)
    case.diagnostics = persample_rows.noise_draws(w) if only is None else []
    return case


def _plain_sgd_step(w: Workload, model: nn.Module) -> Callable[[], None]:
    """A plain SGD step (``lr = 0``) of ``model`` (the workload's model or its copy)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.call(model), w.targets)).backward()
        opt.step()
    return plain_step


def _step_and_draws(w: Workload, plain_step: Callable[[], None]) -> tuple[str, Callable]:
    """The DP step's floor: every DP-SGD step also draws ``P`` Gaussian numbers, so the
    plain step and those draws (into a buffer made once)."""
    first = next(w.model.parameters())
    draws = torch.empty(num_params(w.model), dtype=first.dtype, device=first.device)
    return (f"plain SGD step + {draws.numel():,} normal draws",
            lambda: (plain_step(), draws.normal_()))


# --- attribution: the Gram matrix and the projections (deep-mlp-gram, gpt2-project, ...) ----


def gram_case(w: Workload, only: str | None = None) -> Case:
    """The ``(B, B)`` Gram matrix of per-sample gradients (TracIn's inner products):
    each gradients method followed by ``G @ G.T``, and persample's
    ``per_sample_grad_dots``, which forms no gradient where a rule has factors.
    ``only``: build that row's gradients method only, for a memory probe.

    Examples:
        >>> from persample_bench.workloads import attribution_workload
        >>> gram_case(attribution_workload("deep-mlp-gram", 2)).result_shape
        (2, 2)
    """
    grads = grads_case(w, _gradients_row(only))
    by_name = {m.name: m for m in grads.methods}
    return Case(w, "plain backward", grads.base, (w.n, w.n), "loop",
                lambda: grad_gram(by_name["loop"].fn(None)), floor_label=BACKPROPS_FLOOR,
                floor=backprops(w), methods=[
        *(_post_processed(by_name[name], grad_gram)
          for name in ("loop", "torch.func vmap", "Opacus hooks")),
        _post_processed(by_name["persample"], grad_gram,
                        "persample per_sample_grads, then G G^T"),
        persample_rows.dots_row(w),
    ])


def project_case(w: Workload, dim: int = PROJECTED_DIM, only: str | None = None) -> Case:
    """Per-sample gradients projected to ``dim`` numbers (``(B, dim)``, LoGra's Kronecker
    map of :class:`persample.GradientProjector`): each gradients method followed by
    ``proj.project``, and the projector itself, which forms no gradient where an op
    has factors. ``only``: build that row's gradients method only, for a memory probe.

    Examples:
        >>> from persample_bench.workloads import attribution_workload
        >>> project_case(attribution_workload("deep-mlp-project", 2), 64).result_shape
        (2, 64)
    """
    from persample.projection import GradientProjector

    grads = grads_case(w, _gradients_row(only))
    by_name = {m.name: m for m in grads.methods}
    proj = GradientProjector(w.model, dim, seed=0)
    return Case(w, "plain backward", grads.base, (w.n, proj.dim), "loop",
                lambda: proj.project(by_name["loop"].fn(None)), floor_label=BACKPROPS_FLOOR,
                floor=backprops(w), methods=[
        *(_post_processed(by_name[name], proj.project)
          for name in ("loop", "torch.func vmap", "Opacus hooks")),
        _post_processed(by_name["persample"], proj.project,
                        "persample per_sample_grads, then project"),
        persample_rows.projector_row(w, proj),
    ])


def _gradients_row(only: str | None) -> str | None:
    """The per-sample gradients row an attribution row (``only``, for a memory probe)
    is built on: the same name, or persample's for its own rows."""
    return "persample" if only is not None and only.startswith("persample") else only


def grad_gram(grads: Mapping[str, Tensor]) -> Tensor:
    """``(B, B)`` inner products of per-sample gradients ``{name: (B, ...)}``, summed
    per parameter (no concatenation).

    Examples:
        >>> grad_gram({"a": torch.ones(2, 3), "b": torch.ones(2)})
        tensor([[4., 4.],
                [4., 4.]])
    """
    return sum(g.reshape(len(g), -1) @ g.reshape(len(g), -1).T for g in grads.values())


def backprops(w: Workload) -> Callable[[], object]:
    """The forward and the backprops every per-sample method needs, and nothing else: the
    loss's gradient with respect to the output of every module that holds a trained
    parameter (``torch.autograd.grad`` with those outputs as ``inputs``, so no parameter's
    gradient is formed). What a method that never forms the gradients (the Gram, the
    projections from factors) costs at least.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> backprops(grads_workload("deep-mlp-grads", 2))() is None
        True
    """
    owners = [m for m in w.model.modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]

    def run() -> None:
        outputs: list[Tensor] = []
        keep = lambda module, args, out: outputs.extend(  # noqa: E731
            t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad)
        handles = [m.register_forward_hook(keep) for m in owners]
        try:
            loss = scalar_loss(w.loss_fn(w.call(), w.targets))
        finally:
            for h in handles:
                h.remove()
        torch.autograd.grad(loss, outputs, allow_unused=True)
    return run
