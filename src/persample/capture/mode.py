"""The ``TorchFunctionMode`` through which a capture sees every op of the forward, and
how it keeps out of TorchDynamo's way.

The mode hands each op of the capturing thread to its recorder
(:meth:`persample.capture.Capture.record`), or runs an op's expansion instead (the op
as the ops it is made of: ``F.multi_head_attention_forward``). Ops of other threads
run as they are.

Once ``torch.compile`` is in use, compiled code runs eagerly while a capture is open
(:mod:`persample.patches`); where that stance cannot be set (inside a compiled region),
the mode's own code is hidden from TorchDynamo (``torch._dynamo.disable``), so that a
compiled forward runs the capture's work as plain Python between its graphs instead of
tracing and recompiling it for every capture.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..batch.flow import in_place, name_of
from ..errors import raise_internal
from ..patches import WhileCapturing


class Mode(TorchFunctionMode):
    """Every op of the capturing thread to ``recorder.record(func, args, kwargs)``.

    Args:
        recorder: has ``thread`` (the capturing thread's id), ``expansions`` (``{func:
            fn}``), ``expands(func, args, kwargs)`` (must this call run as its expansion)
            and ``record``; held through a weak proxy by the caller.
        tracer: has ``traced(func, args, kwargs)``, which records through ``recorder``
            and traces (:class:`persample.capture.lean.Tracer`), and ``dead``; or
            ``None``.
    """

    def __init__(self, recorder: Any, tracer: Any = None):
        super().__init__()
        self.recorder = recorder
        self.expansions = recorder.expansions  # (read per op: not through the proxy)
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self.recorder
        if threading.get_ident() != recorder.thread:
            return func(*args, **kwargs)
        expansion = self.expansions.get(func) if self.expansions else None
        if expansion is not None and not in_place(func, kwargs) and (  # (an expansion
                recorder.expands(func, args, kwargs)):  # makes anew)
            if self.tracer is not None:
                self.tracer.dead = f"an op run as its expansion ({name_of(func)})"
            out = self._expanded(func, expansion, args, kwargs)
            if out is not NotImplemented:
                return out
        if self.tracer is not None:
            return self.tracer.traced(func, args, kwargs)
        return recorder.record(func, args, kwargs)

    def _expanded(self, func: Any, expansion: Callable, args: tuple, kwargs: dict) -> Any:
        """``expansion(*args, **kwargs)`` with its ops captured one by one; where it fails,
        the op itself runs (raising the user's error if it is one), then persample's
        failure is an internal error."""
        failed = None
        try:
            with self:
                return expansion(*args, **kwargs)
        except Exception as err:
            failed = err
        with torch._C.DisableTorchFunction():
            func(*args, **kwargs)  # the op itself raises too: the user's error
        raise_internal(failed, f"the expansion of {name_of(func)}")


def hidden(fn: Callable) -> Callable:
    """``fn`` hidden from TorchDynamo where ``torch.compile`` is in use (its module is
    loaded), else ``fn`` itself."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo.disable(fn) if dynamo is not None else fn


def must_hide() -> bool:
    """Must the capture's own code be hidden from TorchDynamo now? Once ``torch.compile``
    is in use, unless compiled code runs eagerly anyway (an open capture set that stance);
    hiding costs a few microseconds per op."""
    return "torch._dynamo" in sys.modules and WhileCapturing.stance is None


_HIDDEN_MODE: list[type] = []


def mode_class(hide: bool) -> type:
    """:class:`Mode`, or with ``hide``, :class:`Mode` with its ``__torch_function__``
    hidden from TorchDynamo."""
    if not hide or "torch._dynamo" not in sys.modules:
        return Mode
    if not _HIDDEN_MODE:
        _HIDDEN_MODE.append(type("HiddenMode", (Mode,), {
            "__torch_function__": hidden(Mode.__torch_function__)}))
    return _HIDDEN_MODE[0]
