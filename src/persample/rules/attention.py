"""Per-sample gradients of ``nn.MultiheadAttention``.

Every parameter of the module enters through a linear map (or a concatenation),
so, as for a Linear layer, its per-sample gradient is a sum over positions of
outer products of backprops and inputs (Goodfellow 2015, seed 004):

- ``grad W_q[n] = sum_t dq[n, t]^T query[n, t]`` (likewise ``k``, ``v``; the three
  blocks of ``in_proj_weight``, or ``q/k/v_proj_weight`` when ``kdim != embed_dim``),
  ``grad b_q[n] = sum_t dq[n, t]``;
- ``grad W_o[n] = sum_t g[n, t]^T ctx[n, t]``, ``grad b_o[n] = sum_t g[n, t]`` for
  ``out_proj`` (read inside the module without calling it), with ``g`` the
  captured backprops of the attention output;
- ``bias_k``, ``bias_v``: the backprops of the appended key / value position.

Nothing is recomputed: during the captured forward, :func:`capture_forward`
computes ``F.multi_head_attention_forward`` itself from the same equations,
keeping the projections ``q, k, v`` and the attention output ``ctx`` in the
graph, so the one main backward also gives ``dq, dk, dv`` ("capture, don't
re-derive", DESIGN.md point 1). Index conventions: ``n`` sample, ``v``
cotangent, ``t`` query position, ``s`` key position, ``h`` head.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..fallback import UnsupportedModuleError
from . import register_rule
from .linear import sum_outer_into


def _dropout(layer: nn.MultiheadAttention) -> str | None:
    """Dropout in training mode draws a random mask: the per-module fallback then."""
    if layer.dropout > 0 and layer.training:
        return "attention dropout in training mode (a random mask): the torch.func fallback"
    return None


def _mask(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """A boolean mask (True: not allowed) as an additive float mask."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(like.dtype)
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
        mask, float("-inf"))


def _attend(layer: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor, extra: list[Tensor],
            key_padding_mask, attn_mask, average: bool, weights: bool
            ) -> tuple[Tensor, Tensor | None]:
    """``ctx (N, T, E)`` before ``out_proj`` and (if ``weights``) the attention weights
    ``(N, h, T, S)`` or their mean over heads."""
    n, t, e = q.shape
    heads = layer.num_heads
    mask_t = _mask(attn_mask, q)  # (T, S) or (N * h, T, S)
    pad = _mask(key_padding_mask, q)  # (N, S)
    if extra:  # bias_k, bias_v: one more key / value position
        k, v = torch.cat([k, extra[0]], 1), torch.cat([v, extra[1]], 1)
        mask_t = None if mask_t is None else F.pad(mask_t, (0, 1))
        pad = None if pad is None else F.pad(pad, (0, 1))
    if layer.add_zero_attn:
        k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
        mask_t = None if mask_t is None else F.pad(mask_t, (0, 1))
        pad = None if pad is None else F.pad(pad, (0, 1))
    split = lambda x: x.unflatten(2, (heads, -1)).transpose(1, 2)  # (N, h, L, d)  # noqa: E731
    mask = None  # additive, broadcastable to (N, h, T, S)
    if mask_t is not None:
        mask = mask_t.reshape(-1, heads, *mask_t.shape[-2:]) if mask_t.dim() == 3 else mask_t
    if pad is not None:
        mask = pad[:, None, None, :] if mask is None else mask + pad[:, None, None, :]
    if not weights:  # the fused kernel, forward and backward
        ctx = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return ctx.transpose(1, 2).flatten(2), None  # (N, T, E)
    scores = split(q) @ split(k).transpose(2, 3) / math.sqrt(e // heads)  # (N, h, T, S)
    probs = (scores if mask is None else scores + mask).softmax(-1)
    ctx = (probs @ split(v)).transpose(1, 2).flatten(2)  # (N, T, E)
    return ctx, probs.mean(1) if average else probs


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def capture_forward(call, func, args: tuple, kwargs: dict) -> tuple | None:
    """During the capture, ``F.multi_head_attention_forward`` decomposed into the same
    equations, keeping ``q, k, v`` (and the per-sample copies of ``bias_k/v``) in the
    graph as ``call.extras``, so that the main backward gives their backprops and the
    rule need not recompute the attention. ``None``: another op, or a case left to
    PyTorch (static keys, dropout in training, unbatched inputs)."""
    if func is not F.multi_head_attention_forward:
        return None
    a = _MHA_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    if (a["static_k"] is not None or a["static_v"] is not None or a["query"].dim() != 3
            or (a["training"] and a["dropout_p"] > 0)
            or (a["is_causal"] and a["attn_mask"] is None)):
        return None
    q_in, k_in, v_in = (a[name].transpose(0, 1) for name in ("query", "key", "value"))
    e, n = a["embed_dim_to_check"], q_in.shape[0]
    weights = ([a[f"{x}_proj_weight"] for x in "qkv"] if a["use_separate_proj_weight"]
               else a["in_proj_weight"].split(e))
    biases = [None] * 3 if a["in_proj_bias"] is None else a["in_proj_bias"].split(e)
    q, k, v = (F.linear(x, w, b) for x, w, b in zip((q_in, k_in, v_in), weights, biases))
    extra = [] if a["bias_k"] is None else [
        b.reshape(1, 1, -1).expand(n, 1, -1) for b in (a["bias_k"], a["bias_v"])]
    ctx, probs = _attend(call.module, q, k, v, extra, a["key_padding_mask"], a["attn_mask"],
                         a["average_attn_weights"], bool(a["need_weights"]))
    call.extras = [q, k, v, *extra]  # (n, L, E) each
    call.saved = ctx  # (n, T, E), for out_proj's gradient
    out = F.linear(ctx, a["out_proj_weight"], a["out_proj_bias"])  # (n, T, E)
    return out.transpose(0, 1), probs


@register_rule(nn.MultiheadAttention, unsupported=_dropout, multi_output=True, nested=True,
               capture=capture_forward)
def multihead_attention(layer: nn.MultiheadAttention, activations: tuple,
                        backprops: list[Tensor], out: dict, extras: list[Tensor] | None = None,
                        saved: Tensor | None = None):
    """Per-sample gradients of every parameter, ``out_proj``'s included, from the
    backprops of the projections kept by :func:`capture_forward` (``extras``)."""
    if not extras:
        raise UnsupportedModuleError(
            "the attention's projections were not captured (F.multi_head_attention_forward "
            "was not called with these arguments during the forward); use method='vmap'")
    _from_captured(layer, activations, backprops, out, extras, saved)


def _from_captured(layer, activations: tuple, backprops: list[Tensor], out: dict,
                   extras: list[Tensor], ctx: Tensor) -> None:
    """Backprops ``[output, (weights), q, k, v, (bias_k, bias_v)]``, ``(n, v, ...)``."""
    dq, dk, dv, *dextra = backprops[-len(extras):]
    _write_projections(layer, out, [dq, dk, dv], list(activations[:3]))
    g_out = backprops[0]  # (n, v, T, E)
    if "out_proj.weight" in out:
        sum_outer_into(g_out, ctx.detach(), out["out_proj.weight"])
    if "out_proj.bias" in out:
        torch.sum(g_out, dim=2, out=out["out_proj.bias"])
    for name, g in zip(("bias_k", "bias_v"), dextra):
        if name in out:  # g: (n, v, 1, E) -> (n, v, 1, 1, E)
            out[name].copy_(g.reshape(out[name].shape))


def _write_projections(layer, out: dict, grads: list, inputs: list) -> None:
    """``grads`` ``(n, v, L, E)`` of q, k, v (zeros where unused); ``inputs``
    ``(n, L, in)``: the blocks of the projection weights (``sum_l g^T x``) and of
    ``in_proj_bias`` (``sum_l g``)."""
    e = layer.embed_dim
    if layer._qkv_same_embed_dim:
        names = [("in_proj_weight", slice(k * e, (k + 1) * e)) for k in range(3)]
    else:
        names = [(f"{p}_proj_weight", slice(None)) for p in "qkv"]
    for k, (g, x) in enumerate(zip(grads, inputs)):
        weight, rows = names[k]
        if weight in out:
            sum_outer_into(g, x.detach(), out[weight][:, :, rows])  # (n, v, E, in)
        if "in_proj_bias" in out:
            torch.sum(g, dim=2, out=out["in_proj_bias"][:, :, k * e:(k + 1) * e])
