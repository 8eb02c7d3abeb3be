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

The backprops ``dq, dk, dv`` of the projections come from one backward of the
captured backprops through the attention recomputed from the projections (the
equations of ``F.multi_head_attention_forward``), batched over samples.
Index conventions: ``n`` sample (times ``v`` cotangents, folded into one batch
``N``), ``t`` query position, ``s`` key position, ``h`` head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import register_rule

# forward(query, key, value, key_padding_mask, need_weights, attn_mask,
#         average_attn_weights, is_causal)
_DEFAULTS = (None, None, None, None, True, None, True, False)


def _dropout(layer: nn.MultiheadAttention) -> str | None:
    if layer.dropout > 0 and layer.training:
        return "attention dropout in training mode (a random mask): the torch.func fallback"
    return None


def _arguments(activations: tuple) -> tuple:
    return tuple(activations) + _DEFAULTS[len(activations):]


def _mask(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """A boolean mask (True: not allowed) as an additive float mask."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(like.dtype)
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
        mask, float("-inf"))


def _projections(layer: nn.MultiheadAttention, q_in, k_in, v_in) -> list[Tensor]:
    """``q, k, v`` ``(N, L, E)``: leaves of the local graph."""
    e = layer.embed_dim
    b = layer.in_proj_bias
    bias = [None] * 3 if b is None else b.detach().split(e)
    if layer._qkv_same_embed_dim:
        weights = layer.in_proj_weight.detach().split(e)
    else:
        weights = [layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight]
    return [F.linear(x, w.detach(), bb).requires_grad_()
            for x, w, bb in zip((q_in, k_in, v_in), weights, bias)]


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


@register_rule(nn.MultiheadAttention, unsupported=_dropout, multi_output=True, nested=True)
def multihead_attention(layer: nn.MultiheadAttention, activations: tuple,
                        backprops: list[Tensor], out: dict):
    """Per-sample gradients of every parameter, ``out_proj``'s included."""
    query, key, value, key_padding_mask, need_weights, attn_mask, average, _ = _arguments(
        activations)
    n, v = backprops[0].shape[:2]
    rep = lambda x: None if x is None else (  # noqa: E731
        x.detach() if v == 1 else x.detach().repeat_interleave(v, 0))
    q_in, k_in, v_in = rep(query), rep(key), rep(value)
    key_padding_mask = rep(key_padding_mask)
    if attn_mask is not None and attn_mask.dim() == 3:  # (n * h, T, S) -> (n * v * h, T, S)
        attn_mask = rep(attn_mask.unflatten(0, (n, -1))).flatten(0, 1)
    g_out = backprops[0].flatten(0, 1)  # (N, T, E)
    with torch.enable_grad():
        q, k, val = _projections(layer, q_in, k_in, v_in)
        extra = [] if layer.bias_k is None else [
            b.detach().reshape(1, 1, -1).repeat(len(q), 1, 1).requires_grad_()
            for b in (layer.bias_k, layer.bias_v)]
        use_weights = bool(need_weights) and len(backprops) > 1
        ctx, weights = _attend(layer, q, k, val, extra, key_padding_mask, attn_mask, average,
                               use_weights)
        outputs, grads = [ctx], [g_out @ layer.out_proj.weight.detach()]  # dctx (N, T, E)
        if use_weights:
            outputs.append(weights)
            grads.append(backprops[1].flatten(0, 1))
        dq, dk, dv, *dextra = torch.autograd.grad(outputs, [q, k, val, *extra], grads,
                                                  allow_unused=True)
    _write_projections(layer, out, [dq, dk, dv], [q_in, k_in, v_in], n, v)
    _outer("out_proj.weight", "out_proj.bias", out, g_out, ctx.detach(), n, v)
    for name, d in zip(("bias_k", "bias_v"), dextra):
        if name in out:
            out[name].copy_(_zero_if_none(d, extra[0]).reshape(n, v, *out[name].shape[2:]))


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def _write_projections(layer, out: dict, grads: list, inputs: list, n: int, v: int) -> None:
    e = layer.embed_dim
    grads = [_zero_if_none(g, x[..., :1].expand(*x.shape[:-1], e)) for g, x in zip(grads, inputs)]
    if layer._qkv_same_embed_dim:
        names = [("in_proj_weight", slice(k * e, (k + 1) * e)) for k in range(3)]
    else:
        names = [(f"{p}_proj_weight", slice(None)) for p in "qkv"]
    for k, (g, x) in enumerate(zip(grads, inputs)):
        weight, rows = names[k]
        if weight in out:  # (n, v, E, in) block of the weight
            block = torch.bmm(g.transpose(1, 2), x)  # (N, E, in)
            out[weight][:, :, rows].copy_(block.unflatten(0, (n, v)))
        if "in_proj_bias" in out:
            out["in_proj_bias"][:, :, k * e:(k + 1) * e].copy_(g.sum(1).unflatten(0, (n, v)))


def _outer(weight: str, bias: str, out: dict, g: Tensor, a: Tensor, n: int, v: int) -> None:
    """``sum_t g^T a`` and ``sum_t g`` over positions: ``g (N, T, O)``, ``a (N, T, I)``."""
    if weight in out:
        out[weight].copy_(torch.bmm(g.transpose(1, 2), a).unflatten(0, (n, v)))
    if bias in out:
        out[bias].copy_(g.sum(1).unflatten(0, (n, v)))
