"""``persample dp-train`` end to end on a small subset of the digits (a few steps)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from persample.cli import main
from persample.cli.dp_train import DPTrainConfig, add_parser, run_from_args
from persample.dp.accounting import epsilon

# training runs of the command line, several processes; the CLI trains in float32
pytestmark = [pytest.mark.slow, pytest.mark.keep_default_dtype]

QUICK = ["--epochs", "2", "--subset", "96", "--batch-size", "32", "--max-steps", "2",
         "--threads", "1"]


def dp_train(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="persample")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run_from_args(parser.parse_args(["dp-train", *argv]))


def test_short_run_figures_json_and_plot(tmp_path, capsys):
    json_path, png_path = tmp_path / "dp.json", tmp_path / "dp.png"
    assert main(["dp-train", *QUICK, "--sigma", "2.0", "--compare-nonprivate",
                 "--json", str(json_path), "--plot", str(png_path)]) == 0
    out, err = capsys.readouterr()
    figures = json.loads(json_path.read_text())
    p = figures["privacy"]
    # 2 epochs of 2 steps at q = 32/96, sigma 2: epsilon as the accountant computes it
    assert p["steps"] == 4 and p["sample_rate"] == pytest.approx(1 / 3)
    assert p["sigma"] == 2.0 and p["expected_batch_size"] == pytest.approx(32)
    assert 0 < p["epsilon"] < math.inf
    assert p["epsilon"] == pytest.approx(epsilon(2.0, 1 / 3, 4, 1e-5), rel=1e-9)
    assert p["epsilon_pld"] == pytest.approx(epsilon(2.0, 1 / 3, 4, 1e-5, "pld"), rel=1e-9)
    assert p["epsilon_pld"] < p["epsilon"]
    assert figures["data"] == {"train": 96, "test": 360, "image": [1, 28, 28], "split_seed": 0}
    private, plain = figures["runs"]
    assert (private["name"], plain["name"]) == ("private", "non-private")
    for r in (private, plain):
        assert r["steps"] == 4 and len(r["test_accuracy"]) == 2
        for acc in r["train_accuracy"] + r["test_accuracy"]:
            assert 0 <= acc <= 1
        assert all(math.isfinite(v) and v > 0 for v in r["train_loss"])
        assert all(s > 0 for s in r["epoch_seconds"]) and r["seconds_per_epoch"] > 0
        assert r["final_test_accuracy"] == r["test_accuracy"][-1]
        assert r["final_test_accuracy"] * 360 == pytest.approx(round(r["final_test_accuracy"]
                                                                     * 360))
    # epsilon after each epoch grows, and the last is the final one
    assert 0 < private["epsilon"][0] < private["epsilon"][1] == p["epsilon"]
    assert plain["epsilon"] == []
    assert "non-private" in out and f"{p['epsilon']:.2f}" in out and "s/epoch" in out
    assert "eps=" in err and "train loss=" in err and "train acc=" in err  # the progress bars
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_clipping_and_noise_it_is_plain_sgd(tmp_path, capsys):
    # sigma 0 and a clipping norm no gradient reaches: the private run must then take
    # the same steps as plain SGD on the same batches from the same initial weights
    same_lr = ["--lr", "0.02", "--nonprivate-lr", "0.02", "--no-progress"]
    figures = dp_train([*QUICK, *same_lr, "--sigma", "0", "--max-grad-norm", "1e3",
                        "--compare-nonprivate"])
    private, plain = figures["runs"]
    assert figures["privacy"]["epsilon"] == math.inf
    assert private["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-4)
    assert private["train_accuracy"] == plain["train_accuracy"]
    assert private["test_accuracy"] == plain["test_accuracy"]
    # with a little noise, or with clipping, the private run differs
    for extra in (["--sigma", "1e-2", "--max-grad-norm", "1e3"],
                  ["--sigma", "0", "--max-grad-norm", "1e-3"]):
        other = dp_train([*QUICK, *same_lr, *extra])
        assert other["runs"][0]["train_loss"][1] != pytest.approx(plain["train_loss"][1],
                                                                  rel=1e-4)
        assert other["privacy"]["epsilon_pld"] is None  # epsilon > 100: PLD too slow
    assert capsys.readouterr().err == ""  # --no-progress: no bars


def test_every_clipping_kind_trains():
    """--clipping: flat, per-layer, per-module, automatic and adaptive each train (sigma
    0, the same batches), and each clips differently; adaptive clipping is refused with
    users."""
    losses = {}
    for kind in ("flat", "per-layer", "per-module", "automatic", "adaptive"):
        figures = dp_train([*QUICK, "--sigma", "0", "--max-grad-norm", "0.1", "--no-progress",
                            "--clipping", kind])
        assert figures["config"]["clipping"] == kind
        losses[kind] = figures["runs"][0]["train_loss"][1]
        assert math.isfinite(losses[kind])
    assert len(set(losses.values())) == 5
    with pytest.raises(SystemExit, match="runs in one process at record level"):
        main(["dp-train", *QUICK, "--clipping", "adaptive", "--users", "24"])


def test_user_level_dp(capsys):
    """--users: records dealt to users, users sampled (q over the users), each user's
    gradient clipped once; epsilon per user as the accountant computes it."""
    figures = dp_train([*QUICK, "--sigma", "2.0", "--users", "24", "--batch-size", "8",
                        "--records-per-user", "3", "--no-progress"])
    p = figures["privacy"]
    assert p["unit"] == "user" and p["sample_rate"] == pytest.approx(8 / 24)
    assert p["expected_batch_size"] == pytest.approx(8)
    assert p["epsilon"] == pytest.approx(epsilon(2.0, 1 / 3, 4, 1e-5), rel=1e-9)
    assert all(math.isfinite(v) for v in figures["runs"][0]["train_loss"])
    assert "user-level DP, 24 users" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="records_per_user needs users"):
        main(["dp-train", *QUICK, "--records-per-user", "2"])


def test_secure_mode_noise_differs_from_run_to_run():
    """--secure-mode: the same seed, different noise (the OS's), the same batches."""
    runs = [dp_train([*QUICK, "--sigma", "1.0", "--no-progress", "--secure-mode"])
            for _ in range(2)]
    seeded = [dp_train([*QUICK, "--sigma", "1.0", "--no-progress"]) for _ in range(2)]
    assert runs[0]["config"]["secure_mode"] and not seeded[0]["config"]["secure_mode"]
    assert seeded[0]["runs"][0]["train_loss"] == seeded[1]["runs"][0]["train_loss"]
    assert runs[0]["runs"][0]["train_loss"][1] != runs[1]["runs"][0]["train_loss"][1]
    assert runs[0]["runs"][0]["empty_batches"] == seeded[0]["runs"][0]["empty_batches"]


def test_target_epsilon_sets_sigma(capsys):
    figures = dp_train([*QUICK, "--target-epsilon", "2.0", "--no-progress"])
    p = figures["privacy"]
    assert 0 < p["sigma"] < math.inf and figures["config"]["sigma"] is None
    assert 1.98 < p["epsilon"] <= 2.0  # the budget is met, with little noise to spare
    assert "sigma" in capsys.readouterr().out


def test_defaults_are_the_config_defaults():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dp-train"])
    d = DPTrainConfig()
    assert (args.epochs, args.batch_size, args.lr, args.delta, args.max_grad_norm) == (
        d.epochs, d.batch_size, d.lr, d.delta, d.max_grad_norm)
    assert args.sigma is None and args.target_epsilon is None and d.target_epsilon > 0


@pytest.mark.parametrize("argv,match", [
    (["--delta", "2"], "delta must be in"),
    (["--sigma", "-1"], "sigma must be >= 0"),
    (["--epochs", "0"], "epochs must be > 0"),
    (["--target-epsilon", "0"], "target epsilon must be finite and > 0"),
    (["--max-grad-norm", "0"], "max_grad_norm must be > 0"),
])
def test_bad_options_exit_with_a_message(argv, match):
    with pytest.raises(SystemExit, match=match):
        dp_train(argv)


def test_sigma_and_target_epsilon_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        dp_train(["--sigma", "1", "--target-epsilon", "3"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_two_processes_train_as_one(capfd):
    """--nproc 2 (gloo): each process takes its share of every Poisson sample and the
    release sums them: the same test accuracy after every epoch and the same epsilon."""
    opts = ["--epochs", "2", "--subset", "200", "--batch-size", "64", "--threads", "2",
            "--sigma", "1.0", "--no-progress"]
    one = dp_train(opts)
    two = dp_train([*opts, "--nproc", "2"])
    assert two["config"]["nproc"] == 2
    assert two["runs"][0]["test_accuracy"] == one["runs"][0]["test_accuracy"]
    assert two["runs"][0]["steps"] == one["runs"][0]["steps"]
    assert two["privacy"]["epsilon"] == one["privacy"]["epsilon"]
    assert "2 processes" in capfd.readouterr().out  # printed by rank 0's process


def test_blt_takes_fixed_batches_and_is_one_gaussian_mechanism(capsys):
    """--mechanism blt --buffers 2 at q = 16 / 96: fixed batches of an epoch's 6 groups,
    the whole run one Gaussian mechanism of the BLT's sensitivity: epsilon that of
    sigma alone, the target met by the calibration."""
    figures = dp_train(["--epochs", "2", "--subset", "96", "--batch-size", "16",
                        "--threads", "1", "--no-progress", "--mechanism", "blt",
                        "--buffers", "2", "--target-epsilon", "5"])
    p = figures["privacy"]
    assert p["mechanism"] == "BLT (2 buffers)" and p["cycle_length"] == 6
    assert p["epsilon"] == pytest.approx(epsilon(p["sigma"], 1.0, 1, 1e-5), rel=1e-9)
    assert p["epsilon"] == pytest.approx(5.0, rel=2e-3)
    assert "accounted as one Gaussian mechanism" in capsys.readouterr().out


def test_bandmf_runs_cyclically_and_is_accounted_over_its_groups(capsys):
    """--mechanism bandmf --bands 3 at q = 16 / 96 (6 steps an epoch, two epochs): the
    strategy made for the 12 steps (SGD with momentum), each record in at most one of
    every 3 steps, epsilon DP-SGD's over ceil(12 / 3) = 4 steps at rate 3 q; the target
    met by the calibration; bands * q > 1 refused."""
    figures = dp_train(["--epochs", "2", "--subset", "96", "--batch-size", "16",
                        "--threads", "1", "--no-progress", "--mechanism", "bandmf",
                        "--bands", "3", "--target-epsilon", "5"])
    p = figures["privacy"]
    assert p["mechanism"] == "BandMF (3 bands)" and p["bands"] == 3
    assert p["steps"] == 12 and p["accounted_steps"] == 4
    assert p["epsilon"] == pytest.approx(epsilon(p["sigma"], 3 * 16 / 96, 4, 1e-5), rel=1e-9)
    assert p["epsilon"] == pytest.approx(5.0, rel=2e-3)
    assert "accounted as DP-SGD at rate 3 q" in capsys.readouterr().out
    with pytest.raises(ValueError, match="need sample_rate <= 1 / 7"):
        dp_train(["--epochs", "1", "--subset", "96", "--batch-size", "16", "--threads", "1",
                  "--no-progress", "--mechanism", "bandmf", "--bands", "7", "--sigma", "1"])
