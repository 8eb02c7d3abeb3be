"""Per-sample gradients of the convolutions: ``F.conv1d/2d/3d`` and
``F.conv_transpose1d/2d/3d``, whatever module calls them.

Index conventions: ``n`` sample, ``a`` images of one sample (1, or Swin-like
windows merged with the batch), ``c`` input channel, ``o`` output channel, ``k``
kernel position, ``*s`` spatial dims; ``G`` groups.

Method: the per-sample weight gradient of a convolution with ``G`` groups is
the weight gradient of the *same* convolution applied to all samples at once
with ``n * G`` groups: stack the batch into the channel dimension
(``(n, c, *s) -> (1, n*c, *s)``) and ask the convolution backward kernel for
the weight gradient of shape ``(n*o, c/G, *k)``, which is exactly
``(n, o, c/G, *k)``. A sample's ``a`` images go into the kernel's own batch
dim, over which it sums. No unfold, no ``(n, c*k, s)`` patch tensor: the cost
is about that of the ordinary summed weight gradient. Only 2-d convolutions with
tiny patches (a first layer on a grey image) unfold, where that is cheaper.
Rochette et al. (2019), "Efficient per-example gradient computations in
convolutional neural networks", describe the grouped form.

Transposed convolutions take the same route: the weight gradient of a
transposed convolution ``x -> y`` is that of the ordinary convolution ``y -> x``
with input and output gradient swapped, and their weight ``(c, o/G, *k)`` comes out
of the grouped backward as ``(n*c, o/G, *k)``, exactly ``(n, c, o/G, *k)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import OpCall, register_op_rule


def _tuple(x, d: int) -> list[int]:
    return list(x) if isinstance(x, (tuple, list)) else [x] * d


def _padded(x: Tensor, padding, kernel: list[int], dilation: list[int]
            ) -> tuple[Tensor, list[int]]:
    """The input and the symmetric zero padding left for the kernel; ``"same"`` may pad
    asymmetrically, which is done here explicitly, as ``F.conv*d`` does."""
    d = len(kernel)
    if padding == "valid":
        return x, [0] * d
    if padding == "same":
        total = [dl * (k - 1) for dl, k in zip(dilation, kernel)]
        pads = [p for t in reversed(total) for p in (t // 2, t - t // 2)]
        return F.pad(x, pads), [0] * d
    return x, _tuple(padding, d)


# Measured (persample bench's machine): for conv 1->32 k3 (patch of 9 numbers) the
# unfold form takes 2 ms and the grouped backward 7 ms; for conv 32->64 k3 (288)
# the grouped backward takes 42 ms and unfold 111 ms. Small patches unfold.
_UNFOLD_MAX_PATCH = 32


def conv_weight_per_sample(x: Tensor, g: Tensor, weight_shape: torch.Size, stride, padding,
                           dilation, groups: int) -> Tensor:
    """``x (n, a, c, *s_in)``, ``g (n, v, a, o, *s_out)`` -> ``(n, v, o, c/G, *k)``."""
    d = len(weight_shape) - 2
    stride, dilation = _tuple(stride, d), _tuple(dilation, d)
    x, padding = _padded(x.flatten(0, 1), padding, list(weight_shape[2:]), dilation)
    x = x.unflatten(0, g.shape[0:1] + g.shape[2:3])  # (n, a, c, *s_in)
    patch = weight_shape[1] * math.prod(weight_shape[2:])
    if d == 2 and groups == 1 and patch <= _UNFOLD_MAX_PATCH:
        return _unfolded(x, g, weight_shape, stride, padding, dilation)
    return _grouped(x, g, weight_shape, stride, padding, dilation, groups)


def _unfolded(x, g, weight_shape, stride, padding, dilation) -> Tensor:
    """Small patches: ``(n, v*o, a*t) @ (n, a*t, c*k)`` over the unfolded input."""
    n, v, a, o = g.shape[:4]
    patches = F.unfold(x.flatten(0, 1), weight_shape[2:], dilation, padding, stride)
    patches = patches.view(n, a, patches.shape[1], -1).transpose(1, 2).flatten(2)  # (n, ck, at)
    gm = g.reshape(n, v, a, o, -1).transpose(2, 3).reshape(n, v * o, -1)  # (n, v*o, a*t)
    grad = torch.bmm(gm, patches.transpose(1, 2))  # (n, v*o, c*k)
    return grad.view(n, v, *weight_shape)


def _grouped(x, g, weight_shape, stride, padding, dilation, groups) -> Tensor:
    """The convolution backward with the batch folded into the groups; a sample's ``a``
    images in the kernel's batch dim (summed over)."""
    n, v, a, o = g.shape[:4]
    spatial = g.shape[4:]
    c = x.shape[2]
    g = g.reshape(n, v, a, groups, o // groups, *spatial).permute(
        2, 0, 3, 1, 4, *range(5, 5 + len(spatial)))  # (a, n, G, v, o/G, *s)
    stub = g.new_empty(1).expand(n * v * o, *weight_shape[1:])  # only its shape is read
    grad = torch.ops.aten.convolution_backward(
        g.reshape(a, n * v * o, *spatial),  # (a, n*G*v*o/G, *s_out)
        x.transpose(0, 1).reshape(a, n * c, *x.shape[3:]),  # (a, n*c, *s_in)
        stub, None, stride, padding, dilation, False, [0] * len(spatial), groups * n,
        [False, True, False],
    )[1]  # (n*G*v*o/G, c/G, *k)
    grad = grad.view(n, groups, v, o // groups, *weight_shape[1:])
    return grad.transpose(1, 2).reshape(n, v, *weight_shape)  # (n, v, o, c/G, *k)


def _images(call: OpCall, x: Tensor, g: Tensor, spatial: int) -> tuple[Tensor, Tensor] | None:
    """``x (n, a, c, *s)`` and ``g (n, v, a, o, *s')`` from the per-sample views."""
    if call.shared(x) or x.dim() != spatial + 2:
        return None
    xf = call.front(x)  # (n, a, c, *s)
    n, v = g.shape[:2]
    return xf, g.reshape(n, v, xf.shape[1], *g.shape[3:])


def transposed_output_padding(stride, padding, dilation, kernel, s_in, s_out) -> list[int]:
    """The ``output_padding`` that gave spatial size ``s_out`` from ``s_in``:
    ``s_out = (s_in - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1``."""
    return [o - ((i - 1) * st - 2 * p + dl * (k - 1) + 1)
            for i, o, st, p, dl, k in zip(s_in, s_out, stride, padding, dilation, kernel)]


def conv_transpose_weight_per_sample(x: Tensor, g: Tensor, weight_shape, stride, padding,
                                     dilation, groups: int) -> Tensor:
    """``x (n, a, c, *s_in)``, ``g (n, v, a, o, *s_out)`` -> ``(n, v, c, o/G, *k)``.

    The weight gradient of a transposed convolution is that of the ordinary
    convolution ``y -> x`` with input and output gradient swapped
    (``grad_W[c, o, k] = sum_s x[c, s] g[o, s*stride - padding + k*dilation]``), which
    the convolution backward computes 1.2 to 2 times faster than its transposed form.
    """
    n, v, a, o = g.shape[:4]
    d = len(weight_shape) - 2
    stride, padding, dilation = _tuple(stride, d), _tuple(padding, d), _tuple(dilation, d)
    c, spatial, k = x.shape[2], g.shape[4:], list(weight_shape[2:])
    # An output_padding of a stride or more leaves the last rows of g past the
    # convolution's reach: give x as many zero rows, which contribute nothing.
    extra = [p // st for p, st in zip(transposed_output_padding(
        stride, padding, dilation, k, x.shape[3:], spatial), stride)]
    if any(extra):
        x = F.pad(x, [side for e in reversed(extra) for side in (0, e)])
    g = g.reshape(n, v, a, groups, o // groups, *spatial).permute(
        2, 0, 3, 1, 4, *range(5, 5 + len(spatial)))  # (a, n, G, v, o/G, *s)
    stub = g.new_empty(1).expand(n * c, v * o // groups, *k)  # shape only
    grad = torch.ops.aten.convolution_backward(
        x.transpose(0, 1).reshape(a, n * c, *x.shape[3:]),  # as the output gradient
        g.reshape(a, n * v * o, *spatial),  # as the input
        stub, None, stride, padding, dilation, False, [0] * len(spatial), groups * n,
        [False, True, False],
    )[1]  # (n*G*c/G, v*o/G, *k)
    grad = grad.view(n, c, v, o // groups, *k)
    return grad.transpose(1, 2)  # (n, v, c, o/G, *k)


# op -> (spatial dims, transposed)
_CONVS = {F.conv1d: (1, False), F.conv2d: (2, False), F.conv3d: (3, False),
          F.conv_transpose1d: (1, True), F.conv_transpose2d: (2, True),
          F.conv_transpose3d: (3, True)}


@register_op_rule(*_CONVS)
def conv(call: OpCall, g: Tensor, out: dict) -> str | None:
    """``F.conv*d(x, W, b, stride, padding, dilation, groups)`` and
    ``F.conv_transpose*d(x, W, b, stride, padding, output_padding, groups, dilation)``:
    the weight from the folded backward, the bias ``(n, v, o)``: ``g`` summed over
    images and positions."""
    spatial, transposed = _CONVS[call.func]
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    found = _images(call, x, g, spatial)
    if found is None or call.only(out, w, b):
        return "an unbatched input, or the input is a parameter"
    xf, gi = found
    if id(w) in out:
        per_sample = conv_transpose_weight_per_sample if transposed else conv_weight_per_sample
        dilation = call.arg(7, "dilation", 1) if transposed else call.arg(5, "dilation", 1)
        out[id(w)].copy_(per_sample(xf, gi, w.shape, call.arg(3, "stride", 1),
                                    call.arg(4, "padding", 0), dilation,
                                    call.arg(6, "groups", 1)))
    if b is not None and id(b) in out:
        torch.sum(gi, dim=(2, *range(4, gi.dim())), out=out[id(b)])  # (n, v, o)
    return None
