"""``persample dp-finetune``: a small GPT-2 fine-tuned with DP-SGD (LoRA and full) on the
standard library's docstrings, through PrivateStep's micro-batches."""

from __future__ import annotations

import json
import math

import pytest

from persample.cli import main

# training runs of the command line, several processes; the CLI trains in float32
pytestmark = [pytest.mark.slow, pytest.mark.keep_default_dtype]

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16",
        "--train-windows", "128", "--test-windows", "32", "--steps", "6", "--batch-size", "32",
        "--physical", "8", "--rank", "2", "--lr", "1e-2", "--sigma", "0.3", "--threads", "1"]


@pytest.mark.parametrize("mode", [[], ["--full"]], ids=["lora", "full"])
def test_a_few_private_steps_lower_the_held_out_loss(mode, tmp_path, capsys):
    path = tmp_path / "ft.json"
    assert main(["dp-finetune", *TINY, *mode, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    figures = json.loads(path.read_text())
    private, plain = figures["runs"]
    assert private["name"] == "private" and plain["name"] == "non-private"
    assert private["steps"] == plain["steps"] == 6
    assert private["perplexity_after"] < private["perplexity_before"]  # the loss went down
    assert plain["perplexity_after"] < plain["perplexity_before"]
    assert 0 < private["epsilon"] < math.inf and plain["epsilon"] is None
    if mode:  # full fine-tuning trains every parameter
        assert private["trainable"] == private["total"]
    else:  # LoRA: the adapters only
        assert 0 < private["trainable"] < private["total"] / 10
    assert figures["time_ratio"] > 0 and "a DP step takes" in out


@pytest.mark.parametrize("mode", [["--fsdp"], ["--full", "--fsdp"], []],
                         ids=["lora-fsdp", "full-fsdp", "lora-whole"])
def test_two_processes_give_one_processs_perplexity_and_epsilon(mode, tmp_path, capsys):
    """Over two gloo processes, sharded with FSDP2 or each holding the whole model: the
    same noise stream and the same clipped sums, so the same model (to rounding) and the
    same epsilon; each process's peak memory shown."""
    path = tmp_path / "ft.json"
    assert main(["dp-finetune", *TINY, *mode, "--nproc", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    sharded, private, plain = json.loads(path.read_text())["runs"]
    assert sharded["name"] == "private x2"
    assert sharded["sharding"] == ("FSDP2" if "--fsdp" in mode else "whole model")
    assert sharded["epsilon"] == private["epsilon"]
    assert sharded["steps"] == private["steps"] == 6
    assert math.isclose(sharded["perplexity_after"], private["perplexity_after"], rel_tol=1e-4)
    assert sharded["perplexity_after"] != pytest.approx(plain["perplexity_after"], rel=1e-3)
    assert len(sharded["peak_mb_per_rank"]) == 2 and "peak MB per process" in out


def test_fsdp_needs_several_processes():
    with pytest.raises(SystemExit, match="--nproc 2 or more"):
        main(["dp-finetune", *TINY, "--fsdp"])
