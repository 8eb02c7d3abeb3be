"""Per-sample gradients of the normalisation layers.

``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, ``nn.InstanceNorm1d/2d/3d``
and ``nn.BatchNorm1d/2d/3d`` in eval mode (running statistics; in training mode
BatchNorm mixes samples and is refused before any rule runs).

Index conventions: ``n`` sample, ``v`` cotangent, ``c`` channel (GroupNorm,
InstanceNorm, BatchNorm) or normalised feature (LayerNorm, RMSNorm), ``s`` all
other positions inside a sample.

All these layers compute ``y = xhat * weight (+ bias)`` with ``xhat`` normalised
per sample (or with fixed running statistics), so
``grad_weight[n, v] = sum_s g[n, v, s] * xhat[n, s]`` and
``grad_bias[n, v] = sum_s g[n, v, s]``. ``xhat`` is recomputed from the captured
input with the functional form of the layer without its affine parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import register_rule


def _reduce_into(x: Tensor, dims: tuple[int, ...], dst: Tensor) -> None:
    """Sum ``x`` over ``dims`` into ``dst`` (a copy when there is nothing to sum)."""
    if dims:
        torch.sum(x, dim=dims, out=dst)
    else:
        dst.copy_(x)


def _affine_into(normalised: Callable[[], Tensor], g: Tensor, dims: tuple[int, ...],
                 out: dict) -> None:
    """``out["weight"] = sum_dims g * xhat``, ``out["bias"] = sum_dims g``.

    ``normalised()`` gives ``xhat (n, *x)``, the normalised input (only called when
    the weight is wanted); ``g (n, v, *x)`` the backprops; ``dims`` index ``g``'s
    dims that are summed (the positions sharing one parameter).
    """
    if "weight" in out:
        _reduce_into(g * normalised().unsqueeze(1), dims, out["weight"])
    if "bias" in out:
        _reduce_into(g, dims, out["bias"])


def _channels_first(layer: nn.Module, x: Tensor, spatial: int | tuple[int, ...]) -> None:
    """Raise unless ``x`` is ``(n, c, *s)`` with ``len(s)`` in ``spatial``."""
    allowed = (spatial,) if isinstance(spatial, int) else spatial
    if x.dim() - 2 not in allowed:
        raise ValueError(
            f"{type(layer).__name__} got an input of shape {tuple(x.shape)}; per-sample "
            f"gradients need a batched input (n, c, *s) with {' or '.join(map(str, allowed))} "
            "spatial dims"
        )


def _running_xhat(x: Tensor, mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` per channel (dim 1), as ``F.batch_norm`` in eval."""
    return F.batch_norm(x, mean, var, training=False, momentum=0.0, eps=eps)


@register_rule(nn.LayerNorm)
def layer_norm(layer: nn.LayerNorm, activations: tuple, backprops: Tensor, out: dict):
    x = activations[0]  # (n, *s, *normalized_shape)
    g = backprops  # (n, v, *s, *normalized_shape)
    dims = tuple(range(2, g.dim() - len(layer.normalized_shape)))  # the s dims
    if "weight" in out:
        xhat = F.layer_norm(x, layer.normalized_shape, eps=layer.eps).unsqueeze(1)
        _reduce_into(g * xhat, dims, out["weight"])  # (n, v, *normalized_shape)
    if "bias" in out:
        _reduce_into(g, dims, out["bias"])


@register_rule(nn.GroupNorm)
def group_norm(layer: nn.GroupNorm, activations: tuple, backprops: Tensor, out: dict):
    x = activations[0]  # (n, c, *s)
    g = backprops  # (n, v, c, *s)
    dims = tuple(range(3, g.dim()))
    if "weight" in out:
        xhat = F.group_norm(x, layer.num_groups, eps=layer.eps).unsqueeze(1)
        _reduce_into(g * xhat, dims, out["weight"])  # (n, v, c)
    if "bias" in out:
        _reduce_into(g, dims, out["bias"])


@register_rule(nn.RMSNorm)
def rms_norm(layer: nn.RMSNorm, activations: tuple, backprops: Tensor, out: dict):
    """``xhat = x / sqrt(mean(x^2 over normalized_shape) + eps)``; eps ``None``: dtype eps."""
    x = activations[0]  # (n, *s, *normalized_shape)
    g = backprops  # (n, v, *s, *normalized_shape)
    dims = tuple(range(2, g.dim() - len(layer.normalized_shape)))  # the s dims
    _affine_into(lambda: F.rms_norm(x, layer.normalized_shape, eps=layer.eps), g, dims, out)


_INSTANCE_DIMS = {nn.InstanceNorm1d: 1, nn.InstanceNorm2d: 2, nn.InstanceNorm3d: 3}


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm(layer: nn.modules.instancenorm._InstanceNorm, activations: tuple,
                  backprops: Tensor, out: dict):
    """Each sample and channel normalised over its own positions, or, in eval mode with
    ``track_running_stats``, with the running statistics (as ``F.instance_norm``)."""
    x = activations[0]  # (n, c, *s)
    g = backprops  # (n, v, c, *s)
    spatial = next(d for cls, d in _INSTANCE_DIMS.items() if isinstance(layer, cls))
    _channels_first(layer, x, spatial)

    def normalised() -> Tensor:  # (n, c, *s)
        if layer.training or not layer.track_running_stats:
            return F.instance_norm(x, eps=layer.eps)
        return _running_xhat(x, layer.running_mean, layer.running_var, layer.eps)

    _affine_into(normalised, g, tuple(range(3, g.dim())), out)


_BATCH_DIMS = {nn.BatchNorm1d: (0, 1), nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm(layer: nn.modules.batchnorm._BatchNorm, activations: tuple, backprops: Tensor,
               out: dict):
    """Eval mode only: ``xhat = (x - running_mean) / sqrt(running_var + eps)`` per channel."""
    if layer.training or not layer.track_running_stats:
        raise ValueError(
            f"{type(layer).__name__} in training mode (or without running statistics) "
            "normalises with the statistics of the whole batch: no per-sample gradients"
        )
    x = activations[0]  # (n, c, *s)
    g = backprops  # (n, v, c, *s)
    spatial = next(d for cls, d in _BATCH_DIMS.items() if isinstance(layer, cls))
    _channels_first(layer, x, spatial)
    _affine_into(lambda: _running_xhat(x, layer.running_mean, layer.running_var, layer.eps),
                 g, tuple(range(3, g.dim())), out)
