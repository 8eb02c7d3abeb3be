"""How many torch CPU threads a command uses by default: the CPUs it may run on that
nothing else is using.

On a shared machine a fixed thread count backfires: torch's worker threads spin
while they wait for each other, and one of them descheduled by another process
holds up every operation (``persample attribute``'s self-influence took 16-26 s
with 2 threads on a loaded 2-core machine, 0.4 s with 1). So the default is the
CPUs this process may use (its affinity mask) less those the 1-minute load
average says are busy, rounded to the nearest whole CPU, and at least 1. An
explicit ``--threads N`` always wins.
"""

from __future__ import annotations

import argparse
import math
import os

RULE = ("the CPUs this process may use less the 1-minute load average (rounded), at "
        "least 1")
"""The default rule in words, for ``--help``."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all of them where the system
    has no affinity).

    Examples:
        >>> usable_cpus() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average: processes running or waiting for a CPU (0 where the
    system has none).

    Examples:
        >>> load_average() >= 0
        True
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def default_threads(cpus: int | None = None, load: float | None = None) -> int:
    """The default torch thread count: ``cpus`` less ``load`` rounded half up, at least 1.

    Args:
        cpus: the CPUs this process may use (default :func:`usable_cpus`).
        load: the 1-minute load average (default :func:`load_average`).

    Returns:
        The thread count, ``1 <= threads <= cpus``.

    Examples:
        >>> default_threads(cpus=2, load=0.2), default_threads(cpus=2, load=0.6)
        (2, 1)
        >>> default_threads(cpus=2, load=7.3), default_threads(cpus=16, load=3.4)
        (1, 13)
    """
    cpus = usable_cpus() if cpus is None else cpus
    load = load_average() if load is None else load
    return max(1, cpus - math.floor(load + 0.5))


def add_threads_argument(parser: argparse.ArgumentParser, what: str = "torch CPU threads"
                         ) -> None:
    """Add ``--threads N`` to a subcommand's parser, its default :func:`default_threads`
    as the command starts (``--help`` says the rule and today's figure).

    Args:
        parser: the subcommand's parser.
        what: what the threads are, for the help (``"torch CPU threads in all"``...).

    Examples:
        >>> parser = argparse.ArgumentParser()
        >>> add_threads_argument(parser)
        >>> parser.parse_args(["--threads", "3"]).threads
        3
        >>> parser.parse_args([]).threads >= 1
        True
    """
    cpus, load = usable_cpus(), load_average()
    threads = default_threads(cpus, load)
    parser.add_argument("--threads", type=int, default=threads,
                        help=f"{what} (default: {RULE}; here now {threads}: {cpus} CPUs, "
                        f"load {load:.2f})")


def threads_label(threads: int) -> str:
    """How a command's header says its thread count.

    Examples:
        >>> threads_label(1), threads_label(2)
        ('1 torch thread', '2 torch threads')
    """
    return f"{threads} torch thread{'s' if threads != 1 else ''}"
