"""The public functions of persample."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .engine import rules_grads
from .fallback import UnsupportedModuleError
from .reference import loop_per_sample_grads, rows
from .vmap import vmap_per_sample_grads


def per_sample_grads(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    loss_reduction: str = "mean",
    method: str = "auto",
    flat: bool = False,
    chunk_size: int | None = None,
    out: Tensor | None = None,
) -> dict[str, Tensor] | Tensor:
    """Per-sample gradients of a loss w.r.t. every trainable parameter.

    Row ``i`` is the gradient of sample ``i``'s own loss
    ``loss_fn(model(x_i), y_i)``: exactly what a loop of ``torch.autograd.grad``
    over samples returns (``method="loop"``), whatever the loss's reduction.

    Args:
        model: an ``nn.Module``; samples must not interact (BatchNorm in training
            mode is refused). Its state is left exactly as it was: no hooks, no
            attributes, ``p.grad`` and ``training`` untouched.
        inputs: tensor ``(B, *in_shape)``, or a tuple of tensors all with the batch
            in dim 0, passed as ``model(*inputs)``. Any dtype the model accepts.
        targets: tensor ``(B, ...)``, tuple of tensors, or ``None``; passed to
            ``loss_fn`` as the second argument.
        loss_fn: ``loss_fn(output, targets)`` returning per-sample losses ``(B,)``
            or a scalar reduced over the batch as ``loss_reduction`` says.
        loss_reduction: ``"mean"`` or ``"sum"``: how a scalar loss was reduced over
            the batch, so that it can be undone. Ignored for ``(B,)`` losses.
        method: ``"rules"`` (capture + layer rules, per-module ``torch.func``
            fallback; Goodfellow 2015, seed 004), ``"vmap"`` (``torch.func`` over the
            whole model, seed 001), ``"loop"`` (the reference), or ``"auto"``:
            ``"rules"``, and ``"loop"`` with a warning if a module can be handled
            by neither a rule nor ``torch.func``.
        flat: return one ``(B, P)`` tensor, columns in ``named_parameters()`` order,
            each parameter flattened row-major.
        chunk_size: process at most this many samples at a time, to bound the
            memory of activations and backprops (the result is still whole).
        out: a caller-owned ``(B, P)`` buffer, the parameters' dtype and device, to
            write the flat result into (implies ``flat=True``).

    Returns:
        ``{name: (B, *param.shape)}`` over the trainable parameters in
        ``model.named_parameters()`` order, in each parameter's dtype and device;
        or with ``flat=True`` / ``out=`` a ``(B, P)`` tensor. Units: loss units per
        parameter unit. A batch of 0 samples gives empty results of these shapes
        without running the model.

    Raises:
        ValueError: targets or inputs whose dim 0 is not the batch size; a module
            that mixes samples (BatchNorm in training mode); no trainable
            parameters; a loss that is neither ``(B,)`` nor a scalar; ``out`` of the
            wrong shape, dtype or device; a layer whose input lost the batch dim.
        RuntimeError: a captured activation was modified in place (say
            ``nn.ReLU(inplace=True)`` right after a Linear).
        UnsupportedModuleError: ``method="rules"`` and a module without a rule that
            ``torch.func`` cannot differentiate.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> g = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
        >>> g["0.weight"].shape
        torch.Size([16, 8, 4])
        >>> persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True).shape
        torch.Size([16, 75])
    """
    checks.check_options(method, loss_reduction, chunk_size)
    checks.check_per_sample_model(model)
    args = checks.as_args(inputs)
    n = args[0].shape[0]
    checks.check_targets(targets, n)
    params = checks.trainable_parameters(model)
    result, dest = _allocate(params, n, flat or out is not None, out)
    if n == 0:
        return result
    step = chunk_size or n
    for start in range(0, n, step):
        stop = min(start + step, n)
        part = {key: t[start:stop] for key, t in dest.items()}
        _fill(model, rows(args, start, stop), rows(targets, start, stop), loss_fn,
              loss_reduction, method, params, part)
    return result


def _allocate(
    params: dict[str, nn.Parameter], n: int, flat: bool, out: Tensor | None
) -> tuple[dict[str, Tensor] | Tensor, dict[int, Tensor]]:
    """The result and its destinations by parameter identity (views when flat)."""
    if not flat:
        result = {name: p.new_empty((n, *p.shape)) for name, p in params.items()}
        return result, {id(params[name]): t for name, t in result.items()}
    dtype, device = checks.common_dtype_device(params)
    total = sum(p.numel() for p in params.values())
    if out is None:
        out = torch.empty((n, total), dtype=dtype, device=device)
    else:
        checks.check_out(out, n, total, dtype, device)
    dest, offset = {}, 0
    for p in params.values():
        dest[id(p)] = out[:, offset : offset + p.numel()].view(n, *p.shape)
        offset += p.numel()
    return out, dest


def _fill(model, args, targets, loss_fn, loss_reduction, method, params, dest) -> None:
    """Per-sample gradients of one chunk into ``dest`` (id(param) -> (n, *shape))."""
    if method in ("auto", "rules"):
        try:
            rules_grads(model, args, targets, loss_fn, loss_reduction, dest)
            return
        except UnsupportedModuleError as err:
            if method == "rules":
                raise
            warnings.warn(f"{err} Falling back to method='loop'.", stacklevel=3)
            method = "loop"
    if method == "vmap":
        got = vmap_per_sample_grads(model, args, targets, loss_fn, params)
    else:
        got = loop_per_sample_grads(model, args, targets, loss_fn)
    for name, p in params.items():
        dest[id(p)].copy_(got[name])
