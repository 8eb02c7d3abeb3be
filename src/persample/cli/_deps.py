"""What the command line needs beyond the library: the ``cli`` extra.

``import persample`` needs only torch, numpy and dp-accounting. The commands also
use tqdm (progress bars), scikit-learn (the bundled digits and their split) and
matplotlib (``--plot``), which come with ``pip install "persample[cli]"``. Before a
command runs, :func:`require` checks that what it needs can be imported, so a
missing package stops it at once with a message that says what to install, not
with a traceback halfway through.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterable

INSTALL_CLI = 'pip install "persample[cli]" (or pip install -e ".[cli]" from a checkout)'
"""How to install the command line's extra."""

DISTRIBUTIONS = {"tqdm": "tqdm", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}
"""Import name -> the name pip installs it by, for the ``cli`` extra's packages."""

NEEDS = {"bench": ("tqdm", "sklearn"), "dp-train": ("tqdm", "sklearn"), "attribute": ("sklearn",),
         "influence": ("sklearn",), "audit": ("sklearn",)}
"""What each command always imports from the ``cli`` extra; ``--plot`` adds matplotlib."""


def importable(name: str) -> bool:
    """Whether ``import name`` would find the top-level module ``name`` (without importing
    it); ``False`` also where ``sys.modules[name]`` is ``None`` (import blocked).

    Examples:
        >>> importable("json"), importable("no_such_package_here")
        (True, False)
    """
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already imported, without a spec
        return sys.modules.get(name) is not None


def needed(args: argparse.Namespace) -> list[str]:
    """The ``cli`` extra's modules that the command parsed into ``args`` will import.

    Examples:
        >>> needed(argparse.Namespace(command="dp-train", plot="curves.png"))
        ['tqdm', 'sklearn', 'matplotlib']
        >>> needed(argparse.Namespace(command="dp-finetune"))
        []
    """
    modules = list(NEEDS.get(args.command, ()))
    if modules and getattr(args, "plot", None):
        modules.append("matplotlib")
    return modules


def missing_message(what: str, modules: Iterable[str]) -> str:
    """The message for ``what`` (a command or a function) that needs ``modules``, which
    are not installed.

    Examples:
        >>> print(missing_message("persample bench", ["tqdm", "sklearn"]))
        ... # doctest: +NORMALIZE_WHITESPACE
        persample bench needs tqdm and scikit-learn (not installed): install the command
        line's extra, pip install "persample[cli]" (or pip install -e ".[cli]" from a
        checkout)
    """
    names = [DISTRIBUTIONS.get(m, m) for m in modules]
    listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return f"{what} needs {listed} (not installed): install the command line's extra, " \
           f"{INSTALL_CLI}"


def require(args: argparse.Namespace) -> None:
    """Stop (:class:`SystemExit`, exit status 1, the message on stderr) if the command
    parsed into ``args`` needs a package of the ``cli`` extra that cannot be imported.

    Examples:
        >>> require(argparse.Namespace(command="dp-finetune"))  # needs none of them
    """
    absent = [m for m in needed(args) if not importable(m)]
    if absent:
        raise SystemExit(missing_message(f"persample {args.command}", absent))
