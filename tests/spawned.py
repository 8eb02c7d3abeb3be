"""A few spawned ``torch.distributed`` workers for a test (gloo on the CPU), each saving
what it saw to ``{out}/rank{r}.pt``, waited for with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


def ranks_of(worker: Callable, out: Path, world: int, *extra: Any, timeout: float = 180,
             what: str = "workers") -> list[dict]:
    """Run ``worker(rank, world, str(out), init, *extra)`` in ``world`` spawned processes
    meeting at a rendezvous file in ``out``; fail the test (killing them) past
    ``timeout`` seconds; each rank's saved dict, in rank order."""
    init = f"file://{out / 'rendezvous'}"
    ctx = mp.start_processes(worker, args=(world, str(out), init, *extra), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    saved = [out / f"rank{r}.pt" for r in range(world)]
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {what} did not finish within {timeout:g} s")
    except mp.ProcessExitedException:  # (killed by a signal: a worker's C++ teardown at
        # exit aborted once, "terminate called without an active exception", after every
        # rank had saved what it saw; not so if a rank saved nothing)
        if not all(path.exists() for path in saved):
            raise
    return [torch.load(path, weights_only=False) for path in saved]
