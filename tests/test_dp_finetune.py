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


def test_users_of_one_window_each_give_record_level_dp(tmp_path, capsys):
    """With as many users as training windows (one window each), user-level DP draws the
    same batches, clips the same gradients and adds the same noise as record-level DP:
    the same model and epsilon, through the user path (clipped by module groups)."""
    runs = {}
    for name, extra in {"records": [], "users": ["--users", "128"]}.items():
        path = tmp_path / f"{name}.json"
        assert main(["dp-finetune", *TINY, "--clipping", "per-module", *extra,
                     "--json", str(path)]) == 0
        runs[name] = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "over 128 users: user-level DP" in out and "per-module" in out
    assert runs["records"]["unit"] == "window" and runs["users"]["unit"] == "user"
    (records, _), (users, _) = runs["records"]["runs"], runs["users"]["runs"]
    assert users["epsilon"] == records["epsilon"]
    assert math.isclose(users["perplexity_after"], records["perplexity_after"], rel_tol=1e-4)
    assert users["perplexity_after"] != pytest.approx(users["perplexity_before"], rel=1e-3)


def test_two_processes_keep_each_user_whole(tmp_path, capsys):
    """Users of up to 4 windows (at most 3 a step) over two FSDP2 processes: each rank
    takes whole users and cuts them at users' ends, so the clipped sums, the model and
    epsilon are one process's; epsilon counts users (q = 32 / 40)."""
    path = tmp_path / "ft.json"
    assert main(["dp-finetune", *TINY, "--users", "40", "--records-per-user", "3",
                 "--nproc", "2", "--fsdp", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    sharded, private, _ = figures["runs"]
    assert figures["sample_rate"] == pytest.approx(32 / 40) and figures["unit"] == "user"
    assert sharded["epsilon"] == private["epsilon"] and 0 < private["epsilon"] < math.inf
    assert math.isclose(sharded["perplexity_after"], private["perplexity_after"], rel_tol=1e-4)


@pytest.mark.parametrize("kind, label", [
    ("automatic", "automatic clipping (gamma 0.01)"),
    ("adaptive", "adaptive clipping (C from 1 towards the 0.5 quantile)")])
def test_secure_noise_and_automatic_or_adaptive_clipping_run(kind, label, capsys):
    assert main(["dp-finetune", *TINY, "--steps", "2", "--secure-mode", "--clipping",
                 kind]) == 0
    out = capsys.readouterr().out
    assert "(secure noise)" in out and label in out


@pytest.mark.parametrize("extra, match", [
    (["--users", "16", "--physical", "4"], "raise --physical or cap them"),
    (["--records-per-user", "2"], "records_per_user needs users"),
    (["--users", "200"], "at most train_windows"),
    (["--clipping", "automatic", "--automatic-gamma", "0"], "automatic_gamma must be > 0"),
    (["--clipping", "adaptive", "--nproc", "2"], "runs in one process at record level"),
])
def test_bad_user_and_clipping_options_are_named(extra, match):
    with pytest.raises(SystemExit, match=match):
        main(["dp-finetune", *TINY, *extra])


def test_bandmf_fine_tunes_with_correlated_noise_and_amplified_accounting(tmp_path, capsys):
    """--mechanism bandmf --bands 3 (q = 32 / 128): the 6 steps' epsilon is DP-SGD's over
    2 steps at rate 3 q, the held-out loss still goes down; too many bands named."""
    from persample.dp.accounting import epsilon

    path = tmp_path / "ft.json"
    assert main(["dp-finetune", *TINY, "--batch-size", "16", "--mechanism", "bandmf",
                 "--bands", "3", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    private = figures["runs"][0]
    assert private["epsilon"] == pytest.approx(epsilon(0.3, 3 * 16 / 128, 2, 1e-5), rel=1e-9)
    assert private["perplexity_after"] < private["perplexity_before"]
    assert "BandMF (3 bands)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="need sample_rate <= 1 / 5"):
        main(["dp-finetune", *TINY, "--mechanism", "bandmf", "--bands", "5"])
    assert main(["dp-finetune", *TINY, "--batch-size", "16", "--mechanism", "blt",
                 "--buffers", "2", "--json", str(path)]) == 0
    private = json.loads(path.read_text())["runs"][0]  # one Gaussian mechanism of sigma
    assert private["epsilon"] == pytest.approx(epsilon(0.3, 1.0, 1, 1e-5), rel=1e-9)
    assert "BLT (2 buffers)" in capsys.readouterr().out
