"""The layout of every tensor of one forward, by identity, holding no tensor alive.

A tensor's layout is decided once, when the op that made it runs
(:func:`persample.batch.flow.propagate`), and kept here until the tensor dies. An
in-place op changes a tensor's layout in place too: a shared tensor written with sample
data marks its storage, so that every alias of it (a view, a ``detach()``) reads as
Unknown from then on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from .layouts import SHARED, Layout, Mixed, Unknown

MISSING = Unknown("a tensor made outside the captured ops (a custom autograd Function, "
                  "TorchScript, or a tensor kept from before: one with no gradient path "
                  "is read as shared by the next call that finds it unchanged)")
"""The layout of a tensor the table never saw made."""


class LayoutTable:
    """Layouts by tensor identity: ``id -> (weak ref, layout)``, an entry valid while its
    tensor lives (a dead tensor's id may be reused). A plain dict of weak references:
    several times cheaper per op than ``WeakIdKeyDictionary``.

    Examples:
        >>> import torch
        >>> from persample.batch import Batched
        >>> table, x = LayoutTable(), torch.zeros(2, 3)
        >>> table[x] = Batched(0)
        >>> table.layout(x), table.layout(torch.zeros(1)) is MISSING
        (Batched(dim=0), True)
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, Layout]] = {}
        # storages of shared tensors written with samples, kept alive (so that no new tensor
        # is allocated at their address while the table is in use), with the layout of the
        # data the first such write put there
        self.contaminated: dict[int, tuple[Any, Layout]] = {}
        # the layout of a tensor never set here, where another record has it (a cached
        # call's numbered tensors: persample.capture.lean), else None
        self.fallback: Callable[[Tensor], Layout | None] | None = None

    def __setitem__(self, t: Tensor, layout: Layout) -> None:
        self._by_id[id(t)] = (weakref.ref(t), layout)

    def layout(self, t: Tensor) -> Layout:
        """``t``'s layout (:data:`MISSING` if never set; a shared tensor whose storage was
        later written with sample data is Unknown)."""
        entry = self._by_id.get(id(t))
        if entry is None or entry[0]() is not t:
            found = self.fallback(t) if self.fallback is not None else None
            return MISSING if found is None else found
        lay = entry[1]
        if lay is SHARED and self.contaminated:
            found = self.contaminated.get(storage_of(t))
            if found is not None:  # (data that mixes samples: that, by the op's name)
                return found[1] if isinstance(found[1], Mixed) else Unknown(
                    "a shared tensor later written in place with per-sample data")
        return lay

    def set_outputs(self, out: Any, layouts: Any) -> None:
        """The layouts of an op's outputs (a tensor, or a tuple/list of them)."""
        if isinstance(out, Tensor):
            self[out] = layouts
        elif isinstance(out, (tuple, list)):
            lays = layouts if isinstance(layouts, tuple) else (layouts,) * len(out)
            for o, lay in zip(out, lays):
                if isinstance(o, Tensor):
                    self[o] = lay

    def written(self, target: Tensor, layout: Layout, out: Tensor | None = None) -> None:
        """An in-place op changed ``target``'s data: its new layout (and that of ``out``,
        the op's output, where it is another tensor); a shared tensor that now holds
        sample data marks its storage, for its aliases."""
        old = self.layout(target)
        if old is SHARED and layout is not SHARED:
            self.contaminated.setdefault(storage_of(target),
                                         (target.untyped_storage(), layout))
        self[target] = layout
        if out is not None and out is not target:
            self[out] = layout


def storage_of(t: Tensor) -> int:
    """The address of ``t``'s storage (0 where it has none to read)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
