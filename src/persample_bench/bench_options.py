"""``persample bench``'s options, and what they select: which workloads run, at which
batch size, with memory probes or not, in a smoke run or a full one.

Light on purpose (no tqdm, no model built): ``persample bench --help`` (also
``persample-bench --help``) and the choice of workloads work without the command
line's extra.

How the options combine:

- the workloads: those named by ``--workload``, plus the real-size transformers
  with ``--real``; with neither, the headline subset
  (:data:`~persample_bench.workloads.QUICK_WORKLOADS`) under ``--quick``, the small
  workloads under ``--no-real``, else all of them; ``--no-real`` leaves the real-size
  ones out in every case;
- ``--quick``: a quick run: no warm-up, 2 rounds (a method whose first call takes over
  5 s is timed by that call alone), no memory probes; each workload at its own size (as
  the full run) unless ``--batch``;
- ``--batch N``: every workload's batch size, with or without ``--quick``;
- ``--no-memory``: no memory probes (on the CPU one fresh process per method).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from persample.cli.plain import PlainHelp
from persample.cli.threads import add_threads_argument

from .workloads import (
    PROXY_WORKLOADS,
    QUICK_WORKLOADS,
    REAL_WORKLOADS,
    SMALL_WORKLOADS,
    WORKLOADS,
)


@dataclass
class BenchPlan:
    """What ``persample bench`` runs.

    Attributes:
        workloads: names from :data:`~persample_bench.workloads.WORKLOADS`, in its order.
        batch: every workload's batch size, or ``None`` for each workload's own.
        quick: a quick run (no warm-up, 2 rounds).
        memory: measure each method's peak memory.
    """

    workloads: list[str]
    batch: int | None
    quick: bool
    memory: bool


DESCRIPTION = (
    "Per-sample gradients, Jacobians and DP-SGD steps on real data (the "
    "digits, the standard library's docstrings), small models and real ones (torchvision "
    "resnet18, timm ViT, transformers GPT-2; real-size GPT-2 small, BERT and Llama with "
    "LoRA and their real vocabularies): the plain backward and the floor, the "
    "loop, torch.func, Opacus and BackPACK when installed, and persample, each called "
    "as its users call it; medians after warm-up, ratios to the floor, peak memory, and "
    "each result's largest difference from the reference. Without options: every "
    "workload at its own batch, with memory probes (tens of minutes on a CPU); "
    "--quick: the headline rows that fit in two minutes (" + ", ".join(QUICK_WORKLOADS)
    + "), each at its own size, with fewer rounds and a summary at the end.")
"""What ``--help`` says the benchmark does."""


def build_parser(prog: str = "persample-bench") -> argparse.ArgumentParser:
    """The benchmark's argument parser (``persample-bench``, ``python -m persample_bench``;
    ``persample bench`` passes it what follows ``bench``, with ``prog="persample bench"``).

    Examples:
        >>> build_parser().parse_args(["--quick", "--no-memory"]).no_memory
        True
    """
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=PlainHelp)
    add_arguments(parser)
    return parser


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``bench``; the parsed ``command`` is ``"bench"``
    (what :func:`persample.cli._deps.require` checks the ``cli`` extra for)."""
    bench.set_defaults(command="bench")
    bench.add_argument("--workload", action="append", choices=WORKLOADS,
                       help="run only this workload (repeatable; also under --quick); "
                       "default: all, the headline subset under --quick, the small ones "
                       "under --no-real")
    group = bench.add_mutually_exclusive_group()
    group.add_argument("--real", action="store_true",
                       help="the real-size transformers only (with --workload: those too; "
                       "with --quick: with fewer rounds): "
                       + ", ".join(REAL_WORKLOADS) + "; seconds per call on a CPU")
    group.add_argument("--no-real", action="store_true",
                       help="leave the real-size transformers out, even when named")
    bench.add_argument("--proxy", action="store_true",
                       help="the tiny configurations whose kernels are as short as a real "
                       "model's on a GPU (with --workload: those too): "
                       + ", ".join(PROXY_WORKLOADS) + "; read the fixed cost per op")
    bench.add_argument("--quick", action="store_true",
                       help="a quick run: the headline rows that fit in two minutes ("
                       + ", ".join(QUICK_WORKLOADS) + "; unless --real or --workload), "
                       "each at its own size (unless --batch), no memory probes, no "
                       "warm-up, 2 rounds (a method whose first call takes over 5 s: that "
                       "call alone)")
    bench.add_argument("--batch", type=int, default=None,
                       help="every workload's batch size, with or without --quick (default: "
                       "each workload's own)")
    add_threads_argument(bench, "torch CPU threads on --device cpu")
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where models and data go (default cpu); on cuda every timed "
                       "call is synchronized")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the peak memory figures (on the CPU each method's is "
                       "measured in a fresh process: a few seconds per method); implied by "
                       "--quick")
    bench.add_argument("--_memory-probe", nargs=2, metavar=("WORKLOAD", "METHOD"),
                       help=argparse.SUPPRESS)  # internal: one call's peak RSS, as JSON
    bench.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the times as a bar chart")
    bench.add_argument("--markdown", metavar="FILE.md",
                       help="write the run as one Markdown table (a row per workload: "
                       "persample, the best other method, the speed-up, the first call), "
                       "the machine and the packages' versions above it")


def selected_workloads(args: argparse.Namespace) -> list[str]:
    """The workloads ``persample bench`` runs, in :data:`WORKLOADS`' order: those named
    by ``--workload``, plus the real-size ones with ``--real`` and the GPU proxies with
    ``--proxy``; with none of these, all of them, the headline subset under ``--quick``,
    or the small ones under ``--no-real``. ``--no-real`` leaves the real-size ones out
    even when named.

    Examples:
        >>> parse = build_parser().parse_args
        >>> selected_workloads(parse(["--real"]))[:2]
        ['gpt2-768-grads', 'gpt2-768-dp-step']
        >>> selected_workloads(parse(["--workload", "cnn-grads", "--no-real"]))
        ['cnn-grads']
        >>> selected_workloads(parse(["--quick"])) == list(QUICK_WORKLOADS)
        True
    """
    named = set(args.workload or ())
    if args.real:
        named |= set(REAL_WORKLOADS)
    if args.proxy:
        named |= set(PROXY_WORKLOADS)
    if not named and args.quick and not args.no_real:
        return list(QUICK_WORKLOADS)
    if not named:
        return list(SMALL_WORKLOADS if args.no_real else WORKLOADS)
    return [w for w in WORKLOADS if w in named and not (args.no_real and w in REAL_WORKLOADS)]


def plan(args: argparse.Namespace) -> BenchPlan:
    """The :class:`BenchPlan` of the parsed ``bench`` options (see the module docstring).

    Examples:
        >>> plan(build_parser().parse_args(["--quick", "--batch", "8"]))
        ... # doctest: +ELLIPSIS
        BenchPlan(workloads=['cnn-grads', ...], batch=8, quick=True, memory=False)
    """
    return BenchPlan(selected_workloads(args), args.batch, args.quick,
                     memory=not (args.no_memory or args.quick))
