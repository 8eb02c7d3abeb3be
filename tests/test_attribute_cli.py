"""``persample attribute`` (also ``persample influence``) on the digits with flipped
labels: every score finds them."""

import json

import pytest
import torch

import persample
from persample.cli import main


@pytest.mark.slow
@pytest.mark.keep_default_dtype
def test_attribute_finds_the_flipped_labels(tmp_path, capsys):
    out, png = tmp_path / "attr.json", tmp_path / "attr.png"
    main(["attribute", "--threads", "1", "--json", str(out), "--plot", str(png)])
    figures = json.loads(out.read_text())
    assert figures["flipped"] > 100 and figures["train_samples"] > 1400
    auc = figures["auc"]
    assert auc["self-influence (TracIn)"] >= 0.9
    assert auc["TRAK-style (harmful to validation)"] >= 0.85
    for curvature in ("EKFAC", "KFAC", "DIAGONAL"):  # influence functions
        assert auc[f"self-influence ({curvature} influence function)"] >= 0.95
    assert figures["projection_rel_difference_materialised"] < 1e-4  # the same map
    assert len(figures["phases"]) >= 5 and png.stat().st_size > 0
    assert figures["beside"] == {}  # the library's command runs no other library
    printed = capsys.readouterr().out
    assert "AUC of finding the flipped labels" in printed and "ekfac fit" in printed


@pytest.mark.slow
@pytest.mark.keep_default_dtype
def test_influence_is_the_same_command(capsys):
    from persample.cli import build_parser

    assert build_parser().parse_args(["influence", "--dim", "64"]).dim == 64


@pytest.mark.slow
@pytest.mark.keep_default_dtype
def test_the_benchmark_runs_dattri_beside(tmp_path, monkeypatch):
    """``python -m persample_bench.attribution``: the same command with dattri's scores
    beside, a phase and an AUC of their own (persample's TracIn standing in for dattri,
    which this environment does not install)."""
    from persample_bench import attribution

    def stand_in(model, checkpoints, x, y, cfg):
        return sum(cfg.lr * persample.per_sample_grad_norms(
            model, x, y, torch.nn.CrossEntropyLoss()).square() for _ in checkpoints)

    name, out = attribution.DATTRI, tmp_path / "attr.json"
    monkeypatch.setattr(attribution, "dattri_self_influence", stand_in)
    assert attribution.main(["--epochs", "2", "--checkpoints", "1", "--threads", "1",
                             "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["beside"] == {name: "ran"}
    assert figures["auc"][name] > 0.8 and f"self-influence ({name})" in figures["phases"]


def test_a_library_not_installed_is_said_so():
    """Another library's scores that raise ImportError: reported, no phase, no AUC."""
    from persample.cli.attribute import AttributeConfig, _beside

    def missing(*args):
        raise ImportError("No module named 'dattri'")

    phases: dict = {}
    got = _beside({"dattri": missing}, torch.nn.Linear(2, 2), [], torch.zeros(1, 2),
                  torch.zeros(1), AttributeConfig(), phases)
    assert got == {"dattri": "not installed (No module named 'dattri')"} and phases == {}
