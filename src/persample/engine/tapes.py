"""The data flow of earlier calls, kept per model for the next call like them.

Each call of the engine on a model leaves the tape of its capture (its
:class:`~persample.capture.tape.Step` list) here, under the call's batch size and input
shapes; the next call with the same ones gives it to its capture, which takes each op's
layouts from the tape where the op matches its step (:mod:`persample.capture.tape`).
Nothing is kept on the model: tapes live in a weak dictionary keyed by the model
(dropped with it), a few per model.
:func:`clear_plans` forgets them all; :func:`cache_plans` turns keeping them off or on.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

from ..batch import Batched
from ..capture.compiled import _ENABLED as COMPILED_ON
from ..capture.compiled import Compiled
from ..capture.lean import Program
from ..capture.stock import Template
from ..capture.tape import Step

PER_MODEL = 8  # tapes kept per model (the most recently used)
COMPILE_AFTER = 2  # calls that ran a program before the forward is compiled
RETRY = 64  # a call whose program could not be kept: full calls before tracing again

_TAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {key: Template | Program | int}: calls of a stock model that may run
# unintercepted, calls that may run a program (persample.capture.lean), or how many more
# full captures before tracing one again
_STOCK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENABLED = [True]
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: calls}


def tape_for(model: nn.Module, key: tuple) -> list[Step | None] | None:
    """The tape of the last call on ``model`` with ``key``, if caching is on."""
    if not _ENABLED[0] or model is None:
        return None
    tapes = _TAPES.get(model)
    return tapes.get(key) if tapes is not None else None


def keep(model: nn.Module, key: tuple, tape: list[Step | None]) -> None:
    """Keep ``tape`` for the next call on ``model`` with ``key``."""
    if not _ENABLED[0] or model is None:
        return
    try:
        tapes = _TAPES.setdefault(model, {})
    except TypeError:  # (a model that cannot be weakly referenced: nothing kept)
        return
    tapes.pop(key, None)
    tapes[key] = tape
    while len(tapes) > PER_MODEL:
        tapes.pop(next(iter(tapes)))


def stock_for(model: nn.Module, key: tuple) -> Template | Program | int | None:
    """The template of the last call on ``model`` with ``key`` that may run unintercepted
    (:mod:`persample.capture.stock`), or its program (:mod:`persample.capture.lean`), or
    how many more full captures before one is traced again, if caching is on."""
    if not _ENABLED[0] or model is None:
        return None
    kept = _STOCK.get(model)
    return kept.get(key) if kept is not None else None


def keep_stock(model: nn.Module, key: tuple, template: Template | Program | int | None
               ) -> None:
    """Keep ``template`` for the next call on ``model`` with ``key`` (``None``: forget)."""
    if not _ENABLED[0] or model is None:
        return
    try:
        kept = _STOCK.setdefault(model, {})
    except TypeError:
        return
    kept.pop(key, None)
    if template is not None:
        kept[key] = template
    while len(kept) > PER_MODEL:
        kept.pop(next(iter(kept)))


def lean_ran(model: nn.Module, key: tuple) -> int:
    """Count a call on ``model`` with ``key`` that ran its program; how many have."""
    try:
        counts = _LEAN.setdefault(model, {})
    except TypeError:
        return 0
    counts[key] = counts.get(key, 0) + 1
    if len(counts) > PER_MODEL:
        counts.pop(next(iter(counts)))
    return counts[key]


def key_of(n: int, v: int, inputs: list[tuple[Tensor, Any]]) -> tuple:
    """Which tape a call may use: its batch size, cotangents per sample, and each input
    tensor's shape, dtype and device (the tape's steps check everything else, op by
    op), but for the dim of an input whose positions hold samples by index (a graph
    batch's nodes and edges, whose counts each batch has its own): its size is left out
    (``-1``), and the calls of every size share what is kept (:func:`sized`)."""
    return n, v, tuple((_shape(t, lay), t.dtype, t.device) for t, lay in inputs)


def _shape(t: Tensor, lay: Any) -> tuple[int, ...]:
    if isinstance(lay, Batched) and lay.index is not None:
        return tuple(-1 if k == lay.dim else size for k, size in enumerate(t.shape))
    return tuple(t.shape)


def sized(key: tuple) -> bool:
    """Is ``key`` (:func:`key_of`) one for calls of any sizes of a graph batch?"""
    return any(-1 in shape for shape, _, _ in key[2])


def clear_plans() -> None:
    """Forget the data flow kept from earlier calls (every model's).

    persample keeps, per model, the data flow of its last calls (a few input shapes
    each): a later call with the same batch size and input shapes checks each op
    against it and takes the layouts of those that match instead of deciding them again
    (:mod:`persample.capture.tape`). Nothing is kept on the model, and whatever does not
    match is decided again, so clearing is never needed for correct results; it frees
    the (small) records.

    Returns:
        None.

    Examples:
        >>> import persample
        >>> persample.clear_plans()
    """
    _TAPES.clear()
    _STOCK.clear()
    _LEAN.clear()


def cache_plans(enabled: bool = True) -> bool:
    """Turn keeping the data flow of earlier calls (see :func:`clear_plans`) on or off
    for every later call; off, each call decides every op's layouts anew (as the first
    call does).

    Args:
        enabled: keep and use them (the default) or not.

    Returns:
        bool: whether they were kept before this call (to restore it).

    Raises:
        TypeError: ``enabled`` is not a bool.

    Examples:
        >>> import persample
        >>> before = persample.cache_plans(False)
        >>> persample.cache_plans(before)
        False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"cache_plans(enabled=...) takes a bool, got {type(enabled).__name__}")
    before, _ENABLED[0] = _ENABLED[0], enabled
    if not enabled:
        _TAPES.clear()
        _STOCK.clear()
        _LEAN.clear()
    return before


def compile_calls(enabled: bool = True) -> bool:
    """Turn compiling the forward of a call that keeps coming back on or off (for every
    later call).

    A call whose plan has held for a few calls like it (same model, batch size and input
    shapes, a graph batch's node and edge counts aside; :data:`COMPILE_AFTER`) is a
    training loop. Its forward is then handed to
    TorchDynamo (``torch.compile`` with a backend of persample's own; one graph,
    guarded by TorchDynamo's checks of every Python value it was traced from), and later
    calls run that graph as plain torch calls with no op intercepted: the per-op cost
    of persample's capture is gone, the data flow is the one the full capture decided
    (:mod:`persample.capture.compiled`). The first such call traces the graph (about a
    second for a small transformer); a forward TorchDynamo cannot take as one graph (a
    branch on a tensor's values, ``.item()``) keeps the checked program instead. Off,
    the cached calls check each op against the earlier call's program
    (:mod:`persample.capture.lean`). Results are the same either way. TorchDynamo is
    Ansel et al., "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
    Transformation and Graph Compilation" (ASPLOS 2024).

    Args:
        enabled: compile (the default) or not.

    Returns:
        bool: whether compiling was on before this call (to restore it).

    Raises:
        TypeError: ``enabled`` is not a bool.

    Examples:
        >>> import persample
        >>> before = persample.compile_calls(False)
        >>> persample.compile_calls(before)
        False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"compile_calls(enabled=...) takes a bool, got {type(enabled).__name__}")
    before, COMPILED_ON[0] = COMPILED_ON[0], enabled
    if not enabled:
        for kept in _STOCK.values():
            for key, found in list(kept.items()):
                if isinstance(found, Compiled):
                    kept[key] = found.program
    return before
