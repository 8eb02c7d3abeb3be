"""The ``persample`` command line (also ``python -m persample``)."""

from __future__ import annotations

import argparse

from . import _deps, attribute, dp_finetune, dp_train
from .workloads import REAL_WORKLOADS, SMALL_WORKLOADS, WORKLOADS


def build_parser() -> argparse.ArgumentParser:
    """The ``persample`` argument parser: ``bench`` and ``dp-train`` subcommands.

    Example:
        >>> build_parser().parse_args(["bench", "--quick", "--no-memory"]).no_memory
        True
    """
    parser = argparse.ArgumentParser(prog="persample", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="time every per-sample method side by side on the workloads (real data)",
        description="Per-sample gradients, Jacobians and DP-SGD steps on real data (the "
        "digits, the standard library's docstrings), small models and real ones (torchvision "
        "resnet18, timm ViT, transformers GPT-2; real-size GPT-2 small, BERT and Llama with "
        "LoRA and their real vocabularies): the plain backward and the floor, the "
        "loop, torch.func, Opacus and BackPACK when installed, and persample, each called "
        "as its users call it; medians after warm-up, ratios to the floor, peak memory, and "
        "each result's largest difference from the reference.",
    )
    bench.add_argument("--workload", action="append", choices=WORKLOADS,
                       help="run only this workload (repeatable); default: all")
    group = bench.add_mutually_exclusive_group()
    group.add_argument("--real", action="store_true",
                       help="the real-size transformers only (with --workload: those too): "
                       + ", ".join(REAL_WORKLOADS) + "; seconds per call on a CPU")
    group.add_argument("--no-real", action="store_true",
                       help="leave the real-size transformers out")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: no warm-up, 2 rounds, a slow method's first run is "
                       "its time (with --no-memory and a small --batch, 5-25 s a workload)")
    bench.add_argument("--batch", type=int, default=None,
                       help="override the workloads' batch size (default: each workload's own)")
    bench.add_argument("--threads", type=int, default=2,
                       help="torch CPU threads on --device cpu (default 2)")
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where models and data go (default cpu); on cuda every timed "
                       "call is synchronized")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the peak memory figures (on the CPU each method's is "
                       "measured in a fresh process: a few seconds per method)")
    bench.add_argument("--_memory-probe", nargs=2, metavar=("WORKLOAD", "METHOD"),
                       help=argparse.SUPPRESS)  # internal: one call's peak RSS, as JSON
    bench.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the times as a bar chart")
    dp_train.add_parser(sub)
    dp_finetune.add_parser(sub)
    attribute.add_parser(sub)
    return parser


def selected_workloads(args: argparse.Namespace) -> list[str]:
    """The workloads ``persample bench`` runs, in :data:`WORKLOADS`' order: those named
    by ``--workload``, plus the real-size ones with ``--real``; with neither, all of
    them, or all but the real-size ones with ``--no-real``.

    Example:
        >>> parse = build_parser().parse_args
        >>> selected_workloads(parse(["bench", "--real"]))[:2]
        ['gpt2-768-grads', 'gpt2-768-dp-step']
        >>> selected_workloads(parse(["bench", "--workload", "cnn-grads", "--no-real"]))
        ['cnn-grads']
    """
    named = set(args.workload or ())
    if args.real:
        named |= set(REAL_WORKLOADS)
    if not named:
        return list(SMALL_WORKLOADS if args.no_real else WORKLOADS)
    return [w for w in WORKLOADS if w in named and not (args.no_real and w in REAL_WORKLOADS)]


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns 0.

    Raises:
        SystemExit: bad arguments (argparse), an unknown workload, ``--device cuda``
            without CUDA, or a package the command needs from the ``cli`` extra (tqdm,
            scikit-learn, matplotlib for ``--plot``) is not installed: checked before
            the command starts.
    """
    args = build_parser().parse_args(argv)
    _deps.require(args)
    if args.command == "bench" and args._memory_probe:
        import json

        from .bench import memory_probe

        workload, method = args._memory_probe
        print(json.dumps(memory_probe(workload, method, args.batch, args.threads,
                                      args.device)))
    elif args.command == "bench":
        from .bench import run

        run(selected_workloads(args), args.quick, args.batch, args.threads,
            args.json, args.plot, device=args.device, memory=not args.no_memory)
    elif args.command == "dp-train":
        dp_train.run_from_args(args)
    elif args.command == "dp-finetune":
        dp_finetune.run_from_args(args)
    elif args.command == "attribute":
        attribute.run_from_args(args)
    return 0
