"""``nn.MultiheadAttention`` by its ops: ``F.multi_head_attention_forward`` expanded.

During the capture, ``F.multi_head_attention_forward`` (which ``nn.MultiheadAttention``,
hence ``nn.Transformer*`` layers, call) runs as the equations it is made of, each
op captured: the input projections as ``F.linear`` (one for self-attention with
the packed ``in_proj_weight``, or one per block of it), the attention
(``F.scaled_dot_product_attention``, or the explicit softmax when the weights are
returned), the output projection as ``F.linear``. Every parameter then takes an
op rule (``linear.py``; ``bias_k``/``bias_v`` the shift rule), with backprops from
the one main backward: nothing is recomputed, and no module rule is needed.

In training mode the attention dropout is the same op on weights of the same shape as
PyTorch's (``scaled_dot_product_attention``'s ``dropout_p``, or ``F.dropout`` of the
returned weights), so it draws the same numbers; they are recorded like every draw
(:mod:`persample.draws`). Cases left whole (static keys, unbatched inputs) take the
exact per-sample vector-Jacobian product of the op.

``nn.TransformerEncoder`` in eval mode may turn a padded batch into a nested tensor
on a path the capture never takes; where a sample alone would take it, the engine
refuses (:func:`nested_fast_path`).
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import NeedsWholeModel
from .spec import OpSpec, register


def _mask(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """A boolean mask (True: not allowed) as an additive float mask."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(like.dtype)
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
        mask, float("-inf"))


def _extend(x: Tensor, row: Tensor | None) -> Tensor:
    """``x (N, L, E)`` with one more position: ``row (E,)``, or zeros."""
    padded = F.pad(x, (0, 0, 0, 1))  # (N, L + 1, E)
    if row is None:
        return padded
    last = F.pad(row.reshape(1, 1, -1), (0, 0, x.shape[1], 0))  # (1, L + 1, E)
    return padded + last


def _attend(heads: int, q: Tensor, k: Tensor, v: Tensor, bias_k, bias_v, zero_attn: bool,
            key_padding_mask, attn_mask, average: bool, weights: bool, dropout_p: float
            ) -> tuple[Tensor, Tensor | None]:
    """``ctx (N, T, E)`` before ``out_proj``, and (if ``weights``) the attention weights
    ``(N, h, T, S)`` (after the dropout, as PyTorch returns them) or their mean over
    heads. The dropout draws what PyTorch's draws: the same op on weights of the same
    shape, ``(N, h, T, S)``, in the same order."""
    e = q.shape[2]
    mask_t = _mask(attn_mask, q)  # (T, S) or (N * h, T, S)
    pad = _mask(key_padding_mask, q)  # (N, S)
    extra = int(bias_k is not None) + int(zero_attn)
    if bias_k is not None:  # one more key / value position
        k, v = _extend(k, bias_k), _extend(v, bias_v)
    if zero_attn:
        k, v = _extend(k, None), _extend(v, None)
    if extra:
        mask_t = None if mask_t is None else F.pad(mask_t, (0, extra))
        pad = None if pad is None else F.pad(pad, (0, extra))
    split = lambda x: x.unflatten(2, (heads, -1)).transpose(1, 2)  # (N, h, L, d)  # noqa: E731
    mask = None  # additive, broadcastable to (N, h, T, S)
    if mask_t is not None:
        mask = mask_t.unflatten(0, (-1, heads)) if mask_t.dim() == 3 else mask_t
    if pad is not None:
        mask = pad[:, None, None, :] if mask is None else mask + pad[:, None, None, :]
    if not weights:
        ctx = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask,
                                             dropout_p=dropout_p)
        return ctx.transpose(1, 2).flatten(2), None  # (N, T, E)
    scores = split(q) @ split(k).transpose(2, 3) / math.sqrt(e // heads)  # (N, h, T, S)
    probs = (scores if mask is None else scores + mask).softmax(-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    ctx = (probs @ split(v)).transpose(1, 2).flatten(2)  # (N, T, E)
    return ctx, probs.mean(1) if average else probs


_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def multi_head_attention(*args, **kwargs):
    """``F.multi_head_attention_forward`` as its equations (sequence-first inputs
    ``(T, N, E)``), or ``NotImplemented`` for the cases left whole."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if (a["static_k"] is not None or a["static_v"] is not None or a["query"].dim() != 3
            or (a["is_causal"] and a["attn_mask"] is None)):
        return NotImplemented
    query, key, value = a["query"], a["key"], a["value"]
    e, heads = a["embed_dim_to_check"], a["num_heads"]
    if a["use_separate_proj_weight"]:
        q, k, v = (F.linear(x.transpose(0, 1), a[f"{p}_proj_weight"], b)
                   for x, p, b in zip((query, key, value), "qkv", _biases(a, e)))
    elif query is key and key is value:  # self-attention: one projection
        qkv = F.linear(query.transpose(0, 1), a["in_proj_weight"], a["in_proj_bias"])
        q, k, v = qkv.chunk(3, dim=-1)
    else:
        weights = a["in_proj_weight"].split(e)
        q, k, v = (F.linear(x.transpose(0, 1), w, b)
                   for x, w, b in zip((query, key, value), weights, _biases(a, e)))
    ctx, probs = _attend(heads, q, k, v, a["bias_k"], a["bias_v"], a["add_zero_attn"],
                         a["key_padding_mask"], a["attn_mask"], a["average_attn_weights"],
                         bool(a["need_weights"]), a["dropout_p"] if a["training"] else 0.0)
    # (T, N, E), laid out in memory as PyTorch's is: a dropout after the attention fills
    # its mask in memory order, so other strides would draw another mask
    out = F.linear(ctx.transpose(0, 1), a["out_proj_weight"], a["out_proj_bias"])
    return out, probs


def _biases(a: dict, e: int) -> list:
    bias = a["in_proj_bias"]
    return [None] * 3 if bias is None else list(bias.split(e))


def nested_fast_path(src: Tensor, keep: Tensor, *args, **kwargs):
    """``nn.TransformerEncoder`` asks this before turning a padded batch into a nested
    tensor (eval mode, ``enable_nested_tensor``, a padding mask ``keep`` ``(B, T)``, True
    where kept). It converts only where no tensor of its fast path has a torch-function
    override, which persample's capture gives every tensor: under the capture the
    encoder takes its ordinary path, while the loop's sample alone takes the nested one,
    whose output is zero at the padded positions. Where the loop would (every condition
    of ``TransformerEncoder.forward`` met for some sample alone), the engine refuses;
    otherwise the call runs as it is."""
    frame = _caller(nn.TransformerEncoder.forward.__code__)
    if frame is None or not _fast_path_for_one(frame.f_locals, keep):
        return NotImplemented
    raise NeedsWholeModel(
        "nn.TransformerEncoder in eval mode with a src_key_padding_mask: PyTorch runs a "
        "sample whose padding is at its end through its fast path, which makes a nested "
        "tensor and gives zeros at the padded positions, but a batch under persample's "
        "capture takes the ordinary path (values at those positions), so the per-sample "
        "gradients would differ from the loop's. Build the encoder with "
        "enable_nested_tensor=False (or call torch.backends.mha.set_fastpath_enabled(False)) "
        "to use the rules; method='auto' takes the loop.")


def _caller(code) -> Any:
    """The nearest frame up the stack running ``code``, or ``None``."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _fast_path_for_one(found: dict, keep: Tensor) -> bool:
    """Would ``TransformerEncoder.forward`` (its locals ``found``) make a nested tensor
    for some sample alone: no attention mask, no autocast, no tensor of the first layer's
    fast path needing grad, and that sample's kept positions a prefix of its sequence?"""
    layer, src = found.get("first_layer"), found.get("src")
    if found.get("mask") is not None or torch.is_autocast_enabled() or not isinstance(
            src, Tensor) or keep.dim() != 2:
        return False
    attn = layer.self_attn
    tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
               attn.out_proj.bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
               layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
               layer.linear2.weight, layer.linear2.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    with torch._C.DisableTorchFunction():
        prefix = torch.arange(keep.shape[1], device=keep.device) < keep.sum(1, keepdim=True)
        return bool((keep == prefix).all(1).any())


MULTI_HEAD_ATTENTION = register(OpSpec((F.multi_head_attention_forward,),
                                       expand=multi_head_attention))
NESTED_FAST_PATH = register(OpSpec((torch._nested_tensor_from_mask_left_aligned,),
                                   expand=nested_fast_path))
