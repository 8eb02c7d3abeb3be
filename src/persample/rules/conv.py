"""Per-sample gradients of the convolutions: ``F.conv1d/2d/3d`` and
``F.conv_transpose1d/2d/3d``, whatever module calls them.

Index conventions: ``n`` sample, ``a`` images of one sample (1, or Swin-like
windows merged with the batch), ``c`` input channel, ``o`` output channel, ``k``
kernel position, ``*s`` spatial dims; ``G`` groups.

Two methods, chosen per call by a cost model measured on real shapes (:func:`choose`):

- *grouped*: the per-sample weight gradient of a convolution with ``G`` groups is
  the weight gradient of the *same* convolution applied to all samples at once
  with ``n * G`` groups: stack the batch into the channel dimension
  (``(n, c, *s) -> (1, n*c, *s)``) and ask the convolution backward kernel for
  the weight gradient of shape ``(n*o, c/G, *k)``, which is exactly
  ``(n, o, c/G, *k)``. A sample's ``a`` images go into the kernel's own batch
  dim, over which it sums. No patch tensor; but the kernel's cost per group is
  high when the output has few positions (resnet18's last layer at 32x32 input:
  27x the time of writing the result). Rochette et al. (2019), "Efficient
  per-example gradient computations in convolutional neural networks".
- *patches*: a convolution is a linear map at every output position over the
  input's patches ``(n, c*k, t)`` (``F.unfold``; a 1x1 convolution's patches are
  the input itself, strided), so its per-sample weight gradient is the linear
  rule's ``sum_t g_t^T patch_t``, one batched GEMM written straight into the
  result (Goodfellow 2015). It wins when the patch tensor is small
  beside the result: few positions, tiny patches, 1x1 kernels.

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

from .calls import OpCall
from .ghost import Factors
from .outer import ghost_norm, sum_outer_into
from .spec import Decline, OpSpec, register


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


def conv_weight_per_sample(x: Tensor, g: Tensor, weight_shape: torch.Size, stride, padding,
                           dilation, groups: int, dst: Tensor, method: str | None = None
                           ) -> None:
    """``x (n, a, c, *s_in)``, ``g (n, v, a, o, *s_out)`` -> ``dst (n, v, o, c/G, *k)``.

    ``method``: ``"patches"`` or ``"grouped"``; default: the cheaper by :func:`choose`.
    """
    d = len(weight_shape) - 2
    x, stride, padding, dilation = _prepared(x, weight_shape, stride, padding, dilation)
    method = method or choose(g, weight_shape, groups)
    if method == "patches" and d <= 2 and groups == 1:
        _by_patches(x, g, weight_shape, stride, padding, dilation, dst)
    else:
        dst.copy_(_grouped(x, g, weight_shape, stride, padding, dilation, groups))


def _prepared(x: Tensor, weight_shape: torch.Size, stride, padding, dilation
              ) -> tuple[Tensor, list[int], list[int], list[int]]:
    """``x (n, a, c, *s)`` padded as ``padding`` says when it is a string, and the
    stride, symmetric padding and dilation as lists."""
    d = len(weight_shape) - 2
    stride, dilation = _tuple(stride, d), _tuple(dilation, d)
    flat, padding = _padded(x.flatten(0, 1), padding, list(weight_shape[2:]), dilation)
    return flat.unflatten(0, x.shape[:2]), stride, padding, dilation


def choose(g: Tensor, weight_shape: torch.Size, groups: int) -> str:
    """``"patches"`` or ``"grouped"``: the cheaper for ``g (n, v, a, o, *s_out)`` and a
    weight ``(o, c/G, *k)``, by a cost model measured on the CPU (table below).

    ``patches`` (the per-sample GEMM over the input's patches, written straight into
    the result) costs about the bytes of the patch tensor ``(n, a, c*k, t)`` beside
    the result's ``(n, o, c*k)``: it wins when the output positions ``t`` are few
    for the channels (every layer of resnet18 at 32x32 but its first; 1x1
    convolutions always, whose patches are the input itself). The grouped backward
    reads the input once, but costs much more per group when ``t`` is small.
    """
    n, v, a, o = g.shape[:4]
    t = math.prod(g.shape[4:])
    kernel = math.prod(weight_shape[2:])
    if len(weight_shape) > 4 or groups != 1:
        return "grouped"
    if kernel == 1 or a * t * _PATCH_RATIO <= o * v or weight_shape[1] * kernel <= _SMALL_PATCH:
        return "patches"
    return "grouped"


# Measured (2-core x86, float32; per-sample weight gradients into touched memory, ms):
#   layer (B, c->o, k, output)          patches  grouped
#   tutorial CNN conv1 (64, 1->32, 3, 26^2) 0.8    1.1   patch of 9 numbers
#   tutorial CNN conv2 (64, 32->64, 3, 24^2) 25.4  10.5
#   resnet18 layer1 (32, 64->64, 3, 8^2)    1.6      1.0
#   resnet18 layer2 (32, 128->128, 3, 4^2)  1.6     15.7
#   resnet18 layer3 (32, 256->256, 3, 2^2)  4.3     66.6
#   resnet18 layer4 (32, 512->512, 3, 1)   10.0    267.7   (writing the result: 9.9)
#   depthwise 3x3 (32, 64 groups, 16^2)     3.6      0.2   (grouped convs: grouped)
_SMALL_PATCH = 32  # numbers per patch (c/G * k) that unfold cheaply whatever t is
_PATCH_RATIO = 2  # patches when the positions are at most half the output channels


def _patches(x: Tensor, kernel: list[int], stride, padding, dilation) -> Tensor:
    """``x (n, a, c, *s)`` -> ``(n, a, c*k, t)``: the input under every kernel placement.

    A 1x1 kernel without padding only strides over the input (no copy for stride 1)."""
    n, a = x.shape[:2]
    if all(k == 1 for k in kernel) and not any(padding):
        picked = x[(..., *(slice(None, None, s) for s in stride))]  # (n, a, c, *s_out)
        return picked.flatten(3)
    if len(kernel) == 1:  # as 2-d with height 1
        x, kernel = x.unsqueeze(-2), [1, *kernel]
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
    cols = F.unfold(x.flatten(0, 1), kernel, dilation, padding, stride)  # (n*a, c*k, t)
    return cols.view(n, a, *cols.shape[1:])


def _by_patches(x, g, weight_shape, stride, padding, dilation, dst) -> None:
    """``dst[n, v, o] = sum_{a, t} g[n, v, a, o, t] patches[n, a, :, t]``: a linear map
    at every position (Goodfellow's rule over the patches); one group."""
    n, v, a, o = g.shape[:4]
    patches = _patches(x, list(weight_shape[2:]), stride, padding, dilation)  # (n, a, ck, t)
    ck, t = patches.shape[2:]
    cols = patches.transpose(2, 3).reshape(n, a * t, ck)  # (n, a*t, ck)
    gm = g.reshape(n, v, a, o, t).transpose(3, 4).reshape(n, v, a * t, o)  # (n, v, a*t, o)
    sum_outer_into(gm, cols, dst.view(n, v, o, ck))


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


def _images(call: OpCall, x: Tensor, g: Tensor, spatial: int) -> tuple[Tensor, Tensor]:
    """``x (n, a, c, *s)`` and ``g (n, v, a, o, *s')`` from the per-sample views."""
    if call.shared(x) or x.dim() != spatial + 2:
        raise Decline("an unbatched input")
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


def conv(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.conv*d(x, W, b, stride, padding, dilation, groups)`` and
    ``F.conv_transpose*d(x, W, b, stride, padding, output_padding, groups, dilation)``:
    the weight from the folded backward, the bias ``(n, v, o)``: ``g`` summed over
    images and positions."""
    spatial, transposed = _CONVS[call.func]
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    xf, gi = _images(call, x, g, spatial)
    call.only(out, w, b)
    if w in out:
        dilation = call.arg(7, "dilation", 1) if transposed else call.arg(5, "dilation", 1)
        args = (xf, gi, w.shape, call.arg(3, "stride", 1), call.arg(4, "padding", 0),
                dilation, call.arg(6, "groups", 1))
        if transposed:
            out[w].copy_(conv_transpose_weight_per_sample(*args))
        else:
            conv_weight_per_sample(*args, out[w])
    if b is not None and b in out:
        torch.sum(gi, dim=(2, *range(4, gi.dim())), out=out[b])  # (n, v, o)


def _conv_args(call: OpCall) -> tuple:
    """``(stride, padding, dilation, groups)`` of an ordinary convolution call."""
    return (call.arg(3, "stride", 1), call.arg(4, "padding", 0), call.arg(5, "dilation", 1),
            call.arg(6, "groups", 1))


def conv_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Tensor]:
    """Squared per-sample gradient norms over the patches ("ghost norm"): a convolution
    is a linear map at every position, so the linear rule's Gram form applies with
    ``t`` positions and ``c*k`` inputs, where it is cheaper than materialising (few
    positions: resnet18's later layers at 32x32; Li et al. 2022, Bu et al. 2023)."""
    w, b, xf, gm, args = _at_positions(call, g)
    o = gm.shape[2]
    result = {}
    if w in wanted:
        t, ck = gm.shape[1], w.shape[1:].numel()
        if t > 1 and t * (ck + o) > ck * o:
            raise Decline("materialising is cheaper")  # (before unfolding anything)
        result[w] = ghost_norm(_patch_rows(xf, w, *args), gm)
        if result[w] is None:
            raise Decline("materialising is cheaper")
    if b is not None and b in wanted:
        result[b] = gm.sum(1).square().sum(1)  # (n,)
    return result


def conv_factors(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Factors]:
    """A convolution as a linear map at every output position over the input's patches
    (Grosse & Martens 2016, "A Kronecker-factored approximate Fisher matrix for
    convolution layers"): ``W (o, c*k)``: ``L`` the backprops at each position, ``R``
    the patch there; ``b``: ``L = g``, ``R = 1``. For curvature only (the patches of a
    large layer cost more than materialising its gradients): one group, 1-d or 2-d."""
    w, b, xf, gm, args = _at_positions(call, g)
    if not call.shared(w):
        raise Decline("a per-sample kernel")
    found = {}
    if w in wanted:
        found[w] = Factors(gm, _patch_rows(xf, w, *args))
    if b is not None and b in wanted:
        found[b] = Factors(gm, gm.new_ones(*gm.shape[:2], 1))
    return found


def _at_positions(call: OpCall, g: Tensor) -> tuple:
    """An ungrouped 1-d or 2-d convolution as a linear map at its output positions:
    ``(weight, bias, x (n, a, c, *s), backprops (n, a*t, o), (stride, padding,
    dilation))``; declines the others."""
    spatial = _CONVS[call.func][0]
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    stride, padding, dilation, groups = _conv_args(call)
    if groups != 1 or spatial > 2:
        raise Decline("a grouped or 3-d convolution")
    xf, gi = _images(call, x, g, spatial)  # (n, a, c, *s), (n, 1, a, o, *s')
    n, a, o = gi.shape[0], gi.shape[2], gi.shape[3]
    gm = gi.reshape(n, a, o, -1).transpose(2, 3).reshape(n, -1, o)  # (n, a*t, o)
    return w, b, xf, gm, (stride, padding, dilation)


def _patch_rows(xf: Tensor, w: Tensor, stride, padding, dilation) -> Tensor:
    """``(n, a*t, c*k)``: each output position's input patch."""
    xp, stride, padding, dilation = _prepared(xf, w.shape, stride, padding, dilation)
    cols = _patches(xp, list(w.shape[2:]), stride, padding, dilation)  # (n, a, ck, t)
    return cols.transpose(2, 3).reshape(cols.shape[0], -1, cols.shape[2])


def conv_sum(call: OpCall, g: Tensor, c: Tensor, into: dict[Tensor, Tensor]) -> None:
    """Adds ``sum_n c_n grad_n`` for backprops ``g (n, 1, *out)`` and factors ``c (n,)``:
    the ordinary weight gradient of the convolution backward over all images at once,
    for the backprops scaled per sample."""
    g = g * c.view(-1, *[1] * (g.dim() - 1))
    for t, value in _summed(call, g, set(into)).items():
        into[t].add_(value.view(into[t].shape))


def _summed(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Tensor]:
    """The summed weight and bias gradients for backprops ``g (n, 1, *out)``."""
    spatial = _CONVS[call.func][0]
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    xf, gi = _images(call, x, g, spatial)  # (n, a, c, *s), (n, 1, a, o, *s')
    stride, padding, dilation, groups = _conv_args(call)
    xp, stride, padding, dilation = _prepared(xf, w.shape, stride, padding, dilation)
    images = gi[:, 0].flatten(0, 1)  # (n*a, o, *s')
    result = {}
    if w in wanted and spatial <= 2 and choose(gi, w.shape, groups) == "patches":
        o, ck = w.shape[0], w.shape[1:].numel()  # few positions: one GEMM over all patches
        cols = _patches(xp, list(w.shape[2:]), stride, padding, dilation)  # (n, a, ck, t)
        gm = images.flatten(2).transpose(1, 2).reshape(-1, o)  # (n*a*t, o)
        result[w] = (gm.T @ cols.transpose(2, 3).reshape(-1, ck)).view(w.shape)
    elif w in wanted:
        result[w] = torch.ops.aten.convolution_backward(
            images, xp.flatten(0, 1), w, None, stride, padding, dilation, False,
            [0] * spatial, groups, [False, True, False])[1]
    if b is not None and b in wanted:
        result[b] = images.sum((0, *range(2, images.dim())))
    return result


CONV = register(OpSpec(tuple(f for f, (_, t) in _CONVS.items() if not t), grad=conv,
                       norm=conv_norm, sum=conv_sum, curvature_factors=conv_factors))
CONV_TRANSPOSE = register(OpSpec(tuple(f for f, (_, t) in _CONVS.items() if t), grad=conv))
