"""The main job, `persample bench`, end to end on real data (small batches, one thread:
these check what the rows return and how they are compared, not the speed)."""

import argparse
import json
import subprocess
import sys

import pytest

import zoo
from persample.cli import build_parser, main, threads
from persample.cli.real_models import require
from persample_bench import bench as bench_module
from persample_bench import bench_options
from persample_bench.anchors.persample_rows import NEW_BATCH_OURS, NEW_BATCH_PLAIN
from persample_bench.workloads import (
    PROXY_WORKLOADS,
    QUICK_WORKLOADS,
    REAL_WORKLOADS,
    SMALL_WORKLOADS,
)

pytestmark = pytest.mark.keep_default_dtype  # the benchmark workloads are float32

PERSAMPLE_ROWS = {"persample", "persample (flat=True)", "persample (out=)"}


def bench(tmp_path, *args: str) -> dict:
    """Run ``persample bench --quick --threads 1 ARGS --json FILE``; the JSON."""
    json_path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--threads", "1", *args, "--json", str(json_path)]) == 0
    return json.loads(json_path.read_text())


def check_rows(report: dict, tolerance: float) -> dict:
    """Every row is measured and agrees with the reference, or says why not; by name."""
    by_name = {m["method"]: m for m in report["methods"]}
    assert PERSAMPLE_ROWS <= set(by_name)
    assert report["ours"] == "persample"
    for m in report["methods"]:
        if m["status"] == "ok":
            assert m["median_ms"] > 0 and m["ratio_to_floor"] > 0, m
            if m["agrees"]:
                assert m["max_abs_diff"] < tolerance, m
        else:  # a competitor that cannot run here says why
            assert m["status"].startswith(("not installed", "not applicable", "failed")), m
            assert not m["method"].startswith("persample"), m
    for name in PERSAMPLE_ROWS:
        assert by_name[name]["status"] == "ok" and by_name[name]["agrees"], by_name[name]
    return by_name


@pytest.mark.slow
def test_bench_quick_deep_mlp(tmp_path, capsys):
    png_path = tmp_path / "bench.png"
    md_path = tmp_path / "bench.md"
    figures = bench(tmp_path, "--workload", "deep-mlp-grads", "--batch", "4", "--no-memory",
                    "--plot", str(png_path), "--markdown", str(md_path))
    printed = capsys.readouterr().out
    assert "deep-mlp-grads" in printed and "floor" in printed
    assert "persample (default call) is" in printed
    assert "of 1 workloads compared" in printed.split("summary (x floor")[1]
    assert figures["machine"]["device"] == "cpu" and figures["machine"]["threads"] == 1
    assert figures["machine"]["load_average_max"] >= 0  # and a warning when above the cores
    (report,) = figures["workloads"]
    assert report["result_shape"] == [4, 50 * 300 * 301 + 301 * 2]
    assert report["bytes_out"] == 4 * report["result_shape"][1] * 4
    assert report["floor_ms"] > report["t_plain_ms"] > 0
    assert report["memory"] == "not measured"
    by_name = check_rows(report, 1e-5)
    assert {"loop", "torch.func vmap", "Opacus hooks", "BackPACK BatchGrad"} <= set(by_name)
    for name in ("loop", "torch.func vmap"):  # these always run here
        assert by_name[name]["status"] == "ok" and by_name[name]["agrees"]
    assert report["speedup_over_best_other"] > 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header, _, table = md_path.read_text().partition("\n\n")
    assert header.startswith("`persample bench`, ") and "1 torch thread;" in header
    (row,) = [line for line in table.splitlines() if line.startswith("| deep-mlp-grads ")]
    assert f"**{by_name['persample']['ratio_to_floor']:.2f}**" in row


@pytest.mark.slow
def test_bench_gpt2_on_text(tmp_path, capsys):
    """transformers GPT-2 on the standard library's docstrings: the default call returns a
    dict that matches the loop, and so does torch.func's dict."""
    zoo.require("transformers")
    figures = bench(tmp_path, "--workload", "gpt2-grads", "--batch", "2", "--no-memory")
    (report,) = figures["workloads"]
    assert report["result_shape"][0] == 2 and report["reference"] == "loop"
    by_name = check_rows(report, 1e-5)
    func = by_name["torch.func vmap"]
    assert func["status"] == "ok" and func["agrees"] and func["max_abs_diff"] < 1e-5
    assert "attention_mask" in func["note"]  # called without the all-ones mask, and says so
    assert by_name["BackPACK BatchGrad"]["status"].startswith(("not applicable",
                                                               "not installed"))
    assert "gpt2-grads" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_resnet18_on_digits(tmp_path):
    require("torchvision")
    figures = bench(tmp_path, "--workload", "resnet18-grads", "--batch", "2", "--no-memory")
    (report,) = figures["workloads"]
    assert report["result_shape"] == [2, 11_181_642]
    by_name = check_rows(report, 1e-4)
    assert by_name["torch.func vmap"]["agrees"]
    assert by_name["Opacus hooks"]["status"] != "ok" or by_name["Opacus hooks"]["agrees"]


@pytest.mark.slow
def test_bench_memory_and_product_floor(tmp_path, capsys):
    """Peak memory in fresh processes (once, on a small workload; quick timing with the
    probes, which the command's --quick leaves out), and clf-input-jac's floor: the one
    (B*Y, H) x (H, D) matrix product."""
    json_path = tmp_path / "bench.json"
    bench_module.run(["clf-input-jac"], True, 4, 1, str(json_path), None, memory=True)
    (report,) = json.loads(json_path.read_text())["workloads"]
    assert report["floor_label"] == "(40, 256) x (256, 784) product"
    assert report["t_product_ms"] == report["floor_ms"] > 0
    assert report["memory"].startswith("peak RSS of one call in a fresh process")
    assert report["plain_peak_mb"] is not None and report["plain_peak_mb"] >= 0
    for m in report["methods"]:
        assert m["status"] == "ok" and m["agrees"], m
        assert m["peak_total_mb"] >= m["peak_mb"] >= 0, m
    printed = capsys.readouterr().out
    assert "floor: (40, 256) x (256, 784) product" in printed and "peak MB" in printed


@pytest.mark.slow
@pytest.mark.parametrize("command", [["-m", "persample", "bench"], ["-m", "persample_bench"]])
def test_module_entry_point_help(command):
    """``python -m persample bench`` and ``python -m persample_bench``: the same options."""
    done = subprocess.run([sys.executable, *command, "--help"],
                          capture_output=True, text=True, check=True)
    prog = "persample bench" if "bench" in command else "persample-bench"
    assert done.stdout.startswith(f"usage: {prog} ")
    assert "--workload" in done.stdout and "--quick" in done.stdout
    assert "--device" in done.stdout and "--no-memory" in done.stdout
    assert "_memory-probe" not in done.stdout  # internal
    text = " ".join(done.stdout.split())  # how the options combine, the default threads
    assert ("the headline rows that fit in two minutes (" + ", ".join(QUICK_WORKLOADS)
            + "; unless --real or --workload), each at its own size") in text
    assert "1-minute load average" in text


def test_bench_hands_what_follows_it_to_the_benchmark(capsys):
    """``persample bench ARGS`` is the benchmark's parser on ``ARGS``, named ``persample
    bench``; ``persample --help`` lists it beside the other subcommands."""
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: persample bench ") and "--workload" in out
    with pytest.raises(SystemExit) as done:
        main(["bench", "--workload", "no-such-workload"])
    assert done.value.code == 2
    assert "persample bench: error: argument --workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "time every per-sample method" in capsys.readouterr().out


def test_a_missing_package_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    figures = bench(tmp_path, "--workload", "gpt2-grads", "--no-memory")
    assert figures["workloads"] == []
    (skipped,) = figures["not_run"]
    assert skipped["workload"] == "gpt2-grads"
    assert "not installed (pip install -e '.[test]')" in skipped["status"]
    assert "gpt2-grads: not installed" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_gram_workload(tmp_path):
    """deep-mlp-gram: the (B, B) Gram by every gradients method then G G^T, and by
    per_sample_grad_dots; all agree with the loop's."""
    figures = bench(tmp_path, "--workload", "deep-mlp-gram", "--batch", "6", "--no-memory")
    (report,) = figures["workloads"]
    assert report["result_shape"] == [6, 6]
    by_name = {m["method"]: m for m in report["methods"]}
    assert {"persample", "persample per_sample_grads, then G G^T", "loop"} <= set(by_name)
    for m in report["methods"]:
        assert m["status"] != "ok" or (m["agrees"] and m["max_abs_diff"] < 1e-4), m
    assert by_name["persample"]["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["deep-mlp-project"])
def test_bench_projection_workloads(tmp_path, workload):
    """The per-sample gradients projected by every gradients method then proj.project,
    and by GradientProjector: the same (B, 1024) map, agreeing with the loop's (GPT-2's
    projection rows: tests/test_bench_real.py, gpt2-768-project at test size)."""
    figures = bench(tmp_path, "--workload", workload, "--batch", "3", "--no-memory")
    (report,) = figures["workloads"]
    assert report["result_shape"] == [3, 1024]
    by_name = {m["method"]: m for m in report["methods"]}
    assert by_name["persample"]["status"] == "ok" and by_name["persample"]["agrees"]
    for m in report["methods"]:
        assert m["status"] != "ok" or m["agrees"], m


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["ggn-diag", "ggn-diag-mc", "kfac-factors",
                                      "ekfac-influence"])
def test_bench_curvature_workloads(tmp_path, workload):
    """The GGN diagonals, K-FAC factors and EK-FAC influence scores: persample's and every
    other method's (BackPACK, curvlinops, hooks by hand, kronfluence) agree with the
    reference."""
    batch = "40" if workload == "ekfac-influence" else "3"
    figures = bench(tmp_path, "--workload", workload, "--batch", batch, "--no-memory")
    (report,) = figures["workloads"]
    by_name = {m["method"]: m for m in report["methods"]}
    assert by_name["persample"]["status"] == "ok" and by_name["persample"]["agrees"]
    others = [m for m in report["methods"] if m["status"] == "ok"]
    assert len(others) >= {"ggn-diag-mc": 2, "ekfac-influence": 2}.get(workload, 3)
    for m in others:
        assert m["agrees"], m


def test_bench_without_the_reference_library_says_so(tmp_path, monkeypatch, capsys):
    """kronfluence, the EK-FAC row's reference, not installed: its row says so, and
    persample's row says its result is unchecked (no crash); the summary at the end."""
    monkeypatch.setitem(sys.modules, "kronfluence", None)  # (its import then fails)
    figures = bench(tmp_path, "--workload", "ekfac-influence", "--batch", "4", "--no-memory")
    printed = capsys.readouterr().out
    assert "summary (x floor" in printed
    assert "(no other method agreed)" in printed.split("summary")[-1]
    assert "ahead of the best other method on 0 of 0 workloads compared (a quick run" in printed
    (report,) = figures["workloads"]
    assert "3 training samples x 1 queries" in report["description"]
    assert report["result_shape"] == [1, 3]
    by_name = {m["method"]: m for m in report["methods"]}
    assert by_name["kronfluence"]["status"] == "not installed"
    ours = by_name["persample (unchecked: kronfluence not installed)"]
    assert ours["status"] == "ok" and report["reference"] == ours["method"]


def test_every_help_is_plain_text():
    """``--help`` prints the docstrings' reStructuredText as text: no ````code```` and no
    roles (``:func:`...```), for the command line, each subcommand and the benchmark."""
    import re

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {"persample": parser.format_help(),
             "persample bench": bench_options.build_parser().format_help(),
             **{name: sub.format_help() for name, sub in commands.choices.items()}}
    assert len(helps) == 8
    for name, text in helps.items():
        assert "``" not in text and not re.search(r":[a-z]+:`", text), (name, text)
    assert "persample dp-finetune: a small GPT-2" in helps["dp-finetune"]


def bench_plan(*args: str) -> bench_options.BenchPlan:
    """What ``persample bench ARGS`` would run (nothing is run)."""
    return bench_options.plan(bench_options.build_parser().parse_args(list(args)))


def test_quick_selects_the_headline_subset_at_its_own_sizes_without_memory_probes():
    quick = bench_plan("--quick")
    assert quick.workloads == list(QUICK_WORKLOADS)
    assert set(quick.workloads) < set(SMALL_WORKLOADS)
    assert (quick.batch, quick.quick, quick.memory) == (None, True, False)  # the full run's
    assert bench_plan("--quick", "--no-real").workloads == list(SMALL_WORKLOADS)
    assert bench_plan("--quick", "--batch", "16").batch == 16
    real = bench_plan("--quick", "--real")
    assert real.workloads == list(REAL_WORKLOADS) and not real.memory
    named = bench_plan("--quick", "--workload", "cnn-grads", "--workload", "gpt2-768-grads")
    assert named.workloads == ["cnn-grads", "gpt2-768-grads"]
    assert bench_plan("--quick", "--no-real", "--workload", "gpt2-768-grads").workloads == []


def test_proxy_selects_the_tiny_configurations_of_a_gpu_regime():
    proxy = bench_plan("--proxy")
    assert proxy.workloads == [w for w in SMALL_WORKLOADS if w in PROXY_WORKLOADS]
    assert set(proxy.workloads) == set(PROXY_WORKLOADS) and proxy.batch is None
    assert bench_plan("--proxy", "--workload", "cnn-grads").workloads[0] == "cnn-grads"


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["bert-tiny-grads", "gpt2-tiny-grads", "mlp-tiny-grads"])
def test_bench_proxy_reports_the_fixed_cost_per_op(tmp_path, workload):
    """The GPU proxies: persample, torch.func and Opacus's hooks (given per-sample position
    and token type ids) all agree with the loop, and each row's time over the plain step is
    reported per forward op."""
    figures = bench(tmp_path, "--workload", workload, "--batch", "4", "--no-memory")
    (report,) = figures["workloads"]
    by_name = check_rows(report, 1e-4)
    for method in ("persample", "torch.func vmap", "Opacus hooks"):
        assert by_name[method]["status"] == "ok" and by_name[method]["agrees"], method
        assert method in report["us_per_op"]
    assert report["forward_ops"] >= 15
    us = report["us_per_op"]["persample"]
    ms = by_name["persample"]["median_ms"] - report["t_plain_ms"]
    assert us == pytest.approx(ms * 1e3 / report["forward_ops"])


def test_the_full_run_keeps_every_workload_at_its_own_batch_with_memory_probes():
    full = bench_plan()
    assert full.workloads == list(SMALL_WORKLOADS + REAL_WORKLOADS)
    assert (full.batch, full.quick, full.memory) == (None, False, True)
    assert bench_plan("--no-real").workloads == list(SMALL_WORKLOADS)
    assert not bench_plan("--no-memory").memory


@pytest.mark.parametrize(("cpus", "load", "want"), [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.37, 1), (2, 7.5, 1), (16, 3.4, 13)])
def test_the_default_threads_are_the_free_cpus(monkeypatch, cpus, load, want):
    """The CPUs this process may use less the 1-minute load average (rounded), at least 1;
    every subcommand that takes --threads defaults to it, and --threads N wins."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)),
                        raising=False)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert threads.default_threads() == want
    parse = build_parser().parse_args
    for command in ("attribute", "dp-train", "dp-finetune"):
        assert parse([command]).threads == want, command
        assert parse([command, "--threads", "3"]).threads == 3, command
    bench = bench_options.build_parser().parse_args  # what `persample bench` hands on
    assert bench([]).threads == want and bench(["--threads", "3"]).threads == 3



@pytest.mark.slow
@pytest.mark.parametrize("workload", ["gpt-oss-grads", "qwen-moe-grads", "switch-moe-grads",
                                      "vit-mae-grads", "llava-grads", "gcn-batch-grads",
                                      "lstm-cell-grads",
                                      "seq2seq-decoder-grads", "weight-norm-lstm-grads",
                                      "orthogonal-rnn-grads", "orthogonal-lstm-grads"])
def test_bench_family_workloads(tmp_path, workload):
    """Mixtures (transformers' grouped kernel with biased experts, and with a shared
    expert; Switch's experts with a capacity), a masked
    autoencoder's mask token broadcast into the batch, a vision-language model's image
    features written into its image tokens, a graph network on a Batch, a
    cell or a recurrent layer stepped in a Python loop, a recurrent weight rewritten by a
    parametrization: every
    row agrees with the loop or says why it cannot run (torch.func cannot take a
    ``Batch``, Opacus's hooks the experts' routing)."""
    figures = bench(tmp_path, "--workload", workload, "--batch", "4", "--no-memory")
    (report,) = figures["workloads"]
    by_name = check_rows(report, 1e-4)
    assert by_name["loop"]["status"] == "ok"
    if workload == "gcn-batch-grads":  # (graph batches of other shapes, one per call)
        assert all(report["diagnostics"][k] > 0 for k in (NEW_BATCH_OURS, NEW_BATCH_PLAIN))


def test_the_graph_workload_feeds_a_new_batch_of_other_shapes_at_each_call():
    """The graph network's "a new batch at each call" line times batches of ``B`` graphs
    whose node and edge counts differ from each other's and the timed batch's, more of
    them than the data-flow records persample keeps per model: every call of that line
    has shapes the calls before it did not (an epoch of graph batches)."""
    pytest.importorskip("torch_geometric")
    from persample.engine.tapes import PER_MODEL
    from persample_bench.anchors.persample_rows import new_batches
    from persample_bench.workloads import grads_workload

    w = grads_workload("gcn-batch-grads", 4)
    batches = [(w.inputs, w.targets)] + w.other_batches
    assert len(w.other_batches) > PER_MODEL
    assert all(g.num_graphs == 4 and y.shape == (4,) for g, y in batches)
    assert len({(g.num_nodes, g.num_edges) for g, _ in batches}) == len(batches)
    assert [label for label, _ in new_batches(w)] == [NEW_BATCH_PLAIN, NEW_BATCH_OURS]


def test_the_markdown_table_has_a_row_per_workload_with_its_figures():
    """``format_markdown``: persample's time and ratio, the best other method's, the
    speed-up with its range over the rounds, the capture's ratio and the first calls;
    a workload no other method agreed on says so."""
    def report(name: str, methods: list, best: str | None, speedup: float | None):
        return bench_module.Report(
            name, "a workload", "cpu", [4, 10], 160, "plain backward", 2.0, None, 0.5, 1.0,
            "floor", 2.5, None, "loop", "persample", methods, "not measured", speedup, best,
            {"plain forward": 1.0, "forward under capture": 1.25},
            {"certified": 6.0, "never": 4.0})

    ours = bench_module.Measured("persample", median_ms=3.0, times_ms=[3.0, 2.0],
                                 ratio_to_floor=1.2, agrees=True)
    other = bench_module.Measured("torch.func vmap", median_ms=6.0, times_ms=[6.0, 5.0],
                                  ratio_to_floor=2.4, agrees=True)
    table = bench_module.format_markdown([
        report("first", [ours, other], "torch.func vmap", 2.0),
        report("second", [ours], None, None)]).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|") == 12
    assert table[2] == ("| first | 2.00 | 2.50 | 3.00 | **1.20** | torch.func vmap | 6.00 | "
                        "2.40 | 2.00x [2.00-2.50] | 1.25x | 6.0 / 4.0 |")
    assert table[3].startswith("| second | 2.00 | 2.50 | 3.00 | **1.20** | (no other method "
                               "agreed) |")
    assert table[3].count("|") == 12
