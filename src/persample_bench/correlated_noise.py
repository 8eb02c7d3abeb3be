"""DP-SGD against correlated noise (BandMF, BLT) at the same epsilon, on the bundled
digits: ``python -m persample_bench.correlated_noise``.

Each run is ``persample dp-train`` (the SimpleCNN, SGD with momentum 0.9; Poisson
sampling for DP-SGD, cyclic Poisson sampling over the bands for BandMF, fixed batches
an epoch apart for BLT; the noise multiplier calibrated to the target epsilon at
``delta = 1e-5`` by RDP over the run's accounting), for every target epsilon, mechanism
and seed; the table gives the final test accuracy's mean and standard deviation over
the seeds and the seconds per epoch (the noise's recursion is the only work a mechanism
adds to a step). Sources: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization: A unified approach to private training"; McMahan, Xu & Zhang 2024, "A
Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use
BLTs".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from persample.cli.dp_train import DPTrainConfig, run


def options(spec: str) -> dict:
    """``dp-train``'s options of a mechanism written ``dpsgd``, ``bandmf:B`` or
    ``blt:D``.

    Examples:
        >>> options("bandmf:16"), options("blt:3"), options("dpsgd")
        ({'mechanism': 'bandmf', 'bands': 16}, {'mechanism': 'blt', 'buffers': 3}, {'mechanism': 'dpsgd'})
    """  # noqa: E501
    name, _, size = spec.partition(":")
    if name == "dpsgd" and not size:
        return {"mechanism": "dpsgd"}
    if name in ("bandmf", "blt") and size.isdigit():
        return {"mechanism": name, "bands" if name == "bandmf" else "buffers": int(size)}
    raise ValueError(f"a mechanism is dpsgd, bandmf:BANDS or blt:BUFFERS, got {spec!r}")


def compare(epsilons: list[float], mechanisms: list[str], seeds: list[int], epochs: int,
            batch_size: int, threads: int) -> list[dict]:
    """One row per (epsilon, mechanism): ``epsilon``, ``mechanism``, ``accuracy`` (per
    seed), ``mean``, ``std``, ``sigma``, ``seconds_per_epoch`` (mean over the seeds)."""
    rows = []
    base = DPTrainConfig(epochs=epochs, batch_size=batch_size, threads=threads, progress=False)
    for eps in epsilons:
        for spec in mechanisms:
            cfg = replace(base, target_epsilon=eps, **options(spec))
            results = [run(replace(cfg, seed=s)) for s in seeds]
            accuracy = [r["runs"][0]["final_test_accuracy"] for r in results]
            rows.append({"epsilon": eps, "mechanism": results[0]["privacy"]["mechanism"],
                         "accuracy": accuracy, "mean": statistics.mean(accuracy),
                         "std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
                         "sigma": results[0]["privacy"]["sigma"],
                         "epsilon_spent": max(r["privacy"]["epsilon"] for r in results),
                         "seconds_per_epoch": statistics.mean(
                             r["runs"][0]["seconds_per_epoch"] for r in results)})
    return rows


def noise_cost(workload: str = "gpt2-768-dp-step", spec: str = "bandmf:4", repeats: int = 5,
               threads: int = 2) -> dict:
    """The cost of a mechanism's noise at real size: one DP step (``accumulate`` then
    ``release``, sigma 1) of the bench's ``workload`` with DP-SGD's noise and with the
    mechanism's (``bandmf:B`` or ``blt:D``), alternated ``repeats`` times after a
    warm-up (median seconds each), and the state the recursion keeps (float32
    parameter-sized rows: BandMF's last ``B - 1`` draws and the release's own, drawn
    there instead of a buffer of its own; BLT's ``D`` buffers and the draw).

    Returns:
        ``{"workload", "mechanism", "parameters", "dpsgd_s", "mechanism_s", "ratio",
        "state_mb"}``.
    """
    import time

    import torch

    from persample.dp import PrivateStep
    from persample.dp.mechanisms import resolve_mechanism

    from .workloads import dp_workload

    torch.set_num_threads(threads)
    w = dp_workload(workload)
    opts = options(spec)
    warm = opts.get("bands", 3)
    mechanism = resolve_mechanism(opts["mechanism"], 10 * repeats + 10, 1 / (10 * repeats + 10),
                                  bands=opts.get("bands"), buffers=opts.get("buffers"))
    steps = {}
    for name, mech in (("dpsgd", None), ("mechanism", mechanism)):
        steps[name] = PrivateStep(w.model, w.loss_fn, max_grad_norm=1.0, noise_multiplier=1.0,
                                  expected_batch_size=len(w.targets), mechanism=mech,
                                  generator=torch.Generator().manual_seed(0), check="never")

    def once(step) -> float:
        start = time.perf_counter()
        step.accumulate(w.inputs, w.targets)
        step.release()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"dpsgd": [], "mechanism": []}
    for k in range(repeats + warm):  # the first: warm-up (and the states filled)
        for name, step in steps.items():
            t = once(step)
            if k >= warm:
                times[name].append(t)
    params = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    dpsgd, mine = statistics.median(times["dpsgd"]), statistics.median(times["mechanism"])
    return {"workload": workload, "mechanism": repr(mechanism), "parameters": params,
            "dpsgd_s": dpsgd, "mechanism_s": mine, "ratio": mine / dpsgd,
            "state_mb": mechanism.rows * params * 4 / 2 ** 20}


def format_rows(rows: list[dict]) -> str:
    """The table as Markdown.

    Examples:
        >>> print(format_rows([{"epsilon": 4.0, "mechanism": "DP-SGD", "mean": 0.8,
        ...     "std": 0.01, "accuracy": [0.79, 0.81], "sigma": 1.2, "epsilon_spent": 3.99,
        ...     "seconds_per_epoch": 2.0}]))  # doctest: +NORMALIZE_WHITESPACE
        | epsilon | mechanism | test accuracy (mean +- std) | per seed | sigma | s/epoch |
        |---|---|---|---|---|---|
        | 4 | DP-SGD | 0.800 +- 0.010 | 0.790, 0.810 | 1.200 | 2.00 |
    """
    lines = ["| epsilon | mechanism | test accuracy (mean +- std) | per seed | sigma | s/epoch |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        seeds = ", ".join(f"{a:.3f}" for a in r["accuracy"])
        lines.append(f"| {r['epsilon']:g} | {r['mechanism']} | {r['mean']:.3f} +- "
                     f"{r['std']:.3f} | {seeds} | {r['sigma']:.3f} | "
                     f"{r['seconds_per_epoch']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison with ``argv``'s options; print the table; returns 0."""
    p = argparse.ArgumentParser(prog="python -m persample_bench.correlated_noise",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--mechanisms", nargs="+", default=["dpsgd", "bandmf:4", "bandmf:16",
                                                        "blt:3"],
                   help="dpsgd, bandmf:BANDS, blt:BUFFERS (default: DP-SGD, BandMF with 4 "
                   "and 16 bands, BLT with 3 buffers)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--cost", metavar="WORKLOAD", nargs="?", const="gpt2-768-dp-step",
                   help="instead: the time and memory each mechanism's noise adds to one DP "
                   "step of this benchmark workload (default gpt2-768-dp-step)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cost:
        for spec in [m for m in args.mechanisms if m != "dpsgd"]:
            got = noise_cost(args.cost, spec, threads=args.threads)
            print(f"{got['workload']} ({got['parameters']:,} parameters): DP step with "
                  f"DP-SGD's noise {got['dpsgd_s'] * 1e3:.1f} ms, with {got['mechanism']}'s "
                  f"{got['mechanism_s'] * 1e3:.1f} ms ({got['ratio']:.3f}x); its state "
                  f"{got['state_mb']:.0f} MB")
        return 0
    rows = compare(args.epsilons, args.mechanisms, args.seeds, args.epochs, args.batch_size,
                   args.threads)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
