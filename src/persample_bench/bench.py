"""``persample bench``: every method side by side on the workloads, in one run.

Measured fairly: same process, same inputs,
warm-up, then the median of several interleaved rounds; every method is timed as
its users call it and returns what they get (persample's default call and
``torch.func`` both return a fresh dict; persample's ``out=`` row is labelled).
Results are flattened and compared with the reference outside the timed calls.

The floor is ``t_plain + t_write``: ``t_plain`` is a plain forward +
``loss.backward()`` (or the case's own baseline) and ``t_write`` is ``fill_`` of a
touched buffer of the result's bytes. Where one matrix product dominates
(``clf-input-jac``) that product is the floor. On a GPU every timed call is
bracketed by ``torch.cuda.synchronize()``.

Peak memory of one call per method: on the GPU ``torch.cuda.max_memory_allocated``
(reset before the call) above ``memory_allocated`` before it; on the CPU the peak
resident set size of the call in a fresh process (``python -m persample_bench
--_memory-probe WORKLOAD METHOD``), above the process's RSS after building the case.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import persample
from persample import aligned_empty, clear_plans
from persample.certificate import checking, forget
from persample.cli._rss import reset_peak_rss, status_kib
from persample.cli.threads import load_average, threads_label, usable_cpus

from . import anchors
from .anchors import Case, Method, as_flat, curvature_rows
from .anchors.persample_rows import NEW_BATCH_OURS, NEW_BATCH_PLAIN
from .real_models import NotInstalled
from .workloads import (
    ATTRIBUTION_WORKLOADS,
    CURVATURE_WORKLOADS,
    DP_WORKLOADS,
    GRAD_WORKLOADS,
    JACOBIAN_WORKLOADS,
    REAL_CURVATURE_WORKLOADS,
    WORKLOADS,
    attribution_workload,
    curvature_workload,
    dp_workload,
    grads_workload,
    influence_train,
    jacobian_workload,
    projected_dim,
)

AGREE_TOLERANCE = 1e-4  # max |diff| <= this * max(1, max |reference|): the result agrees
SLOW_S = 1.0  # a timer whose first call takes longer joins only the first 3 rounds
SETTLE_CALLS = 5  # calls of a method whose first takes less than SLOW_S before its rounds:
# persample's plan settles by its fifth call of a kind (a program traced, then compiled)
VERY_SLOW_S = 5.0  # ... and one this slow only the first round (real-size models on a CPU)
MB = 1e6  # bytes; peak memory and result sizes are in MB (10^6 bytes)


@dataclass
class Measured:
    """One method's figures (a row of the table, an entry of the JSON's ``methods``).

    Attributes:
        method: the row's label.
        status: ``"ok"``, ``"not installed ..."``, ``"not applicable: ..."``,
            ``"skipped: ..."`` or ``"failed: ..."``.
        median_ms: median time of one call in milliseconds (the steady state: the calls
            after :data:`SETTLE_CALLS` untimed ones, or after the first where it took
            over :data:`SLOW_S`).
        first_ms: the first call's time in milliseconds (on a model no persample call
            has seen, for persample's first row: the data flow decided anew).
        times_ms: every timed call, in milliseconds.
        ratio_to_floor: ``median_ms / floor_ms``.
        peak_mb: the call's extra peak memory in MB (10^6 bytes): on the CPU its peak
            RSS above the RSS before it (fresh process), on the GPU
            ``max_memory_allocated`` above ``memory_allocated`` before it.
        peak_total_mb: the peak itself: the process's peak RSS, or
            ``max_memory_allocated``, in MB.
        max_abs_diff: largest ``|result - reference|`` over the flattened result.
        agrees: ``max_abs_diff <= AGREE_TOLERANCE * max(1, max |reference|)`` (2e-2
            under bfloat16 autocast: :func:`agree_tolerance`); a row
            that does not agree is left out of the speed-up.
        note: a remark on how the method was called (printed under the table).
    """

    method: str
    status: str = "ok"
    median_ms: float | None = None
    first_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    ratio_to_floor: float | None = None
    peak_mb: float | None = None
    peak_total_mb: float | None = None
    max_abs_diff: float | None = None
    agrees: bool | None = None
    note: str = ""


@dataclass
class Report:
    """One workload's figures (an entry of the JSON's ``workloads``); times in ms,
    sizes in MB (10^6 bytes). ``floor_ms = t_plain_ms + t_fill_ms`` unless
    ``t_product_ms`` is set (then it is the floor, named by ``floor_label``)."""

    workload: str
    description: str
    device: str
    result_shape: list[int]
    bytes_out: int
    base_label: str  # what t_plain measures
    t_plain_ms: float
    plain_peak_mb: float | None
    t_fill_ms: float
    bandwidth_gb_s: float
    floor_label: str
    floor_ms: float
    t_product_ms: float | None
    reference: str  # the method every result is checked against
    ours: str  # the default call's row
    methods: list[Measured]
    memory: str  # what peak_mb measures
    speedup_over_best_other: float | None = None
    best_other: str | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)  # label -> median ms
    # persample's first call of a new plan: {"certified": ms, "never": ms} (check=)
    first_calls: dict[str, float] = field(default_factory=dict)
    forward_ops: int | None = None  # ops of one forward (a TorchFunctionMode's count)
    # method -> (median ms - t_plain ms) / forward_ops, in microseconds
    us_per_op: dict[str, float] = field(default_factory=dict)


def _reps(quick: bool) -> tuple[int, int]:
    """(warm-up calls, timed rounds)."""
    return (0, 2) if quick else (2, 7)


@dataclass
class _Timer:
    row: Measured
    run: Callable[[], object]
    rounds: int  # how many of the rounds it takes part in


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _first_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, dict]:
    """``fn()`` once: its result, its seconds, and on a GPU its peak memory (MB)."""
    sync, memory = _synchronizer(device), {}
    cuda = device.type == "cuda"
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    seconds = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        memory = {"peak_mb": (peak - before) / MB, "peak_total_mb": peak / MB}
    return result, seconds, memory


def memory_label(device: torch.device) -> str:
    """What ``peak_mb`` means on ``device`` (the table's and the JSON's label).

    Examples:
        >>> memory_label(torch.device("cpu")).split(" (")[0]
        'peak RSS of one call in a fresh process above the RSS after building the case'
    """
    if device.type == "cuda":
        return ("torch.cuda.max_memory_allocated during one call above memory_allocated "
                "before it")
    return ("peak RSS of one call in a fresh process above the RSS after building the case "
            "(first call; peak_total_mb: the process's peak RSS)")


def bench_case(case: Case, quick: bool, step: Callable[[str], None],
               probe: Callable[[str], dict] | None = None) -> Report:
    """Time every method of ``case`` side by side and check each against the reference.

    Each method runs once first (its result is flattened and compared with the
    reference, and that run is a warm-up; on a GPU its peak memory is taken
    then), and up to :data:`SETTLE_CALLS` times in all where that took under
    :data:`SLOW_S` (persample's plan settles by then: the rounds time its steady
    state), then all methods are timed in interleaved rounds, so that the
    machine's drift hits them alike. A method whose first run takes over
    :data:`SLOW_S` (a second) joins only the first 3 rounds, one over
    :data:`VERY_SLOW_S` only the first round; with ``quick``, a first run over
    :data:`VERY_SLOW_S` is that method's only time. The baseline, the write and the
    diagnostics warm up with their first call, and a slow one skips the second
    warm-up and joins as few rounds. The reference method's first run is the
    reference itself. The reference is freed before the rounds, the ``out=`` buffer
    before the memory probes.

    Args:
        case: the workload and its methods (:mod:`persample_bench.anchors`).
        quick: no warm-up, 2 rounds.
        step: called with a label before each stage (progress display).
        probe: on the CPU, ``probe(method_name) -> {"extra_peak_mb", "peak_rss_mb"}``
            measures one call's memory in a fresh process (``None``: no memory figures).

    Returns:
        The :class:`Report`; times in ms.

    Examples:
        >>> r = bench_case(build_case("deep-mlp-grads", 2), True, lambda label: None)
        >>> r.ours, r.result_shape, r.floor_ms > r.t_plain_ms > 0
        ('persample', [2, 4515602], True)
    """
    warmup, repeats = _reps(quick)
    w = case.workload
    device = w.device
    sync = _synchronizer(device)
    # the caller-owned result buffer for out=, as the README advises: rows 64-byte aligned
    # (persample.aligned_empty); touched before the rounds (a method that writes into it
    # touches it in its first call: the first calls hold no reference-sized page of it
    # that no method writes)
    buf = aligned_empty(case.result_shape, w.dtype, device)
    step(f"{case.reference_label} (reference)")
    reseed = _reseed(w.seed)
    reseed()
    reference, seconds, memory = _first_call(case.reference, device)
    reference = as_flat(reference, case.result_shape)
    first_run = {case.reference_label: (reference, seconds, memory)}
    base, fill = Measured(case.base_label), Measured("write result (fill_)")
    if device.type == "cuda":
        _, _, memory = _first_call(case.base, device)
        base.peak_mb, base.peak_total_mb = memory["peak_mb"], memory["peak_total_mb"]
    timers = [_Timer(base, case.base, repeats), _Timer(fill, partial(buf.fill_, 1.0), repeats)]
    product = None
    if case.floor is not None:
        product = Measured(case.floor_label)
        timers.append(_Timer(product, case.floor, repeats))
    diagnostics = [Measured(label) for label, _ in case.diagnostics]
    timers += [_Timer(row, fn, repeats) for row, (_, fn) in zip(diagnostics, case.diagnostics)]
    fixed = len(timers)
    for method in case.methods:
        step(method.name)
        reseed()
        timers.append(_prepare(method, buf, reference, repeats, quick, first_run, device,
                               agree_tolerance(w)))
    del first_run, reference  # every result is checked: the rounds need no reference
    gc.collect()
    buf.zero_()
    case.after_check()
    for timer in timers[:fixed]:
        _warm_up(timer, warmup, repeats, sync)
    with _older_objects_frozen():
        for r in range(repeats):
            step(f"round {r + 1} of {repeats}")
            for timer in timers:
                if r < timer.rounds:
                    sync()
                    start = time.perf_counter()
                    result = timer.run()
                    sync()
                    timer.row.times_ms.append((time.perf_counter() - start) * 1e3)
                    del result  # freed after the clock stops: users hold their result
                    gc.collect()
    for timer in timers:
        if timer.row.times_ms:
            timer.row.median_ms = statistics.median(timer.row.times_ms)
    w.model.zero_grad(set_to_none=True)
    rows = [t.row for t in timers[fixed:]]
    ours_at = next(k for k, m in enumerate(case.methods) if m.ours)
    first_calls = _first_calls(case.methods[ours_at], buf, rows[ours_at], quick, device, step)
    bytes_out = buf.numel() * buf.element_size()
    del timers, timer, buf  # a real-size result is gigabytes: freed for the probes
    gc.collect()
    if probe is not None:
        for row in [base] + [r for r in rows if r.status == "ok"]:
            step(f"memory: {row.method}")
            figures = probe(row.method)
            row.peak_mb, row.peak_total_mb = figures.get("extra_peak_mb"), figures.get(
                "peak_rss_mb")
    floor = product.median_ms if product is not None else base.median_ms + fill.median_ms
    for row in rows:
        if row.median_ms is not None:
            row.ratio_to_floor = row.median_ms / floor
    ours = next(m.name for m in case.methods if m.ours)
    report = Report(
        w.name, w.description, str(device), list(case.result_shape), bytes_out,
        case.base_label, base.median_ms, base.peak_mb, fill.median_ms,
        bytes_out / fill.median_ms / 1e6, case.floor_label or "t_plain + write", floor,
        product.median_ms if product is not None else None, case.reference_label, ours, rows,
        memory_label(device) if probe is not None or device.type == "cuda" else "not measured")
    report.diagnostics = {row.method: row.median_ms for row in diagnostics}
    report.first_calls = first_calls
    report.forward_ops = case.forward_ops
    if case.forward_ops:
        report.us_per_op = {row.method: (row.median_ms - base.median_ms) * 1e3 / case.forward_ops
                            for row in rows if row.median_ms is not None
                            and row.agrees is not False}
    _speedup(report)
    return report


def _first_calls(method: Method, buf: torch.Tensor, row: Measured, quick: bool,
                 device: torch.device, step: Callable[[str], None]) -> dict[str, float]:
    """persample's first call of a plan not seen before (:func:`persample.clear_plans`,
    :func:`persample.certificate.forget`), certified (``check="first"``) and not
    (``"never"``), alternated: 3 pairs, one where a call is slow or ``quick``. Median ms
    of each, ``{}`` where the method did not run."""
    if method.fn is None or row.status != "ok":
        return {}
    sync = _synchronizer(device)
    times: dict[str, list[float]] = {"certified": [], "never": []}
    pairs = 1 if quick or (row.first_ms or 0) > SLOW_S * 1e3 else 3
    for k in range(pairs):
        for label, check in (("certified", "first"), ("never", "never")):
            step(f"first call, {label} ({k + 1} of {pairs})")
            clear_plans()
            forget()
            gc.collect()
            with checking(check):
                sync()
                start = time.perf_counter()
                result = method.fn(buf)
                sync()
                times[label].append((time.perf_counter() - start) * 1e3)
            del result
    return {label: statistics.median(v) for label, v in times.items()}


def _reseed(seed: int | None) -> Callable[[], None]:
    """For a workload that draws random numbers: the generators at ``seed`` before the
    reference and each method's checked first call (the same forward for each); the
    timed calls draw on, as training does."""
    return (lambda: None) if seed is None else (lambda: torch.manual_seed(seed) and None)


@contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """The objects alive as the rounds begin (the case, the imported libraries: about
    400,000 with transformers and Opacus) frozen (``gc.freeze``) until they end, so that
    a collection looks only at what the rounds made: the benchmark's own after each
    timed call (outside the clock), and any a method runs inside its call (kronfluence
    collects about 7 times a call). A full collection of the benchmark's heap takes a
    quarter of a second on a 2-core machine, which a user's script, importing one
    library, would not pay: unfrozen, kronfluence's call measured 2.5 s against 0.8 s.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def agree_tolerance(w: Any) -> float:
    """:data:`AGREE_TOLERANCE`, or 2e-2 where the methods round below float32: under
    bfloat16 autocast (its 8 significand bits: the reference loop rounds each per-sample
    gradient there), and on a GPU where TF32 is on for what the model runs (cuDNN's
    convolutions and recurrent layers by default, ``torch.backends.cudnn.allow_tf32``:
    on an H200 the LSTM workload's per-sample gradients differ from the loop's by 6e-4
    with it, 4e-6 without; matrix products with
    ``torch.backends.cuda.matmul.allow_tf32``): 10 significand bits, and a loop over
    samples picks other kernels than a batch.

    Examples:
        >>> agree_tolerance(type("W", (), {"autocast": torch.bfloat16})())
        0.02
    """
    if getattr(w, "autocast", None) == torch.bfloat16 or _tf32(w):
        return 2e-2
    return AGREE_TOLERANCE


def _tf32(w: Any) -> bool:
    """Whether workload ``w`` runs in TF32 on its GPU (see :func:`agree_tolerance`)."""
    device, model = getattr(w, "device", None), getattr(w, "model", None)
    if device is None or torch.device(device).type != "cuda" or model is None:
        return False
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    return torch.backends.cudnn.allow_tf32 and any(
        isinstance(m, (torch.nn.modules.conv._ConvNd, torch.nn.RNNBase))
        for m in model.modules())


def _prepare(method: Method, buf: torch.Tensor, reference: torch.Tensor, repeats: int,
             quick: bool, first_run: dict[str, tuple], device: torch.device,
             tolerance: float = AGREE_TOLERANCE) -> _Timer:
    """Run ``method`` once, compare its flattened result with ``reference``; a timer for
    the rounds. ``first_run`` maps a method's name to its result, seconds and memory if
    it already ran."""
    row = Measured(method.name, note=method.note)
    if method.fn is None:
        row.status, row.note = method.note, ""
        return _Timer(row, lambda: None, 0)
    run = lambda: method.fn(buf)  # noqa: E731
    try:
        if method.name in first_run:
            result, first, memory = first_run[method.name]
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                warnings.simplefilter("ignore", DeprecationWarning)  # torch's own internals
                warnings.simplefilter("ignore", FutureWarning)
                result, first, memory = _first_call(run, device)
            _note_warnings(row, caught)
        row.peak_mb, row.peak_total_mb = memory.get("peak_mb"), memory.get("peak_total_mb")
        row.first_ms = first * 1e3
        row.max_abs_diff = max_abs_diff(result, reference)
        scale = _chunked_max(reference, None)
        row.agrees = row.max_abs_diff <= tolerance * max(1.0, scale)
        del result
        for _ in range(SETTLE_CALLS - 1 if first < SLOW_S and not quick else 0):  # (warm-up)
            run()
    except Exception as err:  # a competitor failing must not stop the benchmark
        row.status = f"failed: {type(err).__name__}: {err}"[:200]
        return _Timer(row, lambda: None, 0)
    if first > VERY_SLOW_S and quick:  # (a first call holds one-off costs: tracing,
        row.times_ms.append(first * 1e3)  # a plan certified; only a very slow one is
        return _Timer(row, run, 0)  # timed by it alone)
    return _Timer(row, run, _rounds(first, repeats))


def _rounds(first_s: float, repeats: int) -> int:
    """How many of the ``repeats`` rounds a timer whose first call took ``first_s``
    joins: all, 3 when it is slow, 1 when it is very slow."""
    if first_s > VERY_SLOW_S:
        return 1
    return min(repeats, 3) if first_s > SLOW_S else repeats


def _warm_up(timer: _Timer, warmup: int, repeats: int, sync: Callable[[], None]) -> None:
    """``warmup`` untimed calls of a fixed timer (the baseline, the write, the floor, a
    diagnostic); the first is clocked, and a slow one ends the warm-up and joins fewer
    rounds (:func:`_rounds`)."""
    for k in range(warmup):
        sync()
        start = time.perf_counter()
        timer.run()
        sync()
        seconds = time.perf_counter() - start
        if k == 0 and seconds > SLOW_S:
            timer.rounds = _rounds(seconds, repeats)
            return


CHUNK_NUMEL = 1 << 24  # entries compared at a time: 64 MB of float32 temporaries


def max_abs_diff(result: Any, reference: torch.Tensor) -> float:
    """The largest ``|result - reference|``, ``result`` in any form :func:`as_flat` takes,
    without concatenating it or making a temporary of the reference's size: each entry
    of a dict is compared with its own columns of the reference (the last dim, in the
    dict's order), a few rows at a time. Results of gigabytes stay at their size.

    Raises:
        ValueError: a dict entry whose leading dims are not the reference's.
        RuntimeError: the numbers do not fit the reference's shape.

    Examples:
        >>> ref = torch.zeros(2, 5)
        >>> max_abs_diff({"w": torch.ones(2, 2, 2), "b": torch.zeros(2, 1)}, ref)
        1.0
    """
    shape = tuple(reference.shape)
    if not isinstance(result, Mapping):
        return _chunked_max(result.reshape(shape), reference)
    lead, start, worst = shape[:-1], 0, 0.0
    for name, t in result.items():
        if tuple(t.shape[: len(lead)]) != lead:
            as_flat({name: t}, shape)  # raises the ValueError naming it
        part = t.reshape(*lead, -1)
        width = part.shape[-1]
        worst = max(worst, _chunked_max(part, reference[..., start:start + width]))
        start += width
    if start != shape[-1]:
        raise RuntimeError(f"the result has {start} numbers per row, the reference "
                           f"{shape[-1]}")
    return worst


def _chunked_max(a: torch.Tensor, b: torch.Tensor | None) -> float:
    """``max |a - b|`` (``max |a|`` where ``b`` is None) over dim-0 slices of about
    :data:`CHUNK_NUMEL` entries; 0 for an empty tensor."""
    if a.numel() == 0:
        return 0.0
    per_row = max(1, a[0].numel()) if a.ndim > 1 else 1
    step = max(1, CHUNK_NUMEL // per_row)
    worst = 0.0
    for i in range(0, a.shape[0] if a.ndim else 1, step):
        x = a[i:i + step] if a.ndim else a
        d = x if b is None else x - (b[i:i + step] if b.ndim else b)
        worst = max(worst, d.abs().max().item())
    return worst


def _ignore_noise() -> None:
    """Hide warnings that every call repeats: Opacus's and BackPACK's hooks when inputs need
    no grad, and torch.func's slow fallbacks (noted once per row by :func:`_note_warnings`)."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="There is a performance drop")


def _note_warnings(row: Measured, caught: list) -> None:
    """Add the first sentence of each distinct warning of a method's first call to its note
    (torch.func's fallbacks, persample's own fallbacks)."""
    seen, slow_ops = [], []
    for w in caught:
        text = str(w.message).split(". ")[0].strip()
        fallback = re.match(r"There is a performance drop because we have not yet implemented "
                            r"the batching rule for (\S+)", text)
        if fallback:
            if fallback[1] not in slow_ops:
                slow_ops.append(fallback[1])
        elif "Full backward hook is firing" not in text and text not in seen:
            seen.append(text)
    if slow_ops:
        seen.insert(0, f"vmap has no batching rule for {', '.join(slow_ops)} (a slow fallback)")
    if seen:
        row.note = "; ".join(([row.note] if row.note else []) + [f"warned: {t}" for t in seen])


def _speedup(report: Report) -> None:
    ours = next(m for m in report.methods if m.method == report.ours)
    others = [m for m in report.methods if not m.method.startswith("persample")
              and m.median_ms is not None and m.agrees]
    if ours.median_ms and others:
        best = min(others, key=lambda m: m.median_ms)
        report.best_other = best.method
        report.speedup_over_best_other = best.median_ms / ours.median_ms


def _spread(times: list[float]) -> str:
    """The rounds' range relative to their median (``"12%"``): how much to trust a row on
    a loaded machine; blank for one round."""
    if len(times) < 2:
        return ""
    return f"{(max(times) - min(times)) / statistics.median(times):.0%}"


def _round_range(r: Report) -> str:
    """The speed-up round by round (the rounds are interleaved, so each pair ran under
    the same load): ``" (per round 0.95-1.40x)"``; blank without paired rounds."""
    found = _round_ratios(r)
    return "" if found is None else f" (per round {found[0]:.2f}-{found[1]:.2f}x)"


def _round_ratios(r: Report) -> tuple[float, float] | None:
    """The lowest and highest speed-up over the paired rounds; ``None`` without them."""
    ours = next(m for m in r.methods if m.method == r.ours)
    best = next(m for m in r.methods if m.method == r.best_other)
    pairs = list(zip(best.times_ms, ours.times_ms))
    if len(pairs) < 2 or len(best.times_ms) != len(ours.times_ms):
        return None
    ratios = [b / o for b, o in pairs]
    return min(ratios), max(ratios)


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if value is not None else " " * width


def _new_batch_ratio(r: Report) -> float | None:
    """persample's default call over the plain step plus the result's write, each taking
    a new batch at every call (the workload's other batches, of other shapes), or
    ``None`` where the workload has none."""
    ours, plain = (r.diagnostics.get(k) for k in (NEW_BATCH_OURS, NEW_BATCH_PLAIN))
    if not ours or not plain:
        return None
    return ours / (plain + r.t_fill_ms)


def format_summary(reports: list[Report], quick: bool = False) -> str:
    """One screen after the tables: per workload persample's default call and the best
    other method that agreed with the reference, each x its floor, and the speed-up (the
    best other's time over persample's) with its range round by round; then how many
    workloads persample leads. ``quick``: says a quick run's figures are rough.

    Examples:
        >>> print(format_summary([]))
        summary: no workload ran
    """
    if not reports:
        return "summary: no workload ran"
    lines = ["summary (x floor; speed-up: the best other method's time over persample's, "
             "its range over the rounds in brackets):",
             f"  {'workload':<24}{'persample':>10}  {'best other':<32}{'speed-up':>9}"]
    ahead = compared = 0
    for r in reports:
        ours = next(m for m in r.methods if m.method == r.ours)
        mine = "failed" if ours.ratio_to_floor is None else f"{ours.ratio_to_floor:.2f}"
        if r.best_other is None or r.speedup_over_best_other is None:
            lines.append(f"  {r.workload:<24}{mine:>10}  (no other method agreed)")
            continue
        best = next(m for m in r.methods if m.method == r.best_other)
        compared += 1
        ahead += r.speedup_over_best_other >= 1
        other = f"{r.best_other} {best.ratio_to_floor:.2f}"[:31]
        spread = _round_ratios(r)
        lines.append(f"  {r.workload:<24}{mine:>10}  {other:<32}"
                     f"{r.speedup_over_best_other:>8.2f}x" + (
                         f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread else ""))
    for r in reports:
        new_batch = _new_batch_ratio(r)
        if new_batch is not None:
            lines.append(f"  {r.workload}, a new batch (of other shapes) at each call, as an "
                         f"epoch runs: persample {new_batch:.2f}x (plain step + write)")
    lines.append(f"persample is ahead of the best other method on {ahead} of {compared} "
                 "workloads compared" + (" (a quick run: no warm-up and 2 rounds; the "
                                         "full run's figures are the ones to quote)"
                                         if quick else ""))
    return "\n".join(lines)


def format_markdown(reports: list[Report]) -> str:
    """The run as one Markdown table, a row per workload, for a page that shows the run:
    ``t_plain`` and the floor (ms), persample's default call (ms and x the floor), the
    best other method that agreed with the reference (its time and x the floor), the
    speed-up (the best other's time over persample's) with its range round by round,
    the capture's forward over the plain forward, and persample's first call of a new
    plan, certified and not (ms). A blank cell: not measured for that workload.

    Examples:
        >>> r = bench_case(build_case("pinn-input-jac", 2), True, lambda label: None)
        >>> print(format_markdown([r]).splitlines()[0])  # doctest: +ELLIPSIS
        | workload | t_plain ms | floor ms | persample ms | x floor | best other method | ...
    """
    lines = ["| workload | t_plain ms | floor ms | persample ms | x floor | best other "
             "method | its ms | its x floor | speed-up [per round] | capture / plain "
             "forward | first call, certified / not (ms) |",
             "|---|" + "---:|" * 4 + "---|" + "---:|" * 5]
    for r in reports:
        ours = next(m for m in r.methods if m.method == r.ours)
        mine = (["failed", ""] if ours.median_ms is None else
                [f"{ours.median_ms:,.2f}", f"**{ours.ratio_to_floor:.2f}**"])
        other = ["(no other method agreed)", "", "", ""]
        if r.best_other is not None and r.speedup_over_best_other is not None:
            best = next(m for m in r.methods if m.method == r.best_other)
            spread = _round_ratios(r)
            other = [r.best_other, f"{best.median_ms:,.2f}", f"{best.ratio_to_floor:.2f}",
                     f"{r.speedup_over_best_other:.2f}x" + (
                         f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread else "")]
        plain, captured = (r.diagnostics.get(k)
                           for k in ("plain forward", "forward under capture"))
        capture = f"{captured / plain:.2f}x" if plain and captured else ""
        certified, never = (r.first_calls.get(k) for k in ("certified", "never"))
        first = f"{certified:,.1f} / {never:,.1f}" if certified and never else ""
        cells = [r.workload, f"{r.t_plain_ms:,.2f}", f"{r.floor_ms:,.2f}", *mine, *other,
                 capture, first]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_report(r: Report) -> str:
    """The workload's table as text: plain, write, floor, then each method's median ms,
    ratio to the floor, peak MB and max |diff| from the reference; notes; the speed-up
    of the default call over the best other method that agrees with the reference.

    Examples:
        >>> r = bench_case(build_case("pinn-input-jac", 2), True, lambda label: None)
        >>> print(format_report(r))  # doctest: +ELLIPSIS
        pinn-input-jac: MLP 1-20-20-400 tanh, batch 2, t ~ U(0, 1), (B, 400, 1) [cpu]
        ...
    """
    floor_row = f"floor: {r.floor_label}" if r.t_product_ms is not None else \
        "floor (t_plain + write)"
    w = max(28, 2 + max(len(x) for x in [floor_row] + [m.method for m in r.methods]))
    lines = [
        f"{r.workload}: {r.description} [{r.device}]",
        f"  result {tuple(r.result_shape)}, {r.bytes_out / MB:,.1f} MB; "
        f"write bandwidth {r.bandwidth_gb_s:.1f} GB/s; results checked against {r.reference}",
        f"  peak MB: {r.memory}",
        f"  {'method':<{w}}{'median ms':>11}{'spread':>8}{'x floor':>9}{'first ms':>10}"
        f"{'peak MB':>10}{'max |diff|':>12}",
        f"  {r.base_label + ' (t_plain)':<{w}}{r.t_plain_ms:>11.2f}{'':>27}"
        f"{_fmt(r.plain_peak_mb, ',.1f', 10)}",
        f"  {'write result (fill_)':<{w}}{r.t_fill_ms:>11.2f}",
    ]
    lines.append(f"  {floor_row:<{w}}{r.floor_ms:>11.2f}{'':>8}{1.0:>9.2f}")
    notes = []
    for m in r.methods:
        label = m.method + (" *" if m.note else "")
        if m.note:
            notes.append(f"  * {m.method}: {m.note}")
        if m.median_ms is None:
            lines.append(f"  {label:<{w}}  {m.status}")
            continue
        lines.append(f"  {label:<{w}}{m.median_ms:>11.2f}{_spread(m.times_ms):>8}"
                     f"{m.ratio_to_floor:>9.2f}{_fmt(m.first_ms, '.1f', 10)}"
                     f"{_fmt(m.peak_mb, ',.1f', 10)}{_fmt(m.max_abs_diff, '.1e', 12)}"
                     + ("  DIFFERS from the reference" if m.agrees is False else ""))
    lines += notes
    if r.speedup_over_best_other:
        lines.append(f"  {r.ours} (default call) is {r.speedup_over_best_other:.2f}x as fast "
                     f"as the best other method ({r.best_other}){_round_range(r)}")
    plain, captured = (r.diagnostics.get(k) for k in ("plain forward", "forward under capture"))
    if plain and captured:
        lines.append(f"  capture overhead: forward under capture {captured:.2f} ms, plain "
                     f"forward {plain:.2f} ms ({captured / plain:.2f}x)")
    new_batch = _new_batch_ratio(r)
    if new_batch is not None:  # (each call a batch of shapes not seen before)
        lines.append(f"  a new batch at each call, as an epoch runs: {r.ours} "
                     f"{r.diagnostics[NEW_BATCH_OURS]:.2f} ms, plain step "
                     f"{r.diagnostics[NEW_BATCH_PLAIN]:.2f} ms, {new_batch:.2f}x (plain step "
                     "+ write)")
    if r.us_per_op:
        lines.append(f"  fixed cost per forward op ((median - t_plain) / {r.forward_ops} ops): "
                     + ", ".join(f"{k} {v:.0f} us" for k, v in r.us_per_op.items()))
    certified, never = (r.first_calls.get(k) for k in ("certified", "never"))
    if certified and never:
        lines.append(f"  {r.ours}, first call of a new plan: certified {certified:.2f} ms, "
                     f"check='never' {never:.2f} ms ({certified / never:.2f}x)")
    draws = {k.removeprefix("noise: "): v for k, v in r.diagnostics.items()
             if k.startswith("noise: ") and v is not None}
    if draws:
        lines.append(f"  noise ({r.result_shape[0]:,} normal draws): " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in draws.items()))
    return "\n".join(line.rstrip() for line in lines)


def plot_reports(reports: list[Report], path: str) -> None:
    """A horizontal bar chart of median times per method, one panel per workload, with
    the floor as a dashed line; written to ``path`` (PNG). Needs matplotlib."""
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


def build_case(name: str, batch: int | None, device: torch.device | str = "cpu",
               size: str = "full", only: str | None = None) -> Case:
    """The :class:`~persample_bench.anchors.Case` of workload ``name`` on ``device``.

    Args:
        name: one of :data:`~persample_bench.workloads.WORKLOADS`.
        batch: overrides the workload's batch size.
        device: where the model and the data go (``"cpu"`` or ``"cuda"``); on a GPU,
            ``gpt2-768-*`` has GPT-2 small's 12 layers (4 on the CPU).
        size: ``"tiny"``: a real-size workload (:data:`~persample_bench.workloads.
            REAL_WORKLOADS`) built at test size, same data, loss and trainable
            parameters (:func:`~persample_bench.workloads.real_workload`).
        only: build only this row of a gradients or DP-step case (or none but the
            baseline, when it names the baseline), for a memory probe.

    Raises:
        SystemExit: an unknown workload.
        ValueError: ``size="tiny"`` for a workload of one size.
        MemoryError: the reference would need over the memory limit.
        persample.cli.real_models.NotInstalled: the workload's model package is missing.

    Examples:
        >>> case = build_case("deep-mlp-grads", 2)
        >>> case.result_shape, [m.name for m in case.methods if m.ours]
        ((2, 4515602), ['persample'])
    """
    if name in GRAD_WORKLOADS:
        return anchors.grads_case(grads_workload(name, batch, size, device).to(device), only)
    if name in JACOBIAN_WORKLOADS and size != "full":
        raise ValueError(f"{name} has one size, 'full'")
    if name == "mlp-param-jac":
        return anchors.param_jacobian_case(jacobian_workload(name, batch).to(device))
    if name in JACOBIAN_WORKLOADS:
        return anchors.input_jacobian_case(jacobian_workload(name, batch).to(device))
    if name == "cnn-norms":
        return anchors.norms_case(dp_workload(name, batch, size, device).to(device))
    if name in ATTRIBUTION_WORKLOADS:
        w = attribution_workload(name, batch, size, device).to(device)
        if name.endswith("-gram"):
            return anchors.gram_case(w, only)
        return anchors.project_case(w, projected_dim(name), only)
    if name in DP_WORKLOADS:
        w = dp_workload(name, batch, size, device).to(device)
        return anchors.under_autocast(anchors.dp_step_case(w, only))
    if name in REAL_CURVATURE_WORKLOADS:
        w = grads_workload("gpt2-768-grads", batch, size, device).to(device)
        return curvature_rows.gpt2_kfac_case(replace(w, name=name, description=(
            f"{w.description}; K-FAC's factors of every weight matrix (empirical Fisher, "
            "expand), the tied table's exact diagonal")))
    if name in CURVATURE_WORKLOADS:
        w = curvature_workload(name, batch, device).to(device)
        if name == "kfac-factors":
            return curvature_rows.kfac_case(w)
        if name == "ekfac-influence":
            return curvature_rows.influence_case(w, influence_train(w.n))
        return curvature_rows.ggn_diag_case(w, mc=name.endswith("-mc"))
    raise SystemExit(f"unknown workload {name!r}; choose from {WORKLOADS}")


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    return device


def load_warning(loads: list[float], cores: int | None = None) -> str | None:
    """A warning when the load average exceeded the cores during the run, else None.

    Examples:
        >>> load_warning([0.5, 1.2], cores=2) is None
        True
        >>> load_warning([0.5, 3.4], cores=2)[:60]
        'warning: the load average reached 3.4 on 2 cores during the '
    """
    cores = cores or usable_cpus()
    worst = max(loads)
    if worst <= cores:
        return None
    return (f"warning: the load average reached {worst:.1f} on {cores} cores during the run: "
            "other processes competed for the CPU, so the times are inflated and noisy "
            "(see each method's spread); ratios measured in the same round hold better. "
            "Rerun on an idle machine for figures to publish.")


def header(workloads: list[str], quick: bool, batch: int | None, threads: int,
           device: torch.device, memory: bool) -> str:
    """The line printed as the run starts: what runs, at which batch, how it is timed,
    on how many threads.

    Examples:
        >>> print(header(["cnn-grads"], True, 4, 1, torch.device("cpu"), False))
        ... # doctest: +NORMALIZE_WHITESPACE
        persample bench: 1 workload, batch 4, no warm-up, 2 rounds, no memory probes;
        cpu, 1 torch thread
    """
    warmup, rounds = _reps(quick)
    runs = f"{len(workloads)} workload{'s' * (len(workloads) != 1)}"
    size = f"batch {batch}" if batch else "each workload's own batch"
    timing = f"{warmup or 'no'} warm-up{'s' * (warmup > 1)}, {rounds} rounds"
    if device.type == "cuda":
        return f"persample bench: {runs}, {size}, {timing}; {device}"
    probes = "memory probes" if memory else "no memory probes"
    return f"persample bench: {runs}, {size}, {timing}, {probes}; cpu, {threads_label(threads)}"


def run(workloads: list[str], quick: bool, batch: int | None, threads: int,
        json_path: str | None, plot_path: str | None, device: str = "cpu",
        memory: bool = True, markdown_path: str | None = None) -> list[Report]:
    """Run the benchmark, print the tables, and write the JSON, the plot and the Markdown
    table if asked.

    Args:
        workloads: names from :data:`~persample_bench.workloads.WORKLOADS`.
        quick: a smoke run (no warm-up, 2 rounds).
        batch: overrides every workload's batch size.
        threads: ``torch.set_num_threads`` on the CPU (ignored with ``device="cuda"``).
        json_path: write every figure there as JSON (``machine``, ``quick``,
            ``workloads``: :class:`Report` s, ``not_run``: workloads whose package is
            missing).
        plot_path: draw the median times there (PNG).
        markdown_path: write the run there as one Markdown table
            (:func:`format_markdown`), with the machine and the command line above it.
        device: ``"cpu"`` or ``"cuda"``.
        memory: measure each method's peak memory (on the CPU: one fresh process per
            method, a few seconds each).

    Returns:
        The reports of the workloads that ran.

    Raises:
        SystemExit: an unknown workload, or ``device="cuda"`` without CUDA.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "bench.json")
        >>> reports = run(["pinn-input-jac"], True, 2, 1, path, None, memory=False)
        ... # doctest: +ELLIPSIS
        persample bench: 1 workload, batch 2, no warm-up, 2 rounds, ...; cpu, 1 torch thread
        pinn-input-jac: ...
        >>> [r.workload for r in reports], os.path.exists(path)
        (['pinn-input-jac'], True)
    """
    dev = _device(device)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    _ignore_noise()
    print(header(workloads, quick, batch, threads, dev, memory), flush=True)
    reports, not_run = [], []
    loads = [load_average()]  # the 1-minute load average before each workload and at the end
    with tqdm(total=len(workloads), desc="persample bench", unit="workload") as bar:
        for name in workloads:
            loads.append(load_average())
            def step(label: str, name=name) -> None:
                bar.set_postfix_str(f"{name}: {label}")

            try:
                case = build_case(name, batch, dev)
            except NotInstalled as err:
                not_run.append({"workload": name, "status": f"not installed: {err}"})
                bar.update(1)
                continue
            probe = None
            if memory and dev.type == "cpu":
                def probe(method: str, name=name) -> dict:
                    return _run_probe(name, method, batch, threads)
            reports.append(bench_case(case, quick, step, probe))
            bar.write(format_report(reports[-1]) + "\n")  # each table as it is measured
            del case
            bar.update(1)
            gc.collect()
            persample.empty_cache()  # the free result blocks of this workload's sizes
            _trim_heap()
    loads.append(load_average())
    for skipped in not_run:
        print(f"{skipped['workload']}: {skipped['status']}")
    print(format_summary(reports, quick))
    busy = load_warning(loads)
    if busy:
        print(busy)
    if json_path:
        machine = {**machine_info(threads, dev), "load_average_max": max(loads)}
        with open(json_path, "w") as f:
            json.dump({"machine": machine, "quick": quick,
                       "workloads": [asdict(r) for r in reports], "not_run": not_run},
                      f, indent=2)
        print(f"wrote {json_path}")
    if plot_path and reports:
        plot_reports(reports, plot_path)
        print(f"wrote {plot_path}")
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(f"{markdown_header(machine_info(threads, dev))}\n\n"
                    f"{format_markdown(reports)}\n")
        print(f"wrote {markdown_path}")
    return reports


# --- peak memory on the CPU: one call in a fresh process ----------------------------------


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; a
    no-op elsewhere): a workload's freed tensors leave hundreds of MB there, which the
    next workload's peak would otherwise stand on."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def memory_probe(workload: str, method: str, batch: int | None, threads: int,
                 device: str = "cpu") -> dict:
    """One call's peak memory, measured in this process (run it in a fresh one).

    Builds the case, turns its noise on as for the timed rounds, allocates the
    ``out=`` buffer (touched), then reads the RSS, resets the peak RSS
    (``/proc/self/clear_refs``), calls the method once holding its result, and
    reads the peak RSS (``VmHWM``). Without ``/proc`` (not Linux) the peak is
    ``ru_maxrss``, which includes building the case (``peak_reset`` is False).

    Args:
        workload: a workload name.
        method: a row's name, or the case's baseline label (``"plain backward"``...).
        batch, threads, device: as for :func:`run`.

    Returns:
        ``{"workload", "method", "rss_before_mb", "peak_rss_mb", "extra_peak_mb",
        "peak_reset"}``, sizes in MB (10^6 bytes).

    Raises:
        SystemExit: no such method, or it cannot run here.

    Examples:
        >>> m = memory_probe("pinn-input-jac", "one backward", 2, 1)
        >>> m["extra_peak_mb"] >= 0
        True
    """
    dev = _device(device)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    _ignore_noise()
    case = build_case(workload, batch, dev, only=method)
    case.after_check()
    buf = aligned_empty(case.result_shape, case.workload.dtype, dev).zero_()
    if method == case.base_label:
        fn = case.base
    else:
        found = [m for m in case.methods if m.name == method and m.fn is not None]
        if not found:
            raise SystemExit(f"{workload} has no runnable method {method!r}")
        fn = lambda: found[0].fn(buf)  # noqa: E731
    gc.collect()
    before = status_kib("VmRSS")
    before_bytes = before * 1024 if before is not None else _maxrss_bytes()
    reset = reset_peak_rss() and before is not None
    result = fn()
    peak_kib = status_kib("VmHWM") if reset else None
    peak = peak_kib * 1024 if peak_kib is not None else _maxrss_bytes()
    del result
    return {"workload": workload, "method": method, "rss_before_mb": before_bytes / MB,
            "peak_rss_mb": peak / MB, "extra_peak_mb": max(0, peak - before_bytes) / MB,
            "peak_reset": reset}


def _run_probe(workload: str, method: str, batch: int | None, threads: int) -> dict:
    """:func:`memory_probe` in a fresh ``python -m persample_bench`` process; ``{}`` if it
    fails (the failure is printed on stderr)."""
    cmd = [sys.executable, "-m", "persample_bench", "--_memory-probe", workload, method,
           "--threads", str(threads)]
    if batch:
        cmd += ["--batch", str(batch)]
    # where this persample_bench and the persample it times are imported from
    src = dict.fromkeys(str(Path(f).resolve().parents[1]) for f in (__file__, persample.__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*src, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        error = (done.stderr.strip().splitlines() or ["?"])[-1]
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as err:
        error = f"{type(err).__name__}: {err}"
    print(f"memory probe of {workload} / {method} failed: {error}", file=sys.stderr)
    return {}


_ANCHOR_PACKAGES = {"opacus": "opacus", "backpack-for-pytorch": "backpack",
                    "transformers": "transformers", "timm": "timm",
                    "torch_geometric": "torch_geometric", "peft": "peft",
                    "kronfluence": "kronfluence"}  # distribution -> module


def markdown_header(machine: dict) -> str:
    """The line above :func:`format_markdown`'s table: the day (UTC), the device, the
    threads, torch's version and those of the other packages the run used (the ones
    installed).

    Examples:
        >>> markdown_header(machine_info(2)).startswith("`persample bench`, ")
        True
    """
    found = []
    for name, module in _ANCHOR_PACKAGES.items():
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:  # (one on sys.path alone: the
            version = getattr(sys.modules.get(module), "__version__", None)  # vision dir)
            if version is not None:
                found.append(f"{name} {version}")
    threads = f", {threads_label(machine['threads'])}" if machine["threads"] else ""
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return (f"`persample bench`, {day}: {machine['device_name']} ({machine['device']})"
            f"{threads}; torch {machine['torch']}, Python {machine['python']}"
            + "".join(f", {x}" for x in found) + "; medians, ms.")


def machine_info(threads: int, device: torch.device | str = "cpu") -> dict:
    """The JSON's ``machine``: torch and Python versions, the CPU architecture, the
    threads (CPU runs; ``None`` on a GPU), the device (``"cpu"``, ``"cuda"``) and its
    name (``torch.cuda.get_device_name``, or the CPU's model name).

    Examples:
        >>> sorted(machine_info(2))
        ['device', 'device_name', 'machine', 'python', 'threads', 'torch']
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f
                             if line.startswith("model name")), name)
        except OSError:
            pass
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": threads if dev.type == "cpu" else None,
            "device": dev.type, "device_name": name}
