"""The ``persample`` command line (also ``python -m persample``).

``persample bench`` is the benchmark, a package of its own beside the library
(:mod:`persample_bench`, also ``persample-bench``): this command line imports it only
when the subcommand is ``bench``, and hands it the arguments that follow.
"""

from __future__ import annotations

import argparse

from . import _deps, attribute, audit, dp_finetune, dp_train
from .plain import PlainHelp


def build_parser() -> argparse.ArgumentParser:
    """The ``persample`` argument parser: ``bench``, ``dp-train``, ``dp-finetune``,
    ``attribute`` and ``audit`` subcommands. ``bench`` keeps what follows it as it is
    (``args``), for the benchmark's own parser.

    Examples:
        >>> build_parser().parse_args(["bench", "--quick", "--no-memory"]).args
        ['--quick', '--no-memory']
        >>> build_parser().parse_args(["dp-train", "--epochs", "2"]).epochs
        2
    """
    parser = argparse.ArgumentParser(
        prog="persample", description="The persample command line (also python -m persample).",
        formatter_class=PlainHelp)
    sub = parser.add_subparsers(dest="command", required=True)
    # no option of its own (no prefix character any argument starts with), so that every
    # argument after `bench`, --help included, goes to the benchmark's parser
    bench = sub.add_parser(
        "bench", prefix_chars="\0", add_help=False,
        help="time every per-sample method side by side on the workloads (real data); "
        "persample bench --help for its options")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    dp_train.add_parser(sub)
    dp_finetune.add_parser(sub)
    attribute.add_parser(sub)
    audit.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit
    status: 0, or 1 where ``audit`` finds a leak.

    Raises:
        SystemExit: bad arguments (argparse), an unknown workload, ``--device cuda``
            without CUDA, or a package the command needs from the ``cli`` extra (tqdm,
            scikit-learn, matplotlib for ``--plot``) is not installed: checked before
            the command starts.
    """
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from persample_bench import main as bench  # the one import of the benchmark

        return bench(args.args, prog="persample bench")
    _deps.require(args)
    if args.command == "dp-train":
        dp_train.run_from_args(args)
    elif args.command == "dp-finetune":
        dp_finetune.run_from_args(args)
    elif args.command in ("attribute", "influence"):
        attribute.run_from_args(args)
    elif args.command == "audit":
        return audit.run_from_args(args)
    return 0
