"""Per-sample gradients through ``F.scaled_dot_product_attention`` of the tensors made
of parameters it reads: a relative position bias as its mask (BEiT's, Swin's), a learned
query (attention pooling: timm's MAP head, Set Transformer's PMA, Perceiver's latents),
keys and values of a prefix.

With ``S = s q k^T + m`` (``s`` the scale, ``1/sqrt(E)`` by default; ``m`` the additive
mask, ``-inf`` where a boolean one forbids or above the diagonal where causal), ``P =
softmax(S)`` along the keys and ``y = P v`` (Vaswani et al. 2017), the backprops ``g``
of ``y`` give, for each sample (Dao et al. 2022, the attention backward):

- ``dv = P^T g``, ``dP = g v^T``, ``dS = P * (dP - rowsum(dP * P))``;
- ``dq = s dS k``, ``dk = s dS^T q``, ``dm = dS``;

each summed over the dims that input was broadcast over (a bias shared by every sample:
its own shape; paired with the samples: its per-sample shape). With ``enable_gqa``
each group of query heads reads one key head (``repeat_interleave``), whose gradient
sums the group's. A row every key of which is masked gets zero weights (PyTorch's
``_safe_softmax``, as the op's own math). The attention's dropout (``dropout_p > 0``)
and a boolean mask asked for its gradient decline: the exact per-op VJP then takes the
call.

Index conventions: ``n`` sample, ``v`` cotangent, ``...`` the per-sample leading dims
(heads), ``L`` queries, ``S`` keys, ``E`` their width, ``Ev`` the values'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .calls import OpCall, operand, write_reduced
from .spec import Decline, OpSpec, register

_safe_softmax = getattr(torch.ops.aten, "_safe_softmax", None)


def sdpa(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = softmax(s q k^T + m) v``: see the module docstring. ``g (n, v, ..., L, Ev)``."""
    q, k, v = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
    mask = call.arg(3, "attn_mask")
    if call.arg(4, "dropout_p", 0.0):
        raise Decline("attention dropout")
    call.only(out, q, k, v, mask)
    if isinstance(mask, Tensor) and mask in out and not mask.is_floating_point():
        raise Decline("a boolean mask")
    for t in (q, k, v):
        lay = call.pairing(t)
        if lay is not None and lay.dim >= t.dim() - 2:
            raise Decline("samples along the positions")
    rank = g.dim() - 2
    qs, ks, vs = (operand(call, t, rank) for t in (q, k, v))  # (n, 1, ..., L|S, E|Ev)
    heads, groups = qs.shape[-3] if qs.dim() >= 3 else 1, 1
    if call.arg(7, "enable_gqa", False) and ks.dim() >= 3 and ks.shape[-3] != heads:
        groups = heads // ks.shape[-3]
        ks, vs = ks.repeat_interleave(groups, -3), vs.repeat_interleave(groups, -3)
    scale = call.arg(6, "scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = qs @ ks.transpose(-2, -1) * scale  # (n|1, 1, ..., L, S)
    if call.arg(5, "is_causal", False):
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=g.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if isinstance(mask, Tensor):
        m = operand(call, mask, rank)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else (
            scores + m)
    probs = _safe_softmax(scores, -1) if _safe_softmax is not None else (
        torch.softmax(scores, -1).nan_to_num(0.0))  # (n|1, 1, ..., L, S)
    d_probs = g @ vs.transpose(-2, -1)  # (n, v, ..., L, S)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
    wanted = [(q, lambda: d_scores @ ks * scale),  # (one tensor at two places, q = k,
              # is not given to a rule: the engine takes the op's VJP)
              (k, lambda: _grouped(d_scores.transpose(-2, -1) @ qs * scale, groups)),
              (v, lambda: _grouped(probs.transpose(-2, -1) @ g, groups)),
              (mask, lambda: d_scores)]
    for t, grad in wanted:
        if isinstance(t, Tensor) and t in out:
            write_reduced(call, out, t, grad())


def _grouped(grad: Tensor, groups: int) -> Tensor:
    """A key or value head's gradient: the sum over the query heads that read it."""
    if groups == 1:
        return grad
    return grad.unflatten(-3, (-1, groups)).sum(-3)  # (..., Hk, groups, S, E)


SDPA = register(OpSpec((F.scaled_dot_product_attention,), grad=sdpa))
