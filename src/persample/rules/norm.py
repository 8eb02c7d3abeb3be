"""Per-sample gradients of ``nn.LayerNorm`` and ``nn.GroupNorm``.

Index conventions: ``n`` sample, ``v`` cotangent, ``c`` channel (GroupNorm) or
normalised feature (LayerNorm), ``s`` all other positions inside a sample.

Both layers compute ``y = xhat * weight + bias`` with ``xhat`` normalised per
sample, so ``grad_weight[n, v] = sum_s g[n, v, s] * xhat[n, s]`` and
``grad_bias[n, v] = sum_s g[n, v, s]``. ``xhat`` is recomputed from the captured
input with the functional form of the layer without its affine parameters.
"""

from __future__ import annotations

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
