"""One DP-SGD step from one forward and one backward ("book-keeping").

Abadi et al. (2016), "Deep learning with differential privacy": clip each
sample's gradient to norm ``C``, sum, add ``N(0, sigma^2 C^2 I)``, divide by the
batch size. Done here without the ``(B, P)`` tensor (Bu et al. 2023,
"book-keeping"): the captured activations and backprops give
the per-sample norms (``persample.norms``), then the clipped sum of every layer
whose norms came from the ghost norm is that layer's ordinary weight gradient
with each sample's backprops scaled by its clip factor ``c_i`` (one local
backward of the captured graph: for Linear, the matrix product ``(c G)^T A``);
layers whose per-sample gradients were materialised for their norms are summed
with the factors directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..batch import Batched
from ..engine import Captured, loss_backprops
from ..errors import InternalError, internal
from ..methods import Taken, answer, leave_rules, slower
from ..norms import squared_norms, sum_of_squares
from ..plan import Plan
from ..precision import LOW, cast, without_autocast
from ..reference import loop_per_sample_grads
from ..rules import Decline, OpCall, spec_of
from ..rules.vjp import summed_vjp
from ..sharded import fsdp_units
from ..vmap import vmap_per_sample_grads
from .noise import gaussian_like

STABILITY = 1e-6  # c_i = min(1, C / (||g_i|| + STABILITY)), as Opacus


@checks.keeps_buffers
def private_grad(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    per_layer: bool = False,
    expected_batch_size: float | None = None,
    loss_reduction: str | None = None,
) -> Tensor:
    """Set every trainable ``p.grad`` to a differentially private gradient of the batch.

    ``p.grad = (sum_i c_i g_i + N(0, sigma^2 C^2 I)) / B'`` with ``g_i`` sample
    ``i``'s own gradient, ``c_i = min(1, C / (||g_i|| + 1e-6))``, ``C =
    max_grad_norm``, ``sigma = noise_multiplier`` and ``B' = expected_batch_size``
    (default: the batch size). Then step any ``torch.optim`` optimizer as usual.

    Args:
        model, inputs, targets, loss_fn, loss_reduction: as for
            :func:`persample.per_sample_grads`. ``p.grad`` of every trainable
            parameter is overwritten (not accumulated); nothing else changes.
        max_grad_norm: clipping norm ``C > 0``, in loss units per parameter unit.
        noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * C``.
        generator: ``torch.Generator`` (on the parameters' device) for the noise.
        per_layer: clip each parameter's per-sample gradient to
            ``C / sqrt(K)`` (``K`` trainable parameter tensors) instead of the whole
            gradient to ``C``; the sensitivity is ``C`` either way.
        expected_batch_size: the divisor ``B'``. With Poisson sampling (which the
            privacy analysis assumes) pass ``q * N`` so that the divisor does not
            depend on the data.

    A model sharded with FSDP2 (``fully_shard``): one :class:`PrivateStep` step over
    every rank's batch (each rank calls it with its own samples; the default divisor is
    the number of samples of all ranks); ``p.grad`` is a sharded ``DTensor``.

    Returns:
        ``(B,)`` per-sample gradient norms before clipping (over all parameters),
        for logging, in the parameters' dtype or float32 if that is lower (bfloat16,
        float16: norms, clip factors and sums accumulate in float32; ``p.grad`` comes
        in the parameter's dtype). Under ``torch.autocast`` the gradients are those of
        the model as autocast runs it.

    Raises:
        ValueError: ``max_grad_norm <= 0``, ``noise_multiplier < 0``, a bad
            ``expected_batch_size``, an empty batch without ``expected_batch_size``,
            and the errors of ``per_sample_grads`` (TypeError too). Where the rules
            cannot split the model by sample, or persample's own code fails on it, the
            clipped sums come from the per-sample gradients of ``torch.func`` or the
            loop, with a warning.
        FloatingPointError: a sample's gradient is not finite (NaN or Inf); the
            message lists the samples and every ``p.grad`` is left as it was, so no
            NaN reaches the weights. Drop those samples and call again.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from persample.dp import private_grad
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> norms = private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
        ...                      noise_multiplier=1.1, generator=torch.Generator().manual_seed(0))
        >>> opt.step()
        >>> norms.shape
        torch.Size([16])
    """
    _check_dp_options(max_grad_norm, noise_multiplier, expected_batch_size)
    batch, n, params = checks.validate_call(model, inputs, targets, loss_fn, "auto",
                                           loss_reduction, None)
    if n == 0 and expected_batch_size is None:
        raise ValueError(
            "the batch is empty (Poisson sampling can draw one): pass expected_batch_size "
            "(q * N) so that the noise is scaled as for every other step"
        )
    if fsdp_units(model):  # one step of PrivateStep: the sums reduced to the shards
        from .step import PrivateStep

        if expected_batch_size is None:
            expected_batch_size = _total_samples(n)
        step = PrivateStep(model, loss_fn, max_grad_norm=max_grad_norm,
                           noise_multiplier=noise_multiplier, generator=generator,
                           per_layer=per_layer, expected_batch_size=expected_batch_size)
        norms = step.accumulate(inputs, targets)
        step.release()
        return norms
    def noise(group: list[int]) -> dict[int, Tensor]:  # the new p.grad's memory, drawn once
        # the backward is done (the activations freed); float32 at least: the clipped sums
        # are added to it
        drawn = gaussian_like(list(params.values()), noise_multiplier * max_grad_norm,
                              generator, accumulate=True)
        return {id(p): t for p, t in zip(params.values(), drawn)}

    grads: dict[int, Tensor] = {}
    norms = _add_clipped_sums(model, batch, targets, loss_fn, params, max_grad_norm,
                              per_layer, noise, grads.update)
    divisor = expected_batch_size or n
    for p in params.values():  # in the parameter's dtype, as autograd gives it
        p.grad = grads[id(p)].div_(divisor).to(p.dtype)
    return norms


def _add_clipped_sums(model, batch, targets, loss_fn, params, max_grad_norm, per_layer,
                      make_into: Callable[[list[int]], dict[int, Tensor]],
                      flush: Callable[[dict[int, Tensor]], None],
                      groups: list[list[int]] | None = None,
                      checked: Callable[[Tensor], None] | None = None) -> Tensor:
    """Add ``sum_i c_i g_i`` of every parameter into memory ``make_into(ids)`` gives
    (``{id(p): tensor}``, called once the norms are known: after the backward, so that
    its memory is not held while the activations are), hand it to ``flush`` when
    complete; return the ``(n,)`` norms.

    ``groups``: lists of parameter ids summed in turn (an FSDP unit's parameters: one
    unit's sums in full at a time; default: all parameters in one). ``checked(norms)``
    raises before anything is summed (default: non-finite norms raise
    ``FloatingPointError``). One forward and backward (or, where the rules cannot split
    the model, the per-sample gradients of ``torch.func`` or the loop; not for a sharded
    model, which has no whole-model fallback); an unused parameter gets nothing added."""
    n = batch.n
    groups = groups if groups is not None else [[id(p) for p in params.values()]]
    checked = checked or _check_finite
    sharded = bool(fsdp_units(model))
    if n == 0:
        if sharded:  # the other ranks' all-gathers wait for this rank's forward and backward
            _empty_pass(model, batch, params)
        checked(next(iter(params.values())).new_zeros(0))
        for group in groups:
            flush(make_into(group))
        return next(iter(params.values())).new_zeros(0)
    watched = {id(p): p for p in params.values()}

    def by_rules() -> tuple:
        captured = loss_backprops(model, batch, targets, loss_fn, watched,
                                  retain_graph=_keeps_graph)
        with internal("the norm rules"):
            return (captured, *squared_norms(captured, params))

    def by(method: Callable) -> Callable[[], tuple]:
        def materialised() -> tuple:
            grads = method(model, batch, targets, loss_fn, params)
            mats = {id(params[name]): g.unsqueeze(1) for name, g in grads.items()}
            return None, {pid: sum_of_squares(m.flatten(1)) for pid, m in mats.items()}, \
                mats, {}, []
        return materialised

    captured, sq, mats, ghosted, by_module = answer(
        "rules" if sharded else "auto", rules=by_rules, vmap=by(vmap_per_sample_grads),
        loop=by(lambda m, b, t, f, _: loop_per_sample_grads(m, b, t, f)),
        hint=lambda: checks.dtype_note(batch, params))
    norms = torch.stack([sq[id(p)] for p in params.values()]).sum(0).sqrt()  # (n,)
    checked(norms)
    factors = _clip_factors(sq, norms, params, max_grad_norm, per_layer)  # id -> (n,)
    for group in groups:
        into = make_into(group)
        _add_group(model, batch, targets, loss_fn, params, captured, mats, ghosted, by_module,
                   factors, into, set(group), sharded)
        flush(into)
    return norms


def _add_group(model, batch, targets, loss_fn, params, captured, mats, ghosted, by_module,
               factors, into, group: set[int], sharded: bool) -> None:
    """The clipped sums of the parameters ``group`` (ids) into ``into``."""
    done, left = {pid for pid in mats if pid in group}, {}
    for pid in done:  # (n, 1, *shape) materialised
        m = mats[pid]
        into[pid].add_(torch.tensordot(factors[pid].to(m.dtype), m[:, 0], dims=1))
    try:
        with internal("the clipped sums"):
            for _call, edge, layout, normed in by_module:  # module norm rules: their backward
                for p in normed.values():
                    if id(p) in group:
                        got = _edge_backward(captured, edge, layout, [p], factors[id(p)])[id(p)]
                        into[id(p)].add_(got)
                        done.add(id(p))
            if captured is not None:
                _book_keeping(captured, {op: pids & group for op, pids in ghosted.items()
                                    if pids & group}, factors, into, done, left)
    except InternalError as err:  # the norms are right: the rest from per-sample gradients
        if sharded:
            raise
        leave_rules(Taken(), err)
        with internal("the clipped sums of the uses left"):
            _complete(captured, ghosted, left, factors, into, done)
        rest = {name: p for name, p in params.items() if id(p) in group and id(p) not in done}
        grads = slower(lambda: vmap_per_sample_grads(model, batch, targets, loss_fn, rest),
                       lambda: loop_per_sample_grads(model, batch, targets, loss_fn))
        with torch.no_grad():
            for name, p in rest.items():
                into[id(p)].add_(torch.tensordot(factors[id(p)].to(grads[name].dtype),
                                                 grads[name], dims=1))


def _empty_pass(model, batch, params) -> None:
    """A rank of an FSDP2 model without samples in this micro-batch runs the forward and
    backward of its empty batch all the same: FSDP's all-gathers are collectives."""
    from torch.utils._pytree import tree_leaves

    with torch.enable_grad():
        out = batch.call(model)
    outs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if outs:
        torch.autograd.grad(torch.stack([t.sum() for t in outs]).sum(), list(params.values()),
                            allow_unused=True)


def _total_samples(n: int) -> int:
    """The number of samples of all processes (``n`` on this one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return n
    total = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def _keeps_graph(plan: Plan) -> bool:
    """Whether the model's autograd graph must outlive the backward: only for the module
    calls a module norm rule may norm (their clipped sums come from a backward through
    the graph). Everything else is summed from the captured values, so the graph's saved
    activations are freed as the backward goes, as in a plain step."""
    return any(call.rule.spec.norm is not None for call, _ in plan.module_jobs)


def _clip_factors(sq, norms, params, max_grad_norm, per_layer) -> dict[int, Tensor]:
    if not per_layer:
        c = (max_grad_norm / (norms + STABILITY)).clamp(max=1.0)  # (n,)
        return {id(p): c for p in params.values()}
    bound = max_grad_norm / math.sqrt(len(params))
    return {id(p): (bound / (sq[id(p)].sqrt() + STABILITY)).clamp(max=1.0)
            for p in params.values()}


def _book_keeping(captured: Captured, ghosted: dict, factors: dict[int, Tensor],
                  into: dict[int, Tensor], done: set[int], left: dict[int, list]) -> None:
    """Add the clipped sums of the ghost-normed parameters into ``into``, op by op
    (``ghosted``: op -> the parameters it sums; ``done``: parameters whose sums are
    complete, those summed from materialised gradients already in it; ``left``: filled
    here with each parameter's ops not yet added, for :func:`_complete` after a failure).

    ``sum_i c_i g_i`` is the op's ordinary weight gradient for backprops scaled by
    the clip factors: the op's weighted-sum rule where it has one (one GEMM for a
    linear map), else one local backward from the op's own autograd node. A
    parameter several ops read gets each one's sum.
    """
    for op, pids in ghosted.items():
        for pid in pids - done:
            left.setdefault(pid, []).append(op)
    with without_autocast():
        for op, pids in ghosted.items():
            summed = _sum_rule(op)
            g = (captured.backprops(op.edges, op.out_layouts)[0]  # (n, 1, *out)
                 if summed else None)
            for pid in [pid for pid in pids if pid in left]:  # one at a time: a failure
                _add_op_sum(captured, op, pid, factors[pid], into[pid], g)  # adds nothing
                left[pid].remove(op)
                if not left[pid]:
                    done.add(pid)


def _complete(captured: Captured, ghosted: dict, left: dict[int, list],
              factors: dict[int, Tensor], into: dict[int, Tensor], done: set[int]) -> None:
    """After a failure: a parameter some of whose uses were added gets the other uses'
    sums from each op's own backward (exact, and apart from the rules)."""
    for pid, ops in left.items():
        uses = sum(pid in pids for pids in ghosted.values())
        if pid in done or not ops or len(ops) == uses:
            continue  # complete, or nothing added: summed from per-sample gradients
        with without_autocast():
            for op in ops:
                p = next(t for t in op.leaves if id(t) == pid)
                into[pid].add_(_local_backward(captured, op, [p], factors[pid])[pid])
        done.add(pid)


def _add_op_sum(captured: Captured, op, pid: int, c: Tensor, into: Tensor, g: Tensor | None
                ) -> None:
    """Add one op's share of ``sum_i c_i g_i`` of the parameter ``pid`` (clip factors
    ``c (n,)``) into ``into``: its weighted-sum rule with the op's backprops ``g (n, 1,
    *out)`` (``None``: it has none), else (it has none, or it declines, having added
    nothing) one local backward."""
    p = next(t for t in op.leaves if id(t) == pid)
    if g is not None:
        dtype = _sum_dtype(g.dtype, into.dtype)
        try:
            with torch.no_grad():
                _sum_rule(op)(OpCall(op, captured.n, dtype), cast(g, dtype), c.to(dtype),
                              {p: into})
            return
        except Decline:
            pass
    into.add_(_local_backward(captured, op, [p], c)[pid])


def _sum_rule(op) -> Callable | None:
    """The op's weighted-sum rule (``OpSpec.sum``), or ``None``."""
    spec = spec_of(op.func)
    return None if spec is None else spec.sum


def _sum_dtype(op_dtype: torch.dtype, into_dtype: torch.dtype) -> torch.dtype:
    """The dtype an op's clipped sum is computed in: the op's own under autocast (its
    backprops are bfloat16: the GEMM runs there, as autograd's weight gradient would,
    and is added to the float32 sums), else the sums'."""
    return op_dtype if op_dtype in LOW and into_dtype not in LOW else into_dtype


def _local_backward(captured: Captured, op, group: list, c: Tensor) -> dict[int, Tensor]:
    """``d/dW <c * G, out>`` for ``group``'s parameters: the op replayed on the values it
    read (unchanged since: ``squared_norms`` ghosts no other) and one backward of it
    alone (the model's graph is not kept for this)."""
    (edge,), (lay,) = op.edges, op.out_layouts
    scaled = _scaled(captured.grad(edge)[0], lay, c)  # (*out)
    wanted = {id(p) for p in group}
    wrt = [k for k, t in enumerate(op.leaves) if id(t) in wanted]
    found: dict[int, Tensor] = {}
    for k, got in zip(wrt, summed_vjp(op, scaled, wrt)):
        pid = id(op.leaves[k])
        found[pid] = got if pid not in found else found[pid] + got
    return found


def _edge_backward(captured: Captured, edge, lay, group: list, c: Tensor) -> dict[int, Tensor]:
    """``d/dW <c * G, out>`` for the output at ``edge`` (layout ``lay``) of a module call
    normed by a module norm rule: the gradient of ``group``'s parameters for that
    output's backprops scaled per sample, through the model's graph (kept for this:
    :func:`_keeps_graph`)."""
    scaled = _scaled(captured.grad(edge)[0], lay, c)
    grads = torch.autograd.grad([edge.edge], group, [edge.place(scaled)], retain_graph=True)
    return {id(p): got for p, got in zip(group, grads)}


def _scaled(g: Tensor, lay, c: Tensor) -> Tensor:
    """Backprops ``g`` (an output's own shape, layout ``lay``) times each sample's clip
    factor ``c (n,)``; a shared output (no samples) as it is."""
    return g * lay.scale(c, g) if isinstance(lay, Batched) else g


def _check_finite(norms: Tensor) -> None:
    bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
    if bad:
        raise FloatingPointError(
            f"the gradients of samples {bad[:10]}{'...' if len(bad) > 10 else ''} are not "
            "finite (NaN or Inf), so they cannot be clipped; p.grad was left unchanged. "
            "Check those inputs (or the loss), drop them and call again."
        )


def _check_dp_options(max_grad_norm, noise_multiplier, expected_batch_size) -> None:
    if not (isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm)
            and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm (the clipping norm C) must be > 0, got {max_grad_norm}")
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier (sigma) must be >= 0, got {noise_multiplier}")
    if expected_batch_size is not None and not (
            isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
        raise ValueError(
            f"expected_batch_size must be a positive number or None, got {expected_batch_size}")
