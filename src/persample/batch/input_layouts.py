"""The layouts of the model's inputs: where each input tensor holds its samples.

:mod:`persample.inputs` reads what the user passed and says where the samples are in
plain terms (a dim, and for packed forms the sample of each row); this module makes the
layouts the capture starts from of them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..inputs import Batch, Part, parts_of
from .layouts import Batched, Layout, indexed


def layout_of(part: Part, n: int) -> tuple[Tensor, Layout]:
    """``(tensor, layout)`` of one input part ``(tensor, dim, rows)``."""
    t, dim, rows = part
    return t, Batched(dim) if rows is None else indexed(dim, rows, n)


def located(batch: Batch) -> list[tuple[Tensor, Layout]]:
    """Every input tensor carrying samples, with its layout.

    Examples:
        >>> import torch
        >>> from persample.inputs import as_batch
        >>> [lay for _, lay in located(as_batch((torch.zeros(4, 3), torch.zeros(1, 3))))]
        [Batched(dim=0)]
    """
    return [layout_of(part, batch.n) for part in batch.parts()]


def located_of(x: Any, n: int) -> list[tuple[Tensor, Layout]]:
    """The tensors of ``x`` (targets) that carry samples, with their layouts: those with
    ``n`` rows in dim 0, and the packed forms' per-sample tensors."""
    return [layout_of(part, n) for part in parts_of(x, n)]
