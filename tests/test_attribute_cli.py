"""``persample attribute`` (also ``persample influence``) on the digits with flipped
labels: every score finds them."""

import json

import pytest

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
    assert len(figures["phases"]) >= 5 and png.stat().st_size > 0  # 6 with dattri
    printed = capsys.readouterr().out
    assert "AUC of finding the flipped labels" in printed and "ekfac fit" in printed


@pytest.mark.slow
@pytest.mark.keep_default_dtype
def test_influence_is_the_same_command(capsys):
    from persample.cli import build_parser

    assert build_parser().parse_args(["influence", "--dim", "64"]).dim == 64
