"""The states of random generators: which one an op draws from, a state to return to.

Used to draw the same numbers again (:mod:`persample.draws`), and to let each method
``method="auto"`` tries draw what the first one drew (:mod:`persample.methods`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
