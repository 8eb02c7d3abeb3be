"""``persample audit``: the privacy of persample's DP step, audited in one training run.

The digits' SimpleCNN is trained with DP-SGD (persample's :class:`PrivateStep`) on the
training split plus canaries, each added with probability 1/2: gradient canaries
(white box: every release is read) and mislabelled input canaries (black box: the
final model's losses). The auditor's right guesses about which were added give a lower
bound on epsilon (Steinke, Nasr & Jagielski 2023), printed beside the accountant's
epsilon. A bound above it means the step leaks more than it claims: the command then
exits with status 1. ``--broken noise`` or ``--broken clipping`` runs a step broken on
purpose, to see the audit catch it. ``--mechanism bandmf`` or ``blt`` audits correlated
noise (its cyclic sampling, its accounting); ``--broken correlation`` then breaks its
noise recursion.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch
from torch import nn

from .plain import PlainHelp
from .threads import add_threads_argument, default_threads


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``audit`` and its options to ``persample``'s subcommands; returns its parser.

    Examples:
        >>> parser = argparse.ArgumentParser(prog="persample")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["audit", "--broken", "noise"]).broken
        'noise'
    """
    p = subparsers.add_parser(
        "audit", help="audit the privacy of the DP step in one training run",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.formatter_class = PlainHelp  # (the docstring's markup as text)
    p.add_argument("--canaries", type=int, default=1000,
                   help="canaries of each kind, each added with probability 1/2 (default 1000)")
    p.add_argument("--steps", type=int, default=40, help="DP-SGD steps (default 40)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="expected logical batch size (Poisson sampling; default 256)")
    p.add_argument("--sigma", type=float, default=1.5, help="noise multiplier (default 1.5)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clipping norm C (default 1.0)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta (default 1e-5)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the lower bounds (default 0.95)")
    p.add_argument("--broken", choices=("noise", "clipping", "correlation"), default=None,
                   help="audit a step broken on purpose (no noise, no clipping, or with "
                   "--mechanism a noise recursion that is not its strategy's) while the "
                   "accountant counts it as correct: the audit must flag it")
    p.add_argument("--mechanism", choices=("dpsgd", "bandmf", "blt"), default="dpsgd",
                   help="the noise: DP-SGD's (default), BandMF's or BLT's correlated noise")
    p.add_argument("--bands", type=int, default=4, help="BandMF's bands (default 4)")
    p.add_argument("--buffers", type=int, default=3, help="BLT's buffers (default 3)")
    p.add_argument("--subset", type=int, default=None,
                   help="train on the first SUBSET training examples only")
    p.add_argument("--seed", type=int, default=0,
                   help="weights, canaries, sampling and noise (default 0)")
    add_threads_argument(p, "torch CPU threads")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``audit`` with the parsed options; prints the bounds and returns the exit
    status: 0, or 1 when a bound is above the accountant's epsilon."""
    from ..dp import PrivateStep
    from ..dp.auditing import BROKEN, audit
    from .dp_train import load_split, simple_cnn

    if args.broken == "correlation" and args.mechanism == "dpsgd":
        raise SystemExit("persample audit: --broken correlation breaks a mechanism's noise: "
                         "give --mechanism bandmf or blt")
    torch.set_num_threads(args.threads or default_threads())
    x, y, _, _ = load_split(args.subset)
    torch.manual_seed(args.seed)
    model = simple_cnn().to(torch.float32)  # as the digits are
    start = time.perf_counter()
    result = audit(model, (x, y), nn.CrossEntropyLoss(), noise_multiplier=args.sigma,
                   max_grad_norm=args.max_grad_norm, expected_batch_size=args.batch_size,
                   steps=args.steps, canaries=args.canaries, lr=args.lr, delta=args.delta,
                   confidence=args.confidence, physical_batch_size=256,
                   generator=torch.Generator().manual_seed(args.seed),
                   step_type=BROKEN[args.broken] if args.broken else PrivateStep,
                   **_mechanism(args))
    seconds = time.perf_counter() - start
    print(report(result, len(y), args.broken, seconds))
    if args.json:
        figures = {"epsilon": result.epsilon, "gradient": asdict(result.gradient),
                   "input": asdict(result.input), "leaks": result.leaks,
                   "delta": result.delta, "confidence": result.confidence,
                   "canaries": result.canaries, "added": result.added,
                   "noise_multiplier": result.noise_multiplier,
                   "sample_rate": result.sample_rate, "steps": result.steps,
                   "broken": args.broken, "records": len(y), "seconds": seconds,
                   "mechanism": repr(result.mechanism) if result.mechanism else "DP-SGD"}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 1 if result.leaks else 0


def _mechanism(args: argparse.Namespace) -> dict:
    """``audit``'s mechanism keywords from the options (none for DP-SGD)."""
    if args.mechanism == "bandmf":
        return {"mechanism": "bandmf", "bands": args.bands}
    if args.mechanism == "blt":
        return {"mechanism": "blt", "buffers": args.buffers}
    return {}


WHAT = {"noise": "a step without noise", "clipping": "a step without clipping",
        "correlation": "a step whose noise recursion is not its strategy's", None:
        "persample's DP step"}


def report(result, records: int, broken: str | None, seconds: float) -> str:
    """The audit's lines for the terminal."""
    what = WHAT[broken] + ("" if result.mechanism is None else f" with {result.mechanism}")
    level = f"{100 * result.confidence:g}%"
    lines = [
        f"audit of {what}: SimpleCNN on digits, {records} records + {result.canaries} "
        f"gradient and {result.canaries} input canaries (each added with probability 1/2; "
        f"{result.added['gradient']} and {result.added['input']} were), {result.steps} "
        f"steps, sigma {result.noise_multiplier:g}, q {result.sample_rate:.4f} "
        f"({seconds:.1f} s)",
        f"  accountant's epsilon at delta {result.delta:g}: {result.epsilon:.3f}",
    ]
    for name, bound in (("white box, gradient canaries", result.gradient),
                        ("black box, input canaries", result.input)):
        if bound.guesses == 0:
            lines.append(f"  {name}: no guesses better than chance, epsilon >= 0")
        else:
            lines.append(f"  {name}: {bound.correct} of {bound.guesses} guesses right, "
                         f"epsilon >= {bound.epsilon:.3f} ({level})")
    lines.append("  LEAKS: a lower bound is above the accountant's epsilon, the step is "
                 "not as private as it claims" if result.leaks else
                 "  no leak found: the bounds are below the accountant's epsilon (an audit "
                 "can prove a leak, not its absence)")
    return "\n".join(lines)
