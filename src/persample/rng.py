"""The states of random generators: which one an op draws from, a state to return to.

Used to draw the same numbers again (:mod:`persample.draws`), to let each method
``method="auto"`` tries draw what the first one drew (:mod:`persample.methods`), and
to replay a call's draws in its certificate (:mod:`persample.certificate`), numpy's and
Python's global generators included (:class:`Draws`). Likewise the model's buffers
where a call began (:func:`rewind_buffers`), for a forward that updates them in place.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


def device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device an op runs on: its ``device=``, else its first tensor's, else the
    default device."""
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return torch.get_default_device()


def generator_of(args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator an op draws from: its ``generator=``, else its device's default
    (``None`` for a device without one)."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    dev = device_of(args, kwargs)
    if dev.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, dev.type, None)
    gens = getattr(backend, "default_generators", ())
    index = dev.index if dev.index is not None else backend.current_device()
    return gens[index] if index < len(gens) else None


@contextmanager
def at_state(generator: torch.Generator | None, state: Tensor | None) -> Iterator[None]:
    """Inside: ``generator`` at ``state``; its own state back on exit."""
    if generator is None or state is None:
        yield
        return
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)


def snapshot() -> list[tuple[torch.Generator, Any]]:
    """The states of the CPU's and every started GPU's default generator."""
    gens = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gens += list(torch.cuda.default_generators)
    return [(g, g.get_state()) for g in gens]


def restore(states: list[tuple[torch.Generator, Any]]) -> None:
    """Back to a :func:`snapshot`."""
    for g, state in states:
        g.set_state(state)


def host_states() -> tuple:
    """The states of numpy's and Python's global generators."""
    return np.random.get_state(), random.getstate()


def set_host_states(states: tuple) -> None:
    """Back to a :func:`host_states`."""
    np.random.set_state(states[0])
    random.setstate(states[1])


def host_moved(before: tuple) -> list[str]:
    """Which of numpy's and Python's global generators moved since ``before``."""
    now = host_states()
    moved = []
    if not (now[0][0] == before[0][0] and np.array_equal(now[0][1], before[0][1])
            and now[0][2:] == before[0][2:]):
        moved.append("numpy's global generator (np.random)")
    if now[1] != before[1]:
        moved.append("Python's random module")
    return moved


@dataclass
class Draws:
    """Where the generators stood when a method started (torch's default ones, numpy's
    and Python's global ones), so that the reference forward draws what it drew."""

    torch_states: list
    host: tuple

    @classmethod
    def now(cls) -> Draws:
        return cls(snapshot(), host_states())

    def restore(self) -> None:
        """Every generator back where it stood."""
        restore(self.torch_states)
        set_host_states(self.host)


_STARTS: ContextVar[tuple] = ContextVar("persample_buffers_at_start", default=())
# (model, [(buffer, its value)] when the outermost call on it began), innermost call last


@contextmanager
def buffers_at_start(model: Any, saved: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Inside: ``saved`` (each buffer of ``model`` with its value now) is where
    :func:`rewind_buffers` puts them back, unless a call on ``model`` is under way
    already (its values stand)."""
    starts = _STARTS.get()
    if any(m is model for m, _ in starts):
        yield
        return
    token = _STARTS.set((*starts, (model, saved)))
    try:
        yield
    finally:
        _STARTS.reset(token)


def rewind_buffers(model: Any = None) -> None:
    """The buffers of ``model`` (``None``: the model of the innermost call under way)
    back to their values at the start of the call on it, so that a forward run again
    (another method, the certificate's reference) starts where the first did: a
    forward that updates a buffer in place (``spectral_norm``'s power iteration in
    training mode) otherwise runs another function the second time. Nothing outside a
    call on it."""
    starts = _STARTS.get()
    if model is None:
        found = starts[-1][1] if starts else ()
    else:
        found = next((saved for m, saved in reversed(starts) if m is model), ())
    with torch.no_grad():
        for b, value in found:
            b.copy_(value)

