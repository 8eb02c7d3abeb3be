"""Per-sample gradients of ``nn.Embedding``.

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position inside a sample
(all index dims after the batch, flattened), ``r`` row of the table, ``d``
embedding dim.

``grad_W[n, v, r] = sum_{t: ids[n, t] = r} g[n, v, t]``: a scatter-add of the
backprops into a zeroed ``(n, v, r, d)`` destination. The row ``padding_idx``
gets no gradient, as in ``F.embedding``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_norm_rule, register_rule


def _unsupported(layer: nn.Embedding) -> str | None:
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq=True"
    return None


@register_rule(nn.Embedding, unsupported=_unsupported)
def embedding(layer: nn.Embedding, activations: tuple, backprops: Tensor, out: dict):
    if "weight" not in out:
        return
    n, v = backprops.shape[:2]
    ids = activations[0].reshape(n, 1, -1)  # (n, 1, t)
    g = backprops.reshape(n, v, ids.shape[2], layer.embedding_dim)  # (n, v, t, d)
    rows = torch.arange(n, device=ids.device).view(n, 1, 1)  # (n, 1, 1)
    cots = torch.arange(v, device=ids.device).view(1, v, 1)  # (1, v, 1)
    dst = out["weight"]  # (n, v, r, d)
    dst.zero_()
    dst.index_put_((rows, cots, ids), g, accumulate=True)
    if layer.padding_idx is not None:
        dst[:, :, layer.padding_idx].zero_()


@register_norm_rule(nn.Embedding)
def embedding_norm(layer: nn.Embedding, activations: tuple, backprops: Tensor, names: set[str]):
    """``|grad_W[n]|^2 = sum_{t,s: ids_t = ids_s} g_t . g_s`` (cost ``n T^2 d``), or
    ``None`` (materialise, ``n r d``) when the table is smaller than ``T^2``."""
    n = backprops.shape[0]
    ids = activations[0].reshape(n, -1)  # (n, t)
    t = ids.shape[1]
    if "weight" not in names:
        return {}
    if t * t >= layer.num_embeddings:
        return None
    g = backprops.reshape(n, t, layer.embedding_dim)  # (n, t, d)
    if layer.padding_idx is not None:
        g = g * (ids != layer.padding_idx).unsqueeze(2)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # (n, t, t)
    return {"weight": (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))}
