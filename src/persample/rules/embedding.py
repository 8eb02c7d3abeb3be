"""Per-sample gradients of ``nn.Embedding``.

Index conventions: ``n`` sample, ``t`` position inside a sample (all index dims
after the batch, flattened), ``v`` row of the table, ``d`` embedding dim.

``grad_W[n, v] = sum_{t: ids[n, t] = v} g[n, t]``: a scatter-add of the
backprops into a zeroed ``(n, v, d)`` destination. The row ``padding_idx``
gets no gradient, as in ``F.embedding``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_rule


def _unsupported(layer: nn.Embedding) -> str | None:
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq=True"
    return None


@register_rule(nn.Embedding, unsupported=_unsupported)
def embedding(layer: nn.Embedding, activations: tuple, backprops: Tensor, out: dict):
    if "weight" not in out:
        return
    ids = activations[0]  # (n, *)
    n = ids.shape[0]
    ids = ids.reshape(n, -1)  # (n, t)
    g = backprops.reshape(n, ids.shape[1], -1)  # (n, t, d)
    dst = out["weight"]  # (n, v, d)
    dst.zero_()
    rows = torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids)  # (n, t)
    dst.index_put_((rows, ids), g, accumulate=True)
    if layer.padding_idx is not None:
        dst[:, layer.padding_idx].zero_()
