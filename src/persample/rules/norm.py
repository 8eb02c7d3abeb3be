"""Per-sample gradients of the normalisations: ``F.layer_norm``, ``F.group_norm``,
``F.rms_norm``, ``F.instance_norm`` and ``F.batch_norm`` in eval mode (running
statistics; in training mode BatchNorm mixes samples), whatever module calls them
(timm's ``LayerNorm2d``, torchvision's ``LayerNorm2d`` and ``Permute`` +
``LayerNorm``, ``BatchNormAct2d``).

Index conventions: ``n`` sample, ``v`` cotangent, ``a`` rows of one sample in the
op's own batch dim (1, or windows merged with it), ``c`` channel (GroupNorm,
InstanceNorm, BatchNorm) or normalised feature (LayerNorm, RMSNorm), ``s`` the
other positions.

All these ops compute ``y = xhat * weight (+ bias)`` with ``xhat`` normalised
per sample (or with fixed running statistics), so
``grad_weight[n, v] = sum_s g[n, v, s] * xhat[n, s]`` and
``grad_bias[n, v] = sum_s g[n, v, s]``. ``xhat`` is recomputed from the captured
input by the same op without its affine parameters. For bfloat16 and float16
parameters ``xhat``, the products and the sums are computed in float32 (as the ops'
own kernels do) and the results written in the parameters' dtype.

RMSNorm classes written by hand (Llama's, T5's ``weight * hidden``) are an
elementwise scale of a per-sample tensor: ``elementwise.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import accumulate_dtype, cast
from .calls import OpCall
from .spec import Decline, OpSpec, register


def _reduce_into(x: Tensor, dims: tuple[int, ...], dst: Tensor) -> None:
    """Sum ``x`` over ``dims`` into ``dst`` (a copy when there is nothing to sum, or when
    ``dst`` is in a narrower dtype)."""
    if dims and dst.dtype == x.dtype:
        torch.sum(x, dim=dims, out=dst)
    else:
        dst.copy_((x.sum(dims) if dims else x).reshape(dst.shape))


def _affine_into(call: OpCall, normalised: Callable[[], Tensor], g: Tensor, w, b,
                 dims: tuple[int, ...], out: dict) -> None:
    """``out[w] = sum_dims g * xhat``, ``out[b] = sum_dims g`` over ``g (n, v, *x)``."""
    call.only(out, w, b)
    for t in (w, b):
        if t is not None and t in out and not call.shared(t):
            raise Decline("an affine parameter paired with the samples")
    work = accumulate_dtype(g.dtype)  # float32 for bfloat16 / float16 results
    g = g.to(work)
    if w is not None and w in out:
        _reduce_into(g * normalised().to(work).unsqueeze(1), dims, out[w])
    if b is not None and b in out:
        _reduce_into(g, dims, out[b])


def _per_sample_input(call: OpCall, x: Tensor) -> Tensor:
    """The input ``(n, a, ...)`` in at least float32 (the dtype ``xhat`` is made in)."""
    if call.shared(x):
        raise Decline("a shared input")
    xf = call.front(x)
    return xf.to(accumulate_dtype(xf.dtype))


def layer_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.layer_norm(x, shape, w, b, eps)``: the trailing ``shape`` dims normalised."""
    x, shape = call.arg(0, "input"), call.arg(1, "normalized_shape")
    w, b, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    xf = _per_sample_input(call, x)
    dims = tuple(range(2, g.dim() - len(shape)))  # (n, v, *s, *shape): the s dims
    _affine_into(call, lambda: F.layer_norm(xf, shape, eps=eps), g, w, b, dims, out)


def rms_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.rms_norm(x, shape, w, eps)``: ``xhat = x / sqrt(mean(x^2) + eps)``."""
    x, shape = call.arg(0, "input"), call.arg(1, "normalized_shape")
    w, eps = call.arg(2, "weight"), call.arg(3, "eps")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    xf = _per_sample_input(call, x)
    dims = tuple(range(2, g.dim() - len(shape)))
    _affine_into(call, lambda: F.rms_norm(xf, shape, eps=eps), g, w, None, dims, out)


def _channels(xf: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``(n, a, c, *s)`` as the op's own batch ``(n*a, c, *s)``, and the way back."""
    shape = xf.shape
    return xf.flatten(0, 1), lambda y: y.view(shape)


def group_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.group_norm(x, G, w, b, eps)``: per row and group of channels."""
    x, groups = call.arg(0, "input"), call.arg(1, "num_groups")
    w, b, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    xf = _per_sample_input(call, x)
    rows, back = _channels(xf)
    dims = (2, *range(4, g.dim()))  # g (n, v, a, c, *s): all but the channel
    _affine_into(call, lambda: back(F.group_norm(rows, groups, eps=eps)), g, w, b,
                        dims, out)


def instance_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.instance_norm(x, running_mean, running_var, w, b, use_input_stats, momentum,
    eps)``: each row's channels over their own positions, or the running statistics."""
    x, mean, var = call.arg(0, "input"), call.arg(1, "running_mean"), call.arg(2, "running_var")
    w, b = call.arg(3, "weight"), call.arg(4, "bias")
    use_input_stats, eps = call.arg(5, "use_input_stats", True), call.arg(7, "eps", 1e-5)
    xf = _per_sample_input(call, x)
    rows, back = _channels(xf)

    def normalised() -> Tensor:
        if use_input_stats:  # without the running statistics: they are not updated again
            return back(F.instance_norm(rows, eps=eps))
        return back(F.batch_norm(rows, cast(mean, rows.dtype), cast(var, rows.dtype),
                                 training=False, eps=eps))

    _affine_into(call, normalised, g, w, b, (2, *range(4, g.dim())), out)


def batch_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """Eval mode: ``xhat = (x - running_mean) / sqrt(running_var + eps)`` per channel."""
    x, mean, var = call.arg(0, "input"), call.arg(1, "running_mean"), call.arg(2, "running_var")
    w, b = call.arg(3, "weight"), call.arg(4, "bias")
    training, eps = call.arg(5, "training", False), call.arg(7, "eps", 1e-5)
    if training or mean is None:
        raise Decline("batch statistics (training mode)")
    xf = _per_sample_input(call, x)
    rows, back = _channels(xf)
    mean, var = cast(mean, rows.dtype), cast(var, rows.dtype)
    normalised = lambda: back(F.batch_norm(rows, mean, var, training=False, eps=eps))  # noqa: E731
    _affine_into(call, normalised, g, w, b, (2, *range(4, g.dim())), out)


LAYER_NORM = register(OpSpec((F.layer_norm,), grad=layer_norm))
RMS_NORM = register(OpSpec((getattr(F, "rms_norm", None),), grad=rms_norm))
GROUP_NORM = register(OpSpec((F.group_norm,), grad=group_norm))
INSTANCE_NORM = register(OpSpec((F.instance_norm,), grad=instance_norm))
BATCH_NORM = register(OpSpec((F.batch_norm,), grad=batch_norm))
