"""The one-run privacy audit (Steinke, Nasr & Jagielski 2023): its bound against the
binomial tail worked out by hand, and the audit of persample's DP step: below the
accountant's epsilon for a correct step (several seeds), above it for a step without
noise and for a step without clipping (so the audit can fail)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch import nn

from persample.dp import epsilon as accountant_epsilon
from persample.dp.auditing import BROKEN, audit, best_bound, epsilon_lower_bound, p_value


def test_the_bound_of_perfect_guesses_is_the_binomial_tail():
    """``k`` right guesses of ``k`` with delta 0: ``p^k = 1 - confidence``, so epsilon
    is ``logit((1 - confidence)^(1/k))``."""
    for k in (10, 100, 1000):
        want = math.log((0.05 ** (1 / k)) / (1 - 0.05 ** (1 / k)))
        assert epsilon_lower_bound(5000, k, k, 0.0) == pytest.approx(want, abs=1e-6)
    # v of r right: the largest eps with P[Binomial(r, e^eps / (1 + e^eps)) >= v] < 0.05
    eps = epsilon_lower_bound(1000, 200, 150, 0.0)
    q = 1 / (1 + math.exp(-eps))
    assert stats.binom.sf(149, 200, q) == pytest.approx(0.05, rel=1e-4)


def test_the_bound_is_monotone_and_delta_costs():
    assert epsilon_lower_bound(1000, 200, 110, 1e-5) == 0.0  # near chance: nothing
    bounds = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in (150, 170, 190, 200)]
    assert bounds == sorted(bounds) and bounds[0] > 0
    assert epsilon_lower_bound(1000, 200, 190, 1e-2) < epsilon_lower_bound(1000, 200, 190, 0.0)
    assert p_value(1000, 200, 190, 1.0, 1e-5) < p_value(1000, 200, 190, 3.0, 1e-5)
    with pytest.raises(ValueError, match="correct"):
        epsilon_lower_bound(100, 10, 11, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(100, 10, 5, 0.0, confidence=1.0)


def test_best_bound_shares_the_confidence():
    """The best of several guess counts holds at the stated confidence (Bonferroni):
    lower than one count's bound alone."""
    added = torch.arange(1000) % 2 == 0
    best = best_bound(added.double(), added, 0.0)
    assert best.correct == best.guesses == 1000 and best.top == best.bottom == 500
    alone = epsilon_lower_bound(1000, 1000, 1000, 0.0)
    assert 0 < best.epsilon < alone


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(500, 10, generator=g), torch.randint(0, 4, (500,), generator=g)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


OPTIONS = dict(noise_multiplier=2.0, max_grad_norm=0.1, expected_batch_size=100, steps=20,
               canaries=1000, lr=0.5)


@pytest.mark.parametrize("seed", range(4))
def test_a_correct_step_stays_below_its_epsilon(seed, snapshot):
    net = _net()
    state = snapshot(net)
    result = audit(net, _data(), nn.CrossEntropyLoss(),
                   generator=torch.Generator().manual_seed(seed), **OPTIONS)
    state.assert_unchanged()  # a copy was trained
    assert not result.leaks
    assert result.gradient.epsilon < result.epsilon and result.input.epsilon < result.epsilon
    assert result.epsilon == pytest.approx(accountant_epsilon(2.0, result.sample_rate, 20, 1e-5))
    assert 400 < result.added["gradient"] < 600 and 400 < result.added["input"] < 600


@pytest.mark.parametrize("broken", ["noise", "clipping"])
@pytest.mark.parametrize("seed", range(2))
def test_a_broken_step_is_caught(broken, seed):
    """No noise, or no clipping, while the accountant counts both: the white-box bound
    is above the accountant's epsilon."""
    result = audit(_net(), _data(), nn.CrossEntropyLoss(), step_type=BROKEN[broken],
                   generator=torch.Generator().manual_seed(seed), **OPTIONS)
    assert result.leaks and result.gradient.epsilon > 2 * result.epsilon


MECHANISMS = [("bandmf", {"bands": 4}, 19.0), ("blt", {"buffers": 2}, 2.2)]
"""Correlated noise at an accountant's epsilon near 2 over 300 steps of fixed batches
(q about 1/4: four groups each taken whole, 75 participations): BandMF's sigma is
the composition's (sqrt(75) times DP-SGD's), BLT's the run's Gaussian's."""


@pytest.mark.parametrize(("mechanism", "size", "sigma"), MECHANISMS, ids=["bandmf", "blt"])
@pytest.mark.parametrize("broken", [None, "correlation"])
def test_correlated_noise_is_audited_and_a_wrong_recursion_caught(mechanism, size, sigma,
                                                                  broken):
    """A correct BandMF or BLT step stays below its accountant's epsilon; a step whose
    recursion is not its strategy's (each release's noise cancelling the last draw, the
    sums of the releases left with one) leaks above it, while its accountant counts the
    mechanism."""
    from persample.dp import PrivateStep

    options = {**OPTIONS, "noise_multiplier": sigma, "expected_batch_size": 370,
               "steps": 300}
    result = audit(_net(), _data(), nn.CrossEntropyLoss(), mechanism=mechanism, **size,
                   step_type=BROKEN[broken] if broken else PrivateStep,
                   generator=torch.Generator().manual_seed(1), **options)
    assert result.mechanism.cycle_length == 4 and 1.5 < result.epsilon < 2.5
    if broken:
        assert result.leaks and result.gradient.epsilon > result.epsilon + 0.3
    else:
        assert not result.leaks and result.gradient.epsilon < result.epsilon / 2


def test_other_clipping_kinds_and_bad_input():
    result = audit(_net(), _data(), nn.CrossEntropyLoss(), per_layer=True,
                   generator=torch.Generator().manual_seed(0), **OPTIONS)
    assert not result.leaks
    x, y = _data()
    for bad, match in [((x, y.float()), "integer class labels"),
                       ((x, torch.zeros(500, dtype=torch.long)), "at least two classes")]:
        with pytest.raises(ValueError, match=match):
            audit(_net(), bad, nn.CrossEntropyLoss(), **OPTIONS)
    with pytest.raises(ValueError, match="canaries must be an int >= 10"):
        audit(_net(), (x, y), nn.CrossEntropyLoss(), **{**OPTIONS, "canaries": 5})
    with pytest.raises(ValueError, match="breaks a mechanism's noise: pass mechanism="):
        audit(_net(), (x, y), nn.CrossEntropyLoss(), step_type=BROKEN["correlation"],
              **OPTIONS)
    with pytest.raises(ValueError, match="needs per-sample losses"):
        audit(_net(), (x, y), lambda out, t: nn.functional.cross_entropy(out, t), **OPTIONS)


BANDED = ["--mechanism", "bandmf", "--bands", "4", "--steps", "200", "--sigma", "15",
          "--batch-size", "140"]
"""BandMF on the command line: 200 steps of four groups (each at rate 4 q, near 1), 50
participations, sigma 15: the accountant's epsilon near 2."""


@pytest.mark.keep_default_dtype
@pytest.mark.parametrize(("broken", "mechanism"), [(None, []), ("noise", []),
                                                   ("correlation", BANDED)])
def test_the_command_line(broken, mechanism, tmp_path, capsys):
    """``persample audit``: the bounds beside the accountant's epsilon; exit status 1
    and LEAKS for a broken step (no noise; with BandMF, a recursion that cancels the
    last draw), 0 for persample's."""
    import json

    from persample.cli import main

    out = tmp_path / "audit.json"
    argv = ["audit", "--subset", "300", "--canaries", "300", "--steps", "8", "--sigma", "2.0",
            "--batch-size", "100", "--threads", "1", "--json", str(out)]
    status = main(argv + mechanism + (["--broken", broken] if broken else []))
    figures = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "accountant's epsilon at delta 1e-05" in printed
    sigma, rate, count = (2.0, figures["sample_rate"], 8) if not mechanism else \
        (15.0, 4 * figures["sample_rate"], 50)  # BandMF: amplified over its 4 groups
    assert figures["epsilon"] == pytest.approx(accountant_epsilon(sigma, rate, count, 1e-5))
    if broken:
        assert status == 1 and figures["leaks"] and "LEAKS" in printed
        assert figures["gradient"]["epsilon"] > figures["epsilon"]
    else:
        assert status == 0 and not figures["leaks"] and "no leak found" in printed
