"""Memory for the results persample allocates: touched pages, not page faults.

A per-sample result is large (a 50-layer MLP of width 300 at B=100: 1.8 GB) and
written once.
Fresh host memory costs a page fault per 4 KB page the first time it is written:
on this project's 2-core machines, filling a fresh 1.8 GB tensor takes
about 600 ms against 40 ms for memory already touched, ten times the rest of the
computation. (Transparent huge pages did not help there: the kernel's
``defrag=madvise`` mode compacts memory on every fault, and the fill took longer.)

So on the CPU results come from a small pool of blocks that persample allocated
before and whose tensors the caller has dropped, the way CUDA's caching
allocator keeps device memory (on a GPU ``torch.empty`` already does this, and
the pool is not used). A block goes back to the pool when the last tensor or
view of it dies: its memory is a NumPy array that the returned tensors share
(``torch.from_numpy``), and ``weakref.finalize`` on that array returns the block.
A loop ``g = per_sample_grads(...)`` thus alternates between two blocks and never
faults after its first two calls. The pool keeps at most :data:`KEEP_FREE`
free blocks; :func:`empty_cache` gives them back to the system.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

MIN_BYTES = 1 << 20  # smaller results come from torch.empty: faults are cheap there
KEEP_FREE = 2  # free blocks kept for the next calls; older ones go back to the system
ALIGN = 64  # bytes: each block starts on a cache line


class _Pool:
    """Free host blocks (uint8 tensors) by size; the caller's tensors own the rest."""

    def __init__(self) -> None:
        self.free: list[Tensor] = []  # most recently freed last
        self.lock = threading.RLock()  # a finalizer may run inside take() (GC)

    def take(self, nbytes: int) -> Tensor:
        """A uint8 block of at least ``nbytes`` (at most twice that), reused if one is free."""
        with self.lock:
            fits = [k for k, b in enumerate(self.free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda k: self.free[k].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, block: Tensor) -> None:
        with self.lock:
            self.free.append(block)
            del self.free[:-KEEP_FREE]

    def clear(self) -> None:
        with self.lock:
            self.free.clear()


_POOL = _Pool()


def result_empty(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D uninitialised tensor of ``numel`` elements for a result persample returns.

    On the CPU, and for at least :data:`MIN_BYTES`, its memory comes from the pool
    of blocks already touched (see the module's docstring); it returns to the pool
    when the last tensor viewing it dies. Elsewhere it is ``torch.empty``.

    Args:
        numel: number of elements (``>= 0``).
        dtype: any dtype ``torch.empty`` takes (float32, float64, bfloat16, ...).
        device: where the result lives.

    Returns:
        A contiguous ``(numel,)`` tensor of ``dtype`` on ``device``; carve the
        result's tensors out of it with views.

    Raises:
        RuntimeError: out of memory (from ``torch.empty``).

    Examples:
        >>> buf = result_empty(1 << 20, torch.float32, torch.device("cpu"))
        >>> buf.shape, buf.is_contiguous()
        (torch.Size([1048576]), True)
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    block = _POOL.take(-(-nbytes // ALIGN) * ALIGN)
    shared = block.numpy()[:nbytes]  # a fresh array: it dies with the last view of the result
    weakref.finalize(shared, _POOL.give_back, block)
    return torch.from_numpy(shared).view(dtype)


def empty_cache() -> None:
    """Give the free result blocks persample keeps (host memory) back to the system.

    Results still referenced are not affected. On a GPU use
    ``torch.cuda.empty_cache()`` as usual.

    Examples:
        >>> import persample
        >>> persample.empty_cache()
    """
    _POOL.clear()
