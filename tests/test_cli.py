"""The main job, `persample bench`, end to end on real data (small batch)."""

import json
import subprocess
import sys

import pytest

from persample.cli import main

pytestmark = pytest.mark.keep_default_dtype  # the benchmark workloads are float32


def test_bench_quick_deep_mlp(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--workload", "deep-mlp-grads", "--batch", "4",
                 "--json", str(json_path), "--plot", str(png_path)]) == 0
    printed = capsys.readouterr().out
    assert "deep-mlp-grads" in printed and "floor" in printed
    figures = json.loads(json_path.read_text())
    (report,) = figures["workloads"]
    assert report["result_shape"] == [4, 50 * 300 * 301 + 301 * 2]
    assert report["bytes_out"] == 4 * report["result_shape"][1] * 4
    assert report["floor_ms"] > report["t_plain_ms"] > 0
    by_name = {m["method"]: m for m in report["methods"]}
    assert {"loop", "torch.func vmap", "Opacus hooks", "BackPACK BatchGrad",
            "persample (out=)"} <= set(by_name)
    for m in report["methods"]:
        # every method is either measured and checked against the loop, or says why not
        assert m["status"] == "ok" or m["status"].startswith("not installed"), m
        if m["status"] == "ok":
            assert m["median_ms"] > 0 and m["ratio_to_floor"] > 0
            assert m["max_abs_diff"] < 1e-5, m
    assert by_name["persample (out=)"]["status"] == "ok"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_help():
    done = subprocess.run([sys.executable, "-m", "persample", "bench", "--help"],
                          capture_output=True, text=True, check=True)
    assert "--workload" in done.stdout and "--quick" in done.stdout
