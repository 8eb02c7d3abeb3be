"""``persample bench``: every method side by side on the seed workloads, in one run.

PERFORMANCE.md's protocol: same process, same inputs, warm-up, then the median
of several runs. The floor is ``t_plain + bytes_out / bw`` where ``t_plain`` is
forward + ``loss.backward()`` and ``bw`` the write bandwidth measured as
``buf.fill_(1.0)`` on an already touched buffer of ``bytes_out`` bytes. Every
method's result is also compared with the loop's.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from ..api import aligned_empty
from . import anchors
from .anchors import Case, Method
from .workloads import (
    GRAD_WORKLOADS,
    JACOBIAN_WORKLOADS,
    WORKLOADS,
    grads_workload,
    jacobian_workload,
)


@dataclass
class Measured:
    method: str
    status: str = "ok"  # "ok", "not installed", or "failed: ..."
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    ratio_to_floor: float | None = None
    max_abs_diff: float | None = None  # vs the loop's result


@dataclass
class Report:
    workload: str
    description: str
    result_shape: list[int]
    bytes_out: int
    base_label: str  # what t_plain measures
    t_plain_ms: float
    t_fill_ms: float
    bandwidth_gb_s: float
    floor_ms: float
    reference: str  # the method every result is checked against
    methods: list[Measured]
    speedup_over_best_other: float | None = None
    best_other: str | None = None


def _reps(quick: bool) -> tuple[int, int]:
    """(warm-up calls, timed rounds)."""
    return (0, 2) if quick else (2, 7)


@dataclass
class _Timer:
    row: Measured
    run: Callable[[], object]
    rounds: int  # how many of the rounds it takes part in


def bench_case(case: Case, quick: bool, step: Callable[[str], None]) -> Report:
    """Time every method of ``case`` side by side and check each against the reference.

    Each method runs once first (its result is compared with the reference, and
    that run is a warm-up), then all methods are timed in interleaved rounds, so
    that the machine's drift hits them alike. A method whose first run takes
    over a second joins only the first 3 rounds; with ``quick``, its first run
    is its only time. The reference method's first run is the reference itself.
    """
    warmup, repeats = _reps(quick)
    w = case.workload
    # the caller-owned result buffer for out=: rows 64-byte aligned, already touched
    buf = aligned_empty(case.result_shape, w.inputs.dtype, w.inputs.device).zero_()
    step(f"{case.reference_label} (reference)")
    start = time.perf_counter()
    reference = case.reference()
    first_run = {case.reference_label: (reference, time.perf_counter() - start)}
    base, fill = Measured(case.base_label), Measured("write result (fill_)")
    timers = [_Timer(base, case.base, repeats), _Timer(fill, lambda: buf.fill_(1.0), repeats)]
    for method in case.methods:
        step(method.name)
        timers.append(_prepare(method, buf, reference, repeats, quick, first_run))
    case.after_check()
    for timer in timers[:2]:
        for _ in range(warmup):
            timer.run()
    for r in range(repeats):
        step(f"round {r + 1} of {repeats}")
        for timer in timers:
            if r < timer.rounds:
                start = time.perf_counter()
                timer.run()
                timer.row.times_ms.append((time.perf_counter() - start) * 1e3)
                gc.collect()
    for timer in timers:
        if timer.row.times_ms:
            timer.row.median_ms = statistics.median(timer.row.times_ms)
    w.model.zero_grad(set_to_none=True)
    floor = base.median_ms + fill.median_ms
    rows = [t.row for t in timers[2:]]
    for row in rows:
        if row.median_ms is not None:
            row.ratio_to_floor = row.median_ms / floor
    bytes_out = buf.numel() * buf.element_size()
    report = Report(w.name, w.description, list(case.result_shape), bytes_out, case.base_label,
                    base.median_ms, fill.median_ms, bytes_out / fill.median_ms / 1e6, floor,
                    case.reference_label, rows)
    _speedup(report, next(m.name for m in case.methods if m.ours))
    return report


def _prepare(method: Method, buf, reference, repeats: int, quick: bool,
             first_run: dict[str, tuple]) -> _Timer:
    """Run ``method`` once, compare its result with ``reference``; a timer for the rounds.

    ``first_run`` maps a method's name to its result and time if it already ran.
    """
    row = Measured(method.name)
    if method.fn is None:
        row.status = method.note
        return _Timer(row, lambda: None, 0)
    run = lambda: method.fn(buf)  # noqa: E731
    try:
        if method.name in first_run:
            result, first = first_run[method.name]
        else:
            start = time.perf_counter()
            result = run()
            first = time.perf_counter() - start
        row.max_abs_diff = (result.reshape(reference.shape) - reference).abs().max().item()
        del result
        for _ in range(1 if first < 1.0 and not quick else 0):  # a second warm-up
            run()
    except Exception as err:  # a competitor failing must not stop the benchmark
        row.status = f"failed: {type(err).__name__}: {err}"[:200]
        return _Timer(row, lambda: None, 0)
    if first > 1.0 and quick:
        row.times_ms.append(first * 1e3)
        return _Timer(row, run, 0)
    return _Timer(row, run, min(repeats, 3) if first > 1.0 else repeats)


def _speedup(report: Report, ours_name: str) -> None:
    ours = next(m for m in report.methods if m.method == ours_name)
    others = [m for m in report.methods
              if not m.method.startswith("persample") and m.median_ms is not None]
    if ours.median_ms and others:
        best = min(others, key=lambda m: m.median_ms)
        report.best_other = best.method
        report.speedup_over_best_other = best.median_ms / ours.median_ms


def format_report(r: Report) -> str:
    lines = [
        f"{r.workload}: {r.description}",
        f"  result {tuple(r.result_shape)}, {r.bytes_out / 1e6:,.1f} MB; "
        f"write bandwidth {r.bandwidth_gb_s:.1f} GB/s; results checked against {r.reference}",
        f"  {'method':<24}{'median ms':>11}{'x floor':>9}{'max |diff|':>12}",
        f"  {r.base_label + ' (t_plain)':<24}{r.t_plain_ms:>11.2f}",
        f"  {'write result (fill_)':<24}{r.t_fill_ms:>11.2f}",
        f"  {'floor':<24}{r.floor_ms:>11.2f}{1.0:>9.2f}",
    ]
    for m in r.methods:
        if m.median_ms is None:
            lines.append(f"  {m.method:<24}  {m.status}")
        else:
            lines.append(f"  {m.method:<24}{m.median_ms:>11.2f}{m.ratio_to_floor:>9.2f}"
                         f"{m.max_abs_diff:>12.1e}")
    if r.speedup_over_best_other:
        lines.append(f"  persample is {r.speedup_over_best_other:.2f}x faster than the best "
                     f"other method ({r.best_other})")
    return "\n".join(lines)


def plot_reports(reports: list[Report], path: str) -> None:
    """A horizontal bar chart of median times per method, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 1, figsize=(8, 2.8 * len(reports)), squeeze=False)
    for ax, r in zip(axes[:, 0], reports):
        measured = [m for m in r.methods if m.median_ms is not None]
        names = [r.base_label] + [m.method for m in measured]
        times = [r.t_plain_ms] + [m.median_ms for m in measured]
        colors = ["grey"] + ["tab:green" if m.method.startswith("persample") else "tab:blue"
                             for m in measured]
        ax.barh(names, times, color=colors)
        ax.axvline(r.floor_ms, color="black", linestyle="--", label=f"floor {r.floor_ms:.0f} ms")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("median time per batch (ms, log scale)")
        ax.set_title(f"{r.workload}: {r.description}", fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_case(name: str, batch: int | None) -> Case:
    if name in GRAD_WORKLOADS:
        return anchors.grads_case(grads_workload(name, batch))
    if name == "mlp-param-jac":
        return anchors.param_jacobian_case(jacobian_workload(name, batch))
    if name in JACOBIAN_WORKLOADS:
        return anchors.input_jacobian_case(jacobian_workload(name, batch))
    if name == "cnn-norms":
        w = grads_workload("cnn-grads", batch)
        return anchors.norms_case(replace(w, name=name, description=w.description.replace(
            "cross-entropy", "per-sample gradient norms")))
    if name == "cnn-dp-step":
        w = grads_workload("cnn-grads", batch)
        return anchors.dp_step_case(replace(w, name=name, description=w.description.replace(
            "cross-entropy", f"one DP-SGD step (C = {anchors.DP_MAX_GRAD_NORM}, sigma = 1)")))
    raise SystemExit(f"unknown workload {name!r}; choose from {WORKLOADS}")


def run(workloads: list[str], quick: bool, batch: int | None, threads: int,
        json_path: str | None, plot_path: str | None) -> list[Report]:
    """Run the benchmark, print the tables, and write the JSON and the plot if asked."""
    torch.set_num_threads(threads)
    # Opacus's and BackPACK's hooks warn on every call when inputs need no grad
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    reports = []
    with tqdm(total=len(workloads), desc="persample bench", unit="workload") as bar:
        for name in workloads:
            def step(label: str, name=name) -> None:
                bar.set_postfix_str(f"{name}: {label}")

            reports.append(bench_case(build_case(name, batch), quick, step))
            bar.update(1)
            gc.collect()
    for r in reports:
        print(format_report(r), end="\n\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine_info(threads), "quick": quick,
                       "workloads": [asdict(r) for r in reports]}, f, indent=2)
        print(f"wrote {json_path}")
    if plot_path:
        plot_reports(reports, plot_path)
        print(f"wrote {plot_path}")
    return reports


def machine_info(threads: int) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": threads}
