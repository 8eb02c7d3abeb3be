"""Per-sample gradients of ``nn.Embedding`` and ``nn.EmbeddingBag``.

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position inside a sample
(all index dims after the batch, flattened), ``r`` row of the table, ``d``
embedding dim.

Embedding: ``grad_W[n, v, r] = sum_{t: ids[n, t] = r} g[n, v, t]``: a scatter-add
of the backprops into a zeroed ``(n, v, r, d)`` destination. The row
``padding_idx`` gets no gradient, as in ``F.embedding``.

EmbeddingBag: each bag is a sample (a row of a 2-d input, or the positions
between two offsets of a 1-d input), ``g[n, v, d]`` its backprops, ``t`` now the
positions of the flat input and ``n(t)`` the bag of position ``t``:

- ``sum``: ``grad_W[n(t), v, ids[t]] += w[t] * g[n(t), v]`` (``w`` the
  ``per_sample_weights``, or 1);
- ``mean``: the same with ``w[t] = 1 / size(n(t))``, the size counting the
  positions that are not ``padding_idx``;
- ``max``: ``grad_W[n, v, argmax[n, d], d] = g[n, v, d]`` for every non-empty bag,
  ``argmax[n, d]`` the row that gave the maximum (from ``torch.embedding_bag``).

Positions holding ``padding_idx`` contribute nothing.

Norm rule for EmbeddingBag (never the ``(n, r, d)`` gradients): with ``a[n, r]``
the summed weights of row ``r`` in bag ``n`` (sum and mean modes),
``|grad_W[n]|^2 = |g[n]|^2 sum_r a[n, r]^2``, the ``a`` found by sorting the
``(bag, row)`` pairs; in max mode every dim goes to one row, so
``|grad_W[n]|^2 = |g[n]|^2`` for a non-empty bag.
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


_MAX_MODE = 2  # torch.embedding_bag's code for mode="max"


def _bag_unsupported(layer: nn.EmbeddingBag) -> str | None:
    """``scale_grad_by_freq`` (gradients divided by each id's count in its bag) is left
    to the torch.func fallback, which gets it right sample by sample."""
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq=True"
    return None


def flat_bags(layer: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None,
              weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """The call's bags as ``F.embedding_bag`` sees them: ``ids (T,)``, ``offsets``,
    ``weights (T,)`` or ``None``, ``include_last_offset``; a 2-d input ``(n, L)`` is
    ``n`` bags of ``L`` positions."""
    if ids.dim() == 2:
        n, length = ids.shape
        offsets = torch.arange(0, n * length, length, dtype=ids.dtype, device=ids.device)
        return ids.reshape(-1), offsets, None if weights is None else weights.reshape(-1), False
    return ids, offsets, weights, layer.include_last_offset


def bag_of_positions(offsets: Tensor, positions: int, bags: int) -> Tensor:
    """``(T,)``: the bag of each position, ``offsets`` holding the bags' starts.

    Positions after the last start belong to the last bag, as in the CPU kernel
    (also with ``include_last_offset``, where ``offsets[bags]`` should be ``T``).
    """
    t = torch.arange(positions, dtype=offsets.dtype, device=offsets.device)
    bag = torch.searchsorted(offsets[:bags].contiguous(), t, right=True) - 1
    return bag.clamp_(0, bags - 1)


def _bag_weights(layer: nn.EmbeddingBag, activations: tuple, n: int, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kept positions ``(bag (T',), ids (T',), coef (T',))`` and each bag's size ``(n,)``:
    ``grad_W[bag_t, ids_t] += coef_t * g[bag_t]`` (sum and mean modes)."""
    args = list(activations) + [None] * (3 - len(activations))
    ids, offsets, weights, _ = flat_bags(layer, *args[:3])  # ids (T,)
    bag = bag_of_positions(offsets, ids.numel(), n)  # (T,)
    keep = torch.ones_like(ids, dtype=torch.bool) if layer.padding_idx is None else (
        ids != layer.padding_idx)  # (T,)
    size = torch.zeros(n, dtype=dtype, device=ids.device).index_add_(0, bag, keep.to(dtype))
    if layer.mode == "mean":
        coef = size.reciprocal()[bag]  # (T,); a bag holding a kept position has size > 0
    else:
        coef = torch.ones_like(bag, dtype=dtype) if weights is None else weights.to(dtype)
    return bag[keep], ids[keep], coef[keep], size


@register_rule(nn.EmbeddingBag, unsupported=_bag_unsupported)
def embedding_bag(layer: nn.EmbeddingBag, activations: tuple, backprops: Tensor, out: dict):
    """``activations``: ``(ids, offsets, per_sample_weights)`` (trailing ones may be
    missing), ``backprops (n, v, d)`` for ``n`` bags; ``out["weight"] (n, v, r, d)``."""
    if "weight" not in out:
        return
    n, v, d = backprops.shape  # n bags
    dst = out["weight"]  # (n, v, r, d)
    dst.zero_()
    if n == 0 or activations[0].numel() == 0:
        return
    bag, ids, coef, size = _bag_weights(layer, activations, n, backprops.dtype)  # (T',) x 3
    if layer.mode == "max":
        _max_into(layer, activations, backprops, size > 0, dst)
        return
    cots = torch.arange(v, device=ids.device).view(1, v)  # (1, v)
    values = backprops[bag] * coef.view(-1, 1, 1)  # (T', v, d)
    dst.index_put_((bag.view(-1, 1), cots, ids.view(-1, 1)), values, accumulate=True)


def _max_into(layer: nn.EmbeddingBag, activations: tuple, g: Tensor, nonempty: Tensor,
              dst: Tensor) -> None:
    """``dst[n, v, argmax[n, d], d] = g[n, v, d]`` for the non-empty bags; ``dst`` zeroed."""
    n, v, d = g.shape
    args = list(activations) + [None] * (3 - len(activations))
    ids, offsets, _, last = flat_bags(layer, *args[:3])
    argmax = torch.embedding_bag(layer.weight.detach(), ids, offsets, False, _MAX_MODE,
                                 False, None, last, layer.padding_idx)[3]  # (n, d) rows
    g = g * nonempty.view(n, 1, 1)  # an empty bag's argmax is meaningless (0)
    dst.scatter_add_(2, argmax.view(n, 1, 1, d).expand(n, v, 1, d), g.unsqueeze(2))


@register_norm_rule(nn.EmbeddingBag)
def embedding_bag_norm(layer: nn.EmbeddingBag, activations: tuple, backprops: Tensor,
                       names: set[str]) -> dict[str, Tensor]:
    """``|grad_W[n]|^2 = |g[n]|^2 sum_r a[n, r]^2`` (max mode: ``|g[n]|^2``, non-empty bags),
    in ``O(T log T)`` for ``T`` positions instead of ``O(n r d)``."""
    if "weight" not in names:
        return {}
    n = backprops.shape[0]
    g2 = backprops.reshape(n, -1).square().sum(1)  # (n,)
    if n == 0 or activations[0].numel() == 0:
        return {"weight": torch.zeros_like(g2)}
    bag, ids, coef, size = _bag_weights(layer, activations, n, backprops.dtype)  # (T',) x 3
    if layer.mode == "max":
        return {"weight": g2 * (size > 0)}
    pairs, which = torch.unique(bag * layer.num_embeddings + ids, return_inverse=True)  # (P,)
    a = torch.zeros(len(pairs), dtype=coef.dtype, device=coef.device).index_add_(
        0, which, coef)  # (P,) a[bag, row] of each distinct pair
    a2 = torch.zeros_like(g2).index_add_(0, pairs // layer.num_embeddings, a.square())  # (n,)
    return {"weight": g2 * a2}
