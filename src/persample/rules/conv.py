"""Per-sample gradients of ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``.

Index conventions: ``n`` sample, ``c`` input channel, ``o`` output channel,
``k`` kernel position, ``*s`` spatial dims; ``G`` groups.

Method: the per-sample weight gradient of a convolution with ``G`` groups is
the weight gradient of the *same* convolution applied to all samples at once
with ``n * G`` groups: stack the batch into the channel dimension
(``(n, c, *s) -> (1, n*c, *s)``) and ask the convolution backward kernel for
the weight gradient of shape ``(n*o, c/G, *k)``, which is exactly
``(n, o, c/G, *k)``. No unfold, no ``(n, c*k, s)`` patch tensor: the cost is
about that of the ordinary summed weight gradient (PERFORMANCE.md notes the
unfold-based rule spends most of its time in ``F.unfold``; Opacus and BackPACK
both unfold). Only 2-d convolutions with tiny patches (a first layer on a
grey image) unfold, where that is cheaper. Rochette et al. (2019), "Efficient per-example gradient
computations in convolutional neural networks", describe the grouped form.

Transposed convolutions take the same route: the weight gradient of a
transposed convolution ``x -> y`` is that of the ordinary convolution ``y -> x``
with input and output gradient swapped, and their weight ``(c, o/G, *k)`` (input
channels first) comes out of the grouped backward as ``(n*c, o/G, *k)``, again
exactly ``(n, c, o/G, *k)``. The output size (``output_padding``, or the
``output_size=`` of the call) is read from the backprops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import register_rule


def padded_input(layer: nn.modules.conv._ConvNd, x: Tensor) -> tuple[Tensor, list[int]]:
    """The input as the convolution sees it and the zero padding still to apply.

    ``padding="same"`` may pad asymmetrically and non-zero ``padding_mode`` pads
    with other values: both are done here explicitly, as the module does.
    """
    none = [0] * (x.dim() - 2)
    if layer.padding_mode != "zeros":
        return F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode), none
    if layer.padding == "valid":
        return x, none
    if layer.padding == "same":
        return F.pad(x, layer._reversed_padding_repeated_twice), none
    return x, list(layer.padding)


# Measured (persample bench's machine): for conv 1->32 k3 (patch of 9 numbers) the
# unfold form takes 2 ms and the grouped backward 7 ms; for conv 32->64 k3 (288)
# the grouped backward takes 42 ms and unfold 111 ms. Small patches unfold.
_UNFOLD_MAX_PATCH = 32


def conv_weight_per_sample(layer: nn.modules.conv._ConvNd, x: Tensor, g: Tensor) -> Tensor:
    """``x (n, c, *s_in)``, ``g (n, v, o, *s_out)`` -> weight gradients ``(n, v, o, c/G, *k)``."""
    patch = layer.in_channels // layer.groups * math.prod(layer.kernel_size)
    if x.dim() == 4 and layer.groups == 1 and patch <= _UNFOLD_MAX_PATCH:
        return _unfolded(layer, x, g)
    return _grouped(layer, x, g)


def _unfolded(layer: nn.Conv2d, x: Tensor, g: Tensor) -> Tensor:
    """Small patches: ``(n, v*o, t) @ (n, t, c*k)`` over the unfolded input."""
    n, v, o = g.shape[:3]
    x, padding = padded_input(layer, x)
    patches = F.unfold(x, layer.kernel_size, layer.dilation, padding, layer.stride)  # (n, c*k, t)
    grad = torch.bmm(g.reshape(n, v * o, -1), patches.transpose(1, 2))  # (n, v*o, c*k)
    return grad.view(n, v, *layer.weight.shape)


def _grouped(layer: nn.modules.conv._ConvNd, x: Tensor, g: Tensor) -> Tensor:
    """The convolution backward with the batch folded into the groups.

    The ``v`` cotangents of a sample go into the output channels of its groups:
    group ``(n, j)`` has ``v * o/G`` output channels, so the input is never copied.
    """
    n, v, o = g.shape[:3]
    groups, spatial = layer.groups, g.shape[3:]
    x, padding = padded_input(layer, x)
    g = g.reshape(n, v, groups, o // groups, *spatial).transpose(1, 2)  # (n, G, v, o/G, *s)
    weight_shape = (n * v * o, *layer.weight.shape[1:])
    weight_stub = layer.weight.new_empty(1).expand(weight_shape)  # only its shape is read
    grad = torch.ops.aten.convolution_backward(
        g.reshape(1, n * v * o, *spatial),  # (1, n*G*v*o/G, *s_out)
        x.reshape(1, n * x.shape[1], *x.shape[2:]),  # (1, n*c, *s_in)
        weight_stub,
        None,
        list(layer.stride),
        padding,
        list(layer.dilation),
        False,
        [0] * len(spatial),
        groups * n,
        [False, True, False],
    )[1]  # (n*G*v*o/G, c/G, *k)
    grad = grad.view(n, groups, v, o // groups, *layer.weight.shape[1:])
    return grad.transpose(1, 2).reshape(n, v, *layer.weight.shape)  # (n, v, o, c/G, *k)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv(layer: nn.modules.conv._ConvNd, activations: tuple, backprops: Tensor, out: dict):
    x = activations[0]  # (n, c, *s_in)
    g = backprops  # (n, v, o, *s_out)
    _check_batched(layer, x)
    if "weight" in out and x.shape[0] > 0:
        out["weight"].copy_(conv_weight_per_sample(layer, x, g))
    if "bias" in out:
        torch.sum(g, dim=tuple(range(3, g.dim())), out=out["bias"])  # (n, v, o)


def _check_batched(layer: nn.modules.conv._ConvNd, x: Tensor) -> None:
    """Raise unless ``x`` is ``(n, c, *s)`` with as many spatial dims as the kernel."""
    if x.dim() != len(layer.kernel_size) + 2:
        raise ValueError(
            f"{type(layer).__name__} got an unbatched input of shape {tuple(x.shape)}; "
            "per-sample gradients need the batch in dim 0"
        )


def transposed_output_padding(layer: nn.modules.conv._ConvTransposeNd, s_in: tuple,
                              s_out: tuple) -> list[int]:
    """The ``output_padding`` that gave spatial size ``s_out`` from ``s_in``.

    ``s_out = (s_in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1``;
    it differs from ``layer.output_padding`` when the call passed ``output_size=``.
    """
    return [
        o - ((i - 1) * st - 2 * p + dl * (k - 1) + 1)
        for i, o, st, p, dl, k in zip(s_in, s_out, layer.stride, layer.padding, layer.dilation,
                                      layer.kernel_size)
    ]


def conv_transpose_weight_per_sample(layer: nn.modules.conv._ConvTransposeNd, x: Tensor,
                                     g: Tensor) -> Tensor:
    """``x (n, c, *s_in)``, ``g (n, v, o, *s_out)`` -> weight gradients ``(n, v, c, o/G, *k)``.

    The weight gradient of a transposed convolution ``x -> y`` is that of the
    ordinary convolution ``y -> x`` (same stride, padding, dilation) with the roles
    of input and output gradient swapped: ``grad_W[c, o, k] = sum_s x[c, s] *
    g[o, s*stride - padding + k*dilation]``, which the convolution backward computes
    faster than its transposed form (1.2 to 2 times on a 2-core CPU, float32, 1-3 d
    layers of 16 to 64 channels). The batch is folded into the
    groups: group ``(n, j)`` has ``v * o/G`` input and ``c/G`` output channels.
    """
    n, v, o = g.shape[:3]
    c, groups, spatial = x.shape[1], layer.groups, g.shape[3:]
    g = g.reshape(n, v, groups, o // groups, *spatial).transpose(1, 2)  # (n, G, v, o/G, *s)
    # An output_padding of a stride or more leaves the last rows of g past the
    # convolution's reach: give x as many zero rows, which contribute nothing.
    extra = [p // st for p, st in zip(transposed_output_padding(layer, x.shape[2:], spatial),
                                      layer.stride)]
    if any(extra):
        x = F.pad(x, [side for e in reversed(extra) for side in (0, e)])
    k = layer.weight.shape[2:]
    weight_stub = layer.weight.new_empty(1).expand(n * c, v * o // groups, *k)  # shape only
    grad = torch.ops.aten.convolution_backward(
        x.reshape(1, n * c, *x.shape[2:]),  # as the output gradient: (1, n*c, *s_in)
        g.reshape(1, n * v * o, *spatial),  # as the input: (1, n*G*v*o/G, *s_out)
        weight_stub,
        None,
        list(layer.stride),
        list(layer.padding),
        list(layer.dilation),
        False,
        [0] * len(spatial),
        groups * n,
        [False, True, False],
    )[1]  # (n*G*c/G, v*o/G, *k)
    grad = grad.view(n, c, v, o // groups, *k)
    return grad.transpose(1, 2)  # (n, v, c, o/G, *k)


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def conv_transpose(layer: nn.modules.conv._ConvTransposeNd, activations: tuple,
                   backprops: Tensor, out: dict):
    """Weight ``(n, v, c, o/G, *k)`` from the folded backward; bias ``(n, v, o)``: ``g`` summed."""
    x = activations[0]  # (n, c, *s_in)
    g = backprops  # (n, v, o, *s_out)
    _check_batched(layer, x)
    if "weight" in out and x.shape[0] > 0:
        out["weight"].copy_(conv_transpose_weight_per_sample(layer, x, g))
    if "bias" in out:
        torch.sum(g, dim=tuple(range(3, g.dim())), out=out["bias"])  # (n, v, o)
