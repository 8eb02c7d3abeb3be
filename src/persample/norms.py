"""Per-sample gradient norms without materialising the gradients (DESIGN.md point 5).

From one captured forward and backward, each call's squared per-sample gradient
norms come from its layer's norm rule ("ghost norm": Goodfellow 2015; Lee &
Kifer 2021; Li et al. 2022), or, where no norm rule applies or materialising is
cheaper (convolutions, norm layers, the fallback), from its per-sample gradients,
which are then kept for the clipped sum of ``persample.dp``. A parameter fed by
several calls (tied weights, a module called twice) is always materialised: the
norm of the summed contribution is not the sum of the norms.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .engine import (
    Captured,
    GradSink,
    InPlaceModificationError,
    _apply,
    activations,
    loss_backprops,
)
from .fallback import UnsupportedModuleError
from .layout import front_activations
from .reference import rows
from .rules import find_norm_rule


def squared_norms(
    cap: Captured, params: dict[str, nn.Parameter]
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Squared per-sample gradient norms ``{id(param): (n,)}`` of one captured batch.

    Also returns the per-sample gradients ``{id(param): (n, 1, *shape)}`` of the
    parameters that had to be materialised. Unused parameters get zeros.
    """
    n = cap.n
    uses = Counter(id(p) for job in cap.jobs for p in job.params.values())
    sq: dict[int, Tensor] = {}
    materialise = []
    with torch.no_grad():
        for job, backprops in zip(cap.jobs, cap.backprops):
            ghost = _ghost_norms(job, backprops, uses)
            if ghost is None:
                materialise.append((job, backprops))
            else:
                sq.update({id(job.params[name]): s for name, s in ghost.items()})
        mats = {id(p): p.new_empty((n, 1, *p.shape))
                for job, _ in materialise for p in job.params.values()}
        sink = GradSink(mats)
        for job, backprops in materialise:
            _apply(job, backprops, n, sink)
        sq.update({pid: m.flatten(1).square().sum(1) for pid, m in mats.items()})
    for p in params.values():
        sq.setdefault(id(p), p.new_zeros(n))
    return sq, mats


def _ghost_norms(job, backprops: list[Tensor], uses: Counter) -> dict[str, Tensor] | None:
    norm = find_norm_rule(job.rule)
    if norm is None or len(backprops) != 1 or any(uses[id(p)] > 1 for p in job.params.values()):
        return None
    inputs = front_activations(job.call, activations(job.call), len(backprops[0]))
    return norm(job.call.module, inputs, backprops[0], set(job.params))


def _rules_norms(model, args, targets, loss_fn, loss_reduction, params, method
                 ) -> dict[str, Tensor] | None:
    """``{name: (n,)}`` by the rules; ``None`` for vmap/loop (or auto on an unsupported
    module, with a warning)."""
    if method not in ("auto", "rules"):
        return None
    try:
        cap = loss_backprops(model, args, targets, loss_fn, loss_reduction,
                             {id(p) for p in params.values()})
        sq, _ = squared_norms(cap, params)
    except (UnsupportedModuleError, InPlaceModificationError) as err:
        if method == "rules":
            raise
        warnings.warn(f"{err} Falling back to method='loop'.", stacklevel=4)
        return None
    return {name: sq[id(p)].sqrt() for name, p in params.items()}


@checks.keeps_buffers
def per_sample_grad_norms(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    loss_reduction: str = "mean",
    method: str = "auto",
    per_layer: bool = False,
    chunk_size: int | None = None,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """L2 norm of each sample's gradient over all trainable parameters.

    Equal to ``per_sample_grads(..., flat=True).norm(dim=1)`` but, with the rules,
    without the ``(B, P)`` tensor: Linear layers (and Embedding with short
    sequences) use the "ghost norm" of their activations and backprops; other
    layers materialise their per-sample gradients one layer at a time.

    Args:
        model, inputs, targets, loss_fn, loss_reduction: as for
            :func:`persample.per_sample_grads`.
        method: ``"rules"`` (one forward, one backward, norm rules); ``"vmap"`` or
            ``"loop"``: the norms of those methods' per-sample gradients; ``"auto"``:
            the rules, and the loop (with a warning) if a module is unsupported or
            an activation the rules need was modified in place.
        per_layer: also return the norm of each parameter's per-sample gradient.
        chunk_size: process at most this many samples at a time.

    Returns:
        ``(B,)`` norms in the parameters' dtype (loss units per parameter unit);
        with ``per_layer=True`` a tuple ``((B,), {name: (B,)})``.

    Raises:
        ValueError, RuntimeError, UnsupportedModuleError: as
        :func:`persample.per_sample_grads`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> norms = persample.per_sample_grad_norms(net, x, y, nn.CrossEntropyLoss())
        >>> g = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
        >>> torch.allclose(norms, g.norm(dim=1), atol=1e-6)
        True
    """
    from .api import per_sample_grads  # the non-rules methods

    args, n, params = checks.validate_call(model, inputs, targets, method, loss_reduction,
                                          chunk_size)
    layers = {name: p.new_zeros(n) for name, p in params.items()}
    step = chunk_size or max(n, 1)
    for start in range(0, n, step):
        a, t = rows(args, start, start + step), rows(targets, start, start + step)
        chunk = _rules_norms(model, a, t, loss_fn, loss_reduction, params, method)
        if chunk is None:  # vmap or loop: the norms of their per-sample gradients
            grads = per_sample_grads(model, a, t, loss_fn,
                                     method="loop" if method == "auto" else method)
            chunk = {name: g.flatten(1).norm(dim=1) for name, g in grads.items()}
        for name, norms in chunk.items():
            layers[name][start : start + step] = norms
    total = torch.stack(list(layers.values())).square().sum(0).sqrt()  # (B,)
    return (total, layers) if per_layer else total
