"""persample.dp.accounting against dp_accounting itself, and its input checks.

The expected epsilons were computed with dp-accounting 0.6.0 directly (the code
in ``_direct``), and are also recomputed live, so a wrong event (say Gaussian
without the Poisson sampling, or steps not composed) fails either way.
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from persample.dp.accounting import PrivacyAccountant, epsilon, noise_multiplier_for

# (sigma, q, steps, delta, accountant, epsilon from dp-accounting 0.6.0)
SETTINGS = [
    # MNIST in Abadi et al. 2016's set-up: batch 256 of 60,000, 60 epochs
    (1.1, 256 / 60000, 14063, 1e-5, "rdp", 2.596655529521983),
    (1.1, 256 / 60000, 14063, 1e-5, "pld", 2.381778812581751),
    (1.0, 0.01, 1000, 1e-5, "rdp", 2.101366525420273),
    (1.0, 0.01, 1000, 1e-5, "pld", 1.8282436455855091),
    # no subsampling: the Gaussian mechanism composed 10 times
    (1.0, 1.0, 10, 1e-5, "rdp", 19.05359753163139),
]


def _direct(sigma: float, q: float, steps: int, delta: float, accountant: str) -> float:
    acct = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acct.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("sigma,q,steps,delta,accountant,expected", SETTINGS,
                         ids=[f"{s[4]}-sigma{s[0]}-q{s[1]:.3g}-T{s[2]}" for s in SETTINGS])
def test_epsilon_matches_dp_accounting(sigma, q, steps, delta, accountant, expected):
    got = epsilon(sigma, q, steps, delta, accountant=accountant)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-6)
    assert got == pytest.approx(_direct(sigma, q, steps, delta, accountant), rel=1e-9)


def test_pld_is_tighter_than_rdp():
    assert epsilon(1.0, 0.01, 1000, 1e-5, "pld") < epsilon(1.0, 0.01, 1000, 1e-5, "rdp")


def test_monotone_in_steps_sigma_rate_and_delta():
    base = epsilon(1.0, 0.02, 500, 1e-5)
    assert epsilon(1.0, 0.02, 1000, 1e-5) > base  # more steps
    assert epsilon(0.8, 0.02, 500, 1e-5) > base  # less noise
    assert epsilon(1.0, 0.04, 500, 1e-5) > base  # larger batches
    assert epsilon(1.0, 0.02, 500, 1e-7) > base  # smaller delta
    steps = [epsilon(1.0, 0.02, t, 1e-5) for t in (1, 10, 100, 1000)]
    assert steps == sorted(steps) and len(set(steps)) == 4


def test_edge_values():
    assert epsilon(1.0, 0.01, 0, 1e-5) == 0.0  # no steps taken
    assert epsilon(0.0, 0.01, 10, 1e-5) == math.inf  # no noise
    assert epsilon(0.0, 0.01, 10, 1e-5, accountant="pld") == math.inf


@pytest.mark.parametrize("target,q,steps", [(1.0, 0.02, 500), (3.0, 0.04, 1000), (8.0, 0.1, 200)])
def test_noise_multiplier_round_trip(target, q, steps):
    sigma = noise_multiplier_for(target, 1e-5, q, steps)
    eps = epsilon(sigma, q, steps, 1e-5)
    assert eps <= target  # never less privacy than asked for
    assert eps > target * 0.995  # and not much more noise than needed
    assert epsilon(sigma - 2e-3, q, steps, 1e-5) > target  # a visibly smaller sigma fails it


def test_noise_multiplier_for_pld_is_near_the_exact_gaussian():
    # q = 1 and one step: the Gaussian mechanism, whose exact sigma for (2, 1e-5)-DP is
    # known in closed form (Balle & Wang 2018, dp_accounting.get_sigma_gaussian): 1.9938.
    # PLD is nearly tight (just above, by its pessimistic discretisation); RDP is looser.
    exact = dp_accounting.get_sigma_gaussian(2.0, 1e-5)
    sigma_pld = noise_multiplier_for(2.0, 1e-5, 1.0, 1, accountant="pld", tol=1e-2)
    sigma_rdp = noise_multiplier_for(2.0, 1e-5, 1.0, 1)
    assert exact == pytest.approx(1.9938, abs=1e-4)
    assert exact - 1e-2 <= sigma_pld <= exact + 0.03
    assert sigma_pld < sigma_rdp - 0.1


def test_noise_multiplier_matches_calibrate_dp_mechanism():
    q, steps = 0.04, 1000
    direct = dp_accounting.calibrate_dp_mechanism(
        rdp.RdpAccountant,
        lambda s: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), steps),
        3.0, 1e-5)
    assert noise_multiplier_for(3.0, 1e-5, q, steps) == pytest.approx(direct, abs=2e-4)


def test_privacy_accountant_counts_steps():
    acct = PrivacyAccountant()
    assert acct.steps == 0 and acct.epsilon(1e-5) == 0.0
    for _ in range(300):
        acct.step(1.0, 0.02)
    assert acct.steps == 300 and acct.history == [[1.0, 0.02, 300]]
    assert acct.epsilon(1e-5) == pytest.approx(epsilon(1.0, 0.02, 300, 1e-5), rel=1e-12)
    first = acct.epsilon(1e-5)
    acct.step(1.0, 0.02, count=100)
    assert acct.epsilon(1e-5) == pytest.approx(epsilon(1.0, 0.02, 400, 1e-5), rel=1e-12)
    assert acct.epsilon(1e-5) > first


def test_privacy_accountant_composes_different_steps():
    acct = PrivacyAccountant()
    acct.step(1.0, 0.02, count=200)
    acct.step(2.0, 0.05, count=100)
    assert acct.history == [[1.0, 0.02, 200], [2.0, 0.05, 100]]
    composed = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(1.0 * q, dp_accounting.GaussianDpEvent(s)), n)
        for s, q, n in [(1.0, 0.02, 200), (2.0, 0.05, 100)]
    ])
    expected = rdp.RdpAccountant().compose(composed).get_epsilon(1e-5)
    assert acct.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    # between the two runs alone and the sum of their epsilons
    assert epsilon(1.0, 0.02, 200, 1e-5) < acct.epsilon(1e-5)
    assert acct.epsilon(1e-5) < epsilon(1.0, 0.02, 200, 1e-5) + epsilon(2.0, 0.05, 100, 1e-5)


def test_privacy_accountant_pld():
    acct = PrivacyAccountant("pld")
    acct.step(1.0, 0.01, count=1000)
    assert acct.epsilon(1e-5) == pytest.approx(1.8282436455855091, rel=1e-6)
    # another accountant for one call, on the same steps
    assert acct.epsilon(1e-5, accountant="rdp") == pytest.approx(2.101366525420273, rel=1e-6)
    assert acct.accountant == "pld"
    assert "pld" in repr(acct) and "1000" in repr(acct)


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-0.1), "noise_multiplier"),
    (dict(noise_multiplier=math.nan), "noise_multiplier"),
    (dict(noise_multiplier=math.inf), "noise_multiplier"),
    (dict(sample_rate=0.0), r"sample_rate \(q\) must be in \(0, 1\]"),
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(steps=-1), "steps must be an int >= 0"),
    (dict(steps=2.5), "steps must be an int"),
    (dict(delta=0.0), r"delta must be in \(0, 1\)"),
    (dict(delta=1.0), "delta"),
    (dict(accountant="gdp"), "accountant='gdp' is not one of"),
])
def test_epsilon_rejects_bad_input(kwargs, match):
    args = dict(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-5) | kwargs
    with pytest.raises(ValueError, match=match):
        epsilon(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_epsilon=0.0), "target_epsilon must be finite and > 0"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(delta=2.0), "delta"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(tol=0.0), "tol must be > 0"),
    (dict(accountant="moments"), "accountant"),
])
def test_noise_multiplier_for_rejects_bad_input(kwargs, match):
    args = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10) | kwargs
    with pytest.raises(ValueError, match=match):
        noise_multiplier_for(**args)


def test_privacy_accountant_rejects_bad_input():
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant("moments")
    acct = PrivacyAccountant()
    with pytest.raises(ValueError, match="noise_multiplier"):
        acct.step(-1.0, 0.1)
    with pytest.raises(ValueError, match="sample_rate"):
        acct.step(1.0, 0.0)
    with pytest.raises(ValueError, match="count"):
        acct.step(1.0, 0.1, count=0)
    with pytest.raises(ValueError, match="delta"):
        acct.epsilon(0.0)
    with pytest.raises(ValueError, match="accountant"):
        acct.epsilon(1e-5, accountant="gdp")
    assert acct.steps == 0  # nothing recorded by the refused calls


def test_prv_is_opacus_prv_and_as_tight_as_pld():
    """accountant="prv" composes through Opacus's PRV accountant: its own figure, within a
    percent of PLD's (both tight) and below RDP's, for one run or several."""
    from opacus.accountants import PRVAccountant

    prv = epsilon(1.1, 256 / 60000, 14063, 1e-5, accountant="prv")
    direct = PRVAccountant()
    direct.history = [(1.1, 256 / 60000, 14063)]
    assert prv == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert prv == pytest.approx(2.381778812581751, rel=0.01) and prv < 2.596655529521983
    acct = PrivacyAccountant("prv")
    acct.step(1.0, 0.01, count=100)
    acct.step(1.2, 0.02, count=50)
    assert acct.epsilon(1e-5) == pytest.approx(acct.epsilon(1e-5, "pld"), rel=0.02)
    assert acct.epsilon(1e-5) < acct.epsilon(1e-5, "rdp")


def test_noise_multiplier_for_prv_meets_the_target():
    sigma = noise_multiplier_for(3.0, 1e-5, sample_rate=0.04, steps=1000, accountant="prv")
    assert epsilon(sigma, 0.04, 1000, 1e-5, accountant="prv") <= 3.0
    assert epsilon(sigma - 0.01, 0.04, 1000, 1e-5, accountant="prv") > 3.0
    assert sigma == pytest.approx(noise_multiplier_for(3.0, 1e-5, 0.04, 1000, "pld"), rel=0.02)


def test_prv_without_opacus_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "opacus.accountants", None)  # import fails
    with pytest.raises(ValueError, match="pip install opacus"):
        epsilon(1.0, 0.01, 10, 1e-5, accountant="prv")
