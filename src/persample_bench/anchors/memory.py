"""How much memory a method would need, before it is built: a method estimated to
need more than the device allows is skipped with a note instead of run out of
memory.

The estimates are rough (within a factor of about two), but they tell 3 GB from
30 GB. The loop is the reference every row is checked against: when even the loop
would not fit, the case is refused (:func:`reference_fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..workloads import Workload
from .case import Method, num_params

MEMORY_LIMIT_BYTES = 8e9  # a method estimated to need more is skipped with a note (CPU)
GPU_MEMORY_SHARE = 0.8  # on a GPU, the limit is this share of its memory


def memory_limit(device: torch.device) -> float:
    """The most bytes a method may be estimated to need: :data:`MEMORY_LIMIT_BYTES` on the
    CPU, :data:`GPU_MEMORY_SHARE` of the GPU's memory on a GPU.

    Examples:
        >>> memory_limit(torch.device("cpu")) == MEMORY_LIMIT_BYTES
        True
    """
    if device.type == "cuda":
        return GPU_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory
    return MEMORY_LIMIT_BYTES


def saved_bytes_per_sample(w: Workload) -> int:
    """The bytes autograd keeps for the backward of the first sample's loss: one forward
    of a batch of one under ``saved_tensors_hooks``, each distinct storage counted once,
    the parameters' own not counted. Outside the timed calls.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> saved_bytes_per_sample(grads_workload("deep-mlp-grads", 2)) > 0
        True
    """
    from persample.inputs import samples_of

    own = {p.untyped_storage().data_ptr() for p in w.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w.loss_fn(w.call(inputs=samples_of(w.inputs, 0, 1)), samples_of(w.targets, 0, 1))
    return sum(seen.values())


@dataclass
class MemoryEstimate:
    """What a per-sample gradients method needs besides the model, in bytes, from the
    result's size ``R = B * P * itemsize``, one sample's saved activations ``A``
    (:func:`saved_bytes_per_sample`) and the largest parameter's per-sample gradients
    ``G = B * itemsize * max numel``; compared with :func:`memory_limit` before a method
    is built.

    Examples:
        >>> e = MemoryEstimate(result=4e9, per_sample=1e8, largest=2e9, n=8, limit=8e9)
        >>> e.skip("loop") is None, e.skip("torch.func vmap")
        (True, 'skipped: would need about 10 GB (over the 8 GB limit)')
    """

    result: float  # R: the per-sample gradients, B * P * itemsize
    per_sample: float  # A: one sample's saved activations
    largest: float  # G: the largest parameter's per-sample gradients
    n: int  # B
    limit: float

    def need(self, method: str) -> float:
        """The loop keeps the result and one sample's graph and gradients; ``torch.func``
        the result, the batch's activations and their gradients under ``vmap``, and the
        largest parameter's per-sample gradient twice (a tied weight's two uses);
        Opacus's and BackPACK's hooks the result, the batch's activations and the
        largest layer's per-sample product."""
        r, a, g, n = self.result, self.per_sample, self.largest, self.n
        if method.startswith("loop"):
            return r + a + r / n
        if method.startswith("torch.func"):
            return r + 2 * n * a + 2 * g
        return r + n * a + g  # Opacus hooks, BackPACK

    def skip(self, method: str) -> str | None:
        """``"skipped: ..."`` where ``method`` would need over the limit, else ``None``."""
        need = self.need(method)
        if need <= self.limit:
            return None
        return (f"skipped: would need about {need / 1e9:,.0f} GB (over the "
                f"{self.limit / 1e9:,.0f} GB limit)")


def memory_estimate(w: Workload) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of a per-sample gradients workload on its device.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> e = memory_estimate(grads_workload("cnn-grads", 2))
        >>> e.result == 2 * 1199882 * 4, e.skip("torch.func vmap")
        (True, None)
    """
    trainable = [p for p in w.model.parameters() if p.requires_grad]
    size = trainable[0].element_size()
    return MemoryEstimate(w.n * num_params(w.model) * size, saved_bytes_per_sample(w),
                          w.n * size * max(p.numel() for p in trainable), w.n,
                          memory_limit(w.device))


def reference_fits(w: Workload) -> MemoryEstimate:
    """The workload's :class:`MemoryEstimate`, once the loop (the reference every row is
    checked against) is found to fit.

    Raises:
        MemoryError: the loop would need over the limit; the message names the workload.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> reference_fits(grads_workload("cnn-grads", 2)).n
        2
    """
    estimate = memory_estimate(w)
    why = estimate.skip("loop")
    if why:
        raise MemoryError(f"{w.name}: the loop, the reference, {why.removeprefix('skipped: ')}"
                          "; run it with a smaller --batch")
    return estimate


def unless_too_big(name: str, estimate: MemoryEstimate | None,
                   build: Callable[[], Method]) -> Method:
    """``build()``, unless ``estimate`` says ``name`` would need over the limit (then a
    row with ``fn=None`` and the ``"skipped: ..."`` note); ``estimate=None``: build.

    Examples:
        >>> e = MemoryEstimate(result=4e9, per_sample=1e8, largest=2e9, n=8, limit=8e9)
        >>> unless_too_big("torch.func vmap", e, lambda: Method("built", None)).note[:8]
        'skipped:'
    """
    why = estimate.skip(name) if estimate is not None else None
    return Method(name, None, why) if why else build()


def jacfwd_skip(n: int, p: int, largest: int, itemsize: int) -> str | None:
    """``"skipped: ..."`` where ``vmap(jacfwd)`` of a per-sample parameter Jacobian would
    need over :data:`MEMORY_LIMIT_BYTES`, else ``None``: ``jacfwd`` pushes ``P`` one-hot
    tangents, and under ``vmap`` over the batch its largest intermediate is about
    ``(B, P, largest parameter)`` numbers.

    Args:
        n: the batch size ``B``.
        p: the parameters' entries ``P``.
        largest: the largest parameter's entries.
        itemsize: bytes per number.

    Examples:
        >>> jacfwd_skip(256, 15910, 15680, 4)
        'skipped: would need about 255 GB'
    """
    need = n * p * largest * itemsize
    return None if need <= MEMORY_LIMIT_BYTES else f"skipped: would need about {need / 1e9:,.0f} GB"
