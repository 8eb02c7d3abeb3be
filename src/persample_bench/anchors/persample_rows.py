"""persample's own rows, each called as its users call it: the default call (the
headline row, ``ours=True``), and where the table has them ``flat=True`` and
``out=`` (the same call with the result in another layout); beside them, the
forward under persample's capture, timed against the plain forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from persample.api import param_jacobian, per_sample_grads
from persample.graphs import graphed

from ..workloads import DP_MAX_GRAD_NORM, Workload
from .case import Method, scalar_loss


def grads_rows(w: Workload) -> list[Method]:
    """``per_sample_grads``: ``"persample"`` (a dict), and where the workload has
    ``layout_rows``, ``"persample (flat=True)"`` and ``"persample (out=)"`` (into the
    caller's buffer); on a GPU also ``"persample (graphed)"``, the same call replayed
    from a CUDA graph by :func:`persample.graphed` (its first call warms up and
    captures; a model that cannot be captured is a failed row that says why).

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> [m.name for m in grads_rows(grads_workload("cnn-grads", 2))]
        ['persample', 'persample (flat=True)', 'persample (out=)']
    """
    model = w.model
    rows = [Method("persample", lambda _: per_sample_grads(model, w.inputs, w.targets,
                                                           w.loss_fn), ours=True)]
    if w.layout_rows:
        rows += [
            Method("persample (flat=True)", lambda _: per_sample_grads(
                model, w.inputs, w.targets, w.loss_fn, flat=True)),
            Method("persample (out=)", lambda buf: per_sample_grads(
                model, w.inputs, w.targets, w.loss_fn, out=buf)),
        ]
    if w.device.type == "cuda":
        step = graphed(per_sample_grads, model, loss_fn=w.loss_fn)
        rows.append(Method("persample (graphed)", lambda _: step(w.inputs, w.targets)))
    return rows


def capture_overhead(w: Workload) -> list[tuple[str, Callable[[], object]]]:
    """The plain forward (autograd on) and the same forward as persample's calls run it
    (:func:`persample.engine.captured_forward`: under the capture, the data-flow rule of
    every op and the module calls, with the tape the calls before it left; a model of
    torch's own layers unintercepted once a call left its template), timed beside the
    methods.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> [label for label, _ in capture_overhead(grads_workload("cnn-grads", 2))]
        ['plain forward', 'forward under capture']
    """
    from persample.engine import captured_forward
    from persample.inputs import as_batch

    batch = as_batch(w.inputs)
    watched = {id(p): p for p in w.model.parameters() if p.requires_grad}

    def plain() -> object:
        with torch.enable_grad():
            return w.call()

    def captured() -> object:  # (the steady state: the persample rows' calls came first)
        return captured_forward(w.model, batch, watched)[1]

    return [("plain forward", plain), ("forward under capture", captured)]


NEW_BATCH_PLAIN = "plain step, a new batch at each call"
NEW_BATCH_OURS = "persample, a new batch at each call"


def new_batches(w: Workload) -> list[tuple[str, Callable[[], object]]]:
    """Where the workload has :attr:`~persample_bench.workloads.Workload.other_batches`
    (batches whose shapes differ, as an epoch of graph batches has them), the plain step
    and persample's default call, each taking the next of them at every call, timed
    beside the methods: what a training loop pays, where every other row times the same
    batch again. ``[]`` where it has none.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> new_batches(grads_workload("cnn-grads", 2))
        []
    """
    if not w.other_batches:
        return []
    turn = {NEW_BATCH_PLAIN: 0, NEW_BATCH_OURS: 0}

    def next_batch(label: str) -> tuple:
        k = turn[label]
        turn[label] = k + 1
        return w.other_batches[k % len(w.other_batches)]

    def plain() -> None:
        inputs, targets = next_batch(NEW_BATCH_PLAIN)
        for p in w.model.parameters():
            p.grad = None
        scalar_loss(w.loss_fn(w.call(inputs=inputs), targets)).backward()

    def ours() -> object:
        inputs, targets = next_batch(NEW_BATCH_OURS)
        return per_sample_grads(w.model, inputs, targets, w.loss_fn)

    return [(NEW_BATCH_PLAIN, plain), (NEW_BATCH_OURS, ours)]

class _Counting(TorchFunctionMode):
    """Counts the calls a ``TorchFunctionMode`` sees (the ops persample's capture sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def forward_ops(w: Workload) -> int:
    """The ops one forward of ``w``'s model runs (autograd on), as a
    ``TorchFunctionMode`` sees them: what a per-op fixed cost is paid for.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> forward_ops(grads_workload("gnn-mlp-grads", 2))
        5
    """
    with torch.enable_grad(), _Counting() as counting:
        w.call()
    return counting.ops


def noise_draws(w: Workload) -> list[tuple[str, Callable[[], object]]]:
    """Drawing the ``P`` Gaussian numbers of one DP step: persample's counter-based
    stream (:func:`persample.dp.noise.gaussian_like`, on torch's threads), the same from
    the operating system's secure generator (``secure_mode``), ``torch``'s ``normal_``
    into a buffer (one thread on the CPU), and on the CPU numpy's
    ``Generator.standard_normal`` (float32, into a buffer); timed beside the methods.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> [label for label, _ in noise_draws(dp_workload("cnn-dp-step", 2))]  # doctest: +NORMALIZE_WHITESPACE
        ['noise: persample', 'noise: persample secure_mode', 'noise: torch normal_',
         'noise: numpy standard_normal']
    """  # noqa: E501
    from persample.dp.noise import SecureSource, gaussian_like

    params = [p for p in w.model.parameters() if p.requires_grad]
    first = params[0]
    buf = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
    gen = torch.Generator(device=first.device).manual_seed(0)
    rows = [("noise: persample", lambda: gaussian_like(params, 1.0, gen)),
            ("noise: persample secure_mode", lambda: gaussian_like(params, 1.0,
                                                                   SecureSource())),
            ("noise: torch normal_", lambda: buf.normal_(generator=gen))]
    if first.device.type == "cpu":
        import numpy as np

        rng, out = np.random.default_rng(0), np.empty(buf.numel(), dtype=np.float32)
        rows.append(("noise: numpy standard_normal",
                     lambda: rng.standard_normal(out.size, dtype=np.float32, out=out)))
    return rows


def param_jacobian_rows(w: Workload) -> list[Method]:
    """``param_jacobian``: the default call (a dict ``{name: (B, Y, *shape)}``),
    ``flat=True`` and ``out=``.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> rows = param_jacobian_rows(jacobian_workload("mlp-param-jac", 2))
        >>> rows[1].fn(None).shape
        torch.Size([2, 10, 15910])
    """
    model, x = w.model, w.inputs
    return [Method("persample", lambda _: param_jacobian(model, x), ours=True),
            Method("persample (flat=True)", lambda _: param_jacobian(model, x, flat=True)),
            Method("persample (out=)", lambda buf: param_jacobian(model, x, out=buf))]


def input_jacobian_row(w: Workload) -> Method:
    """``input_jacobian``: ``(B, Y, D)``.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> input_jacobian_row(jacobian_workload("pinn-input-jac", 2)).fn(None).shape
        torch.Size([2, 400, 1])
    """
    from persample.jacobian import input_jacobian

    return Method("persample", lambda _: input_jacobian(w.model, w.inputs), ours=True)


def norms_row(w: Workload) -> Method:
    """``per_sample_grad_norms``: ``(B,)``, with no ``(B, P)`` gradients formed.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> norms_row(dp_workload("cnn-norms", 2)).fn(None).shape
        torch.Size([2])
    """
    from persample.norms import per_sample_grad_norms

    return Method("persample", lambda _: per_sample_grad_norms(
        w.model, w.inputs, w.targets, w.loss_fn), ours=True)


def dots_row(w: Workload) -> Method:
    """``per_sample_grad_dots``: the ``(B, B)`` Gram matrix, with no gradient formed
    where a rule has factors.

    Examples:
        >>> from persample_bench.workloads import attribution_workload
        >>> dots_row(attribution_workload("deep-mlp-gram", 2)).fn(None).shape
        torch.Size([2, 2])
    """
    from persample.dots import per_sample_grad_dots

    return Method("persample", lambda _: per_sample_grad_dots(
        w.model, w.inputs, w.targets, w.loss_fn), ours=True)


def projector_row(w: Workload, proj) -> Method:
    """The :class:`persample.GradientProjector` ``proj`` called on the batch: ``(B, dim)``.

    Examples:
        >>> from persample import GradientProjector
        >>> from persample_bench.workloads import attribution_workload
        >>> w = attribution_workload("deep-mlp-project", 2)
        >>> projector_row(w, GradientProjector(w.model, 64, seed=0)).fn(None).shape
        torch.Size([2, 64])
    """
    return Method("persample", lambda _: proj(w.inputs, w.targets, w.loss_fn), ours=True)


def dp_step_row(w: Workload, noise: dict) -> Method:
    """One DP-SGD step by ``dp.private_grad`` on a copy of the model, then an SGD step
    (``lr = 0``); returns the noised gradients ``{name: p.grad}``. ``noise["sigma"]`` is
    read at each call.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> row = dp_step_row(dp_workload("deep-mlp-dp-step", 2), {"sigma": 0.0})
        >>> row.name, row.ours, len(row.fn(None))
        ('persample', True, 102)
    """
    from persample.dp import private_grad

    own = copy.deepcopy(w.model)
    own_opt = torch.optim.SGD(own.parameters(), lr=0.0)

    def persample_step(_: Tensor | None) -> dict[str, Tensor]:
        own_opt.zero_grad(set_to_none=True)  # as the plain step does
        private_grad(own, w.inputs, w.targets, w.loss_fn, max_grad_norm=DP_MAX_GRAD_NORM,
                     noise_multiplier=noise["sigma"])
        own_opt.step()
        return {k: p.grad for k, p in own.named_parameters() if p.requires_grad}

    return Method("persample", persample_step, ours=True)


MECHANISM_ROWS = {"persample BandMF (4 bands)": ("bandmf", 4),
                  "persample BLT (3 buffers)": ("blt", 3)}
"""The correlated-noise rows of a DP step: name -> (mechanism, bands or buffers)."""


def correlated_step_row(w: Workload, noise: dict, name: str) -> Method:
    """The same DP step with correlated noise (:data:`MECHANISM_ROWS`: BandMF with 4
    bands, BLT with 3 buffers, each made for 10,000 releases) through ``PrivateStep``
    (``accumulate`` then ``release``, as a loop over micro-batches runs it, one here),
    then an SGD step (``lr = 0``); returns the noised gradients ``{name: p.grad}``. The
    step is made again when ``noise["sigma"]`` changes (its noise multiplier is fixed).

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> row = correlated_step_row(dp_workload("deep-mlp-dp-step", 2), {"sigma": 0.0},
        ...                           "persample BandMF (4 bands)")
        >>> row.name, row.ours, len(row.fn(None))
        ('persample BandMF (4 bands)', True, 102)
    """
    from persample.dp import BLT, BandMF, PrivateStep

    kind, size = MECHANISM_ROWS[name]
    own = copy.deepcopy(w.model)
    own_opt = torch.optim.SGD(own.parameters(), lr=0.0)
    mech = BandMF(10_000, size) if kind == "bandmf" else BLT(10_000, size)  # (made once)
    made: dict = {}

    def step_of(sigma: float) -> PrivateStep:
        if made.get("sigma") != sigma:
            made.update(sigma=sigma, step=PrivateStep(
                own, w.loss_fn, max_grad_norm=DP_MAX_GRAD_NORM, noise_multiplier=sigma,
                expected_batch_size=len(w.targets), mechanism=mech))
        return made["step"]

    def correlated_step(_: Tensor | None) -> dict[str, Tensor]:
        step = step_of(noise["sigma"])
        own_opt.zero_grad(set_to_none=True)
        step.accumulate(w.inputs, w.targets)
        step.release()
        own_opt.step()
        return {k: p.grad for k, p in own.named_parameters() if p.requires_grad}

    return Method(name, correlated_step, ours=True)


def privacy_engine_row(w: Workload, noise: dict) -> Method:
    """The same DP-SGD step as an Opacus script runs it through persample's
    ``PrivacyEngine`` (``loss.backward(); optimizer.step()``, hooks mode: the forward
    and backward as they are, then persample's step on the kept batch); returns the
    noised gradients ``{name: p.grad}``. The engine is made again when
    ``noise["sigma"]`` changes (its optimizer fixes sigma, as Opacus's does).

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> row = privacy_engine_row(dp_workload("deep-mlp-dp-step", 2), {"sigma": 0.0})
        >>> row.name, row.ours, len(row.fn(None))
        ('persample PrivacyEngine (Opacus loop)', False, 102)
    """
    from torch.utils.data import DataLoader

    from persample.dp import PrivacyEngine

    own = copy.deepcopy(w.model)
    state: dict = {}

    def engine_step(_: Tensor | None) -> dict[str, Tensor]:
        if state.get("sigma") != noise["sigma"]:
            model, opt, _ = PrivacyEngine().make_private(
                module=own, optimizer=torch.optim.SGD(own.parameters(), lr=0.0),
                data_loader=DataLoader(range(w.n), batch_size=w.n),  # q = 1: B expected
                noise_multiplier=noise["sigma"], max_grad_norm=DP_MAX_GRAD_NORM)
            state.update(sigma=noise["sigma"], model=model, opt=opt)
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.call(state["model"]), w.targets)).backward()
        opt.step()
        return {k: p.grad for k, p in own.named_parameters() if p.requires_grad}

    return Method("persample PrivacyEngine (Opacus loop)", engine_step)
