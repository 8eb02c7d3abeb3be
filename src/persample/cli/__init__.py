"""The ``persample`` command line (also ``python -m persample``)."""

from __future__ import annotations

import argparse

from . import dp_train
from .workloads import WORKLOADS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persample", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="time every per-sample method side by side on the seed workloads (real data)",
        description="Per-sample gradients of the seed workloads on scikit-learn's digits: "
        "plain backward (floor), the loop, torch.func vmap, Opacus and BackPACK when "
        "installed, and persample; medians after warm-up, ratios to the floor, and each "
        "result's largest difference from the loop's.",
    )
    bench.add_argument("--workload", action="append", choices=WORKLOADS,
                       help="run only this workload (repeatable); default: all")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: no warm-up, 2 rounds, a slow method's first run is "
                       "its time (about 1.5 min for all workloads, 5-25 s for one)")
    bench.add_argument("--batch", type=int, default=None,
                       help="override the workloads' batch size (default: PERFORMANCE.md's)")
    bench.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    bench.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the times as a bar chart")
    dp_train.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from .bench import run

        run(args.workload or list(WORKLOADS), args.quick, args.batch, args.threads,
            args.json, args.plot)
    elif args.command == "dp-train":
        dp_train.run_from_args(args)
    return 0
