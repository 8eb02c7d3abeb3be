"""Mixed precision: the autocast state an op ran under, and the dtype rules compute in.

Under ``torch.autocast`` an op's inputs are cast below the level where the capture
sees them: the capture records ``F.linear`` reading a float32 activation and a float32
weight, and its output (and the backprops of it) come back in bfloat16 or float16.
The rules therefore run with autocast off and compute in a *work dtype* they choose
explicitly:

- per-sample results in the parameter's dtype (the backprops and activations cast to
  it), as ``p.grad`` would be;
- squared norms, clip factors and clipped sums accumulated in at least float32
  (:func:`accumulate_dtype`), whatever the parameters' dtype.

What replays an op or a module call (``torch.func``'s per-sample VJPs, the clipped sum
of an op without a weighted-sum rule) runs it under the autocast state it was
captured with (:func:`replaying`), so it computes what the forward computed.

Micikevicius et al. (2018), "Mixed precision training"; the ``torch.amp`` documentation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

_DEVICES = ("cpu", "cuda")
LOW = (torch.float16, torch.bfloat16)

AutocastState = tuple[tuple[str, bool, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The autocast state now: ``((device_type, enabled, dtype), ...)`` per device type.

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_state()[0]
        ('cpu', True, torch.bfloat16)
    """
    if not torch._C._is_any_autocast_enabled():  # (the common case, read per op: fast)
        return (("cpu", False, torch.get_autocast_dtype("cpu")),
                ("cuda", False, torch.get_autocast_dtype("cuda")))
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in _DEVICES)


@contextmanager
def replaying(state: AutocastState | None) -> Iterator[None]:
    """Run the block under the autocast ``state`` (``None``: as it is now).

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     state = autocast_state()
        >>> with replaying(state):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    if state is None or state == autocast_state():
        yield
        return
    with ExitStack() as stack:
        for device, enabled, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


@contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off on every device type: the rules choose their dtypes themselves.

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), without_autocast():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    if not any(enabled for _, enabled, _ in autocast_state()):
        yield
        return
    with ExitStack() as stack:
        for device in _DEVICES:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def accumulate_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype sums of squares and clipped sums accumulate in: float32 for bfloat16 and
    float16, else the widest of ``dtypes`` (float64 stays float64); a complex dtype counts
    as its real one (a squared norm is real).

    Examples:
        >>> accumulate_dtype(torch.bfloat16), accumulate_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    found = _ACCUMULATE.get(dtypes)
    if found is None:
        found = _ACCUMULATE[dtypes] = _accumulate(dtypes)
    return found


_ACCUMULATE: dict[tuple, torch.dtype] = {}  # (a few dtypes: each answer asked of ATen once)


def _accumulate(dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    found = torch.float32
    for d in dtypes:
        d = d.to_real() if d.is_complex else d
        if d.is_floating_point:
            found = torch.promote_types(found, d)
    return found


def cast(t: Any, dtype: torch.dtype | None) -> Any:
    """A floating tensor in ``dtype`` (no copy when it already is); anything else as it is.

    Examples:
        >>> cast(torch.ones(2, dtype=torch.bfloat16), torch.float32).dtype, cast(3, None)
        (torch.float32, 3)
    """
    if dtype is None or not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    return t if t.dtype == dtype else t.to(dtype)
