"""The process's resident memory on Linux: read it and reset its peak.

``/proc/self/status`` holds ``VmRSS`` (now) and ``VmHWM`` (the peak); writing ``5``
to ``/proc/self/clear_refs`` (Linux >= 4.0) resets the peak to the current RSS, so a
phase's own peak can be read in a process that did other work before it. Elsewhere
both answer that they cannot (``None``, ``False``).
"""

from __future__ import annotations


def status_kib(field_name: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None.

    Examples:
        >>> kib = status_kib("VmRSS")
        >>> kib is None or kib > 0
        True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the peak RSS (``VmHWM``) to the current RSS (Linux >= 4.0); False if not.

    The memory freed before (an earlier run's tensors), which glibc's allocator keeps for
    reuse, is first given back to the system (``malloc_trim``): a phase that reused it
    would otherwise read as using none.
    """
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    """glibc's ``malloc_trim(0)``: the freed memory the allocator holds, back to the
    system (elsewhere nothing)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
