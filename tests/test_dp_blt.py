"""BLT, the buffered linear Toeplitz mechanism: its strategy against JAX-Privacy's, its
sensitivity against every participation pattern, its accounting against dp_accounting,
and the front doors that make it (fixed batches an epoch apart)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from persample.dp import BLT, PrivateStep, epsilon, make_private, noise_multiplier_for
from persample.dp.blt import blt_coefs, inverse_pair
from persample.dp.mechanisms import accounted_runs, release_runs, resolve_mechanism

# JAX-Privacy 2.0.0 (jax 0.10.2, x64): for (n, min_sep, max_participations, error,
# buffers), blt = buffered_toeplitz.optimize(n=n, min_sep=min_sep,
# max_participations=k, error=error, min_buffers=buffers, max_buffers=buffers);
# loss = LossFn.build_min_sep(n, error, min_sep, k).loss(blt) (error times squared
# sensitivity); sens2 = toeplitz.minsep_sensitivity_squared(blt.toeplitz_coefs(n),
# min_sep, k); theta = blt.buf_decay, theta_hat = blt.inverse().buf_decay.
JAX_PRIVACY = {
    (100, 1, 1, "max", 2): (6.43394838332481, 2.518818700521991,
                            [0.9888596997267308, 0.7729881333431666],
                            [0.9392843131216952, 0.3529947475583908]),
    (1000, 1, 1, "mean", 3): (9.309099978775635, 3.039485647367195,
                              [0.9970481114294671, 0.9590954831845855, 0.6613284620489445],
                              [0.9868694092694773, 0.8757194580678311, 0.26384579193590874]),
    (1000, 100, 10, "mean", 3): (148.69001630617697, 38.129618306689316,
                                 [0.9816634885526594, 0.8524643221143916, 0.5777680889357881],
                                 [0.8525352785732061, 0.8523944251058931,
                                  0.19938569571469467]),
    (2000, 250, 8, "max", 4): (173.9630915831328, 37.24745619536472,
                               [0.9999999998751419, 0.9921213939187936, 0.8502011846632637,
                                0.38751102357993444],
                               [0.9996878049609108, 0.9505903035169347, 0.6608588045198712,
                                0.11715556843674935]),
    (512, 64, 8, "mean", 2): (96.8304856453853, 27.38493789426901,
                              [0.9699704427679211, 0.4484726327442933],
                              [0.7820412833316954, 0.12165606492529452]),
}


def _cycle(n: int, sep: int, k: int) -> int:
    """The cycle length giving ``k`` participations in ``n`` steps (``n`` if one)."""
    assert -(-n // sep) == k or k == 1
    return sep if k > 1 else n


@pytest.mark.parametrize("case", list(JAX_PRIVACY), ids=str)
def test_the_strategy_is_jax_privacys(case):
    """JAX-Privacy's decays give its loss and sensitivity here (to 1e-9); the
    optimisation here reaches its loss or lower."""
    n, sep, k, error, d = case
    loss, sens2, theta, theta_hat = JAX_PRIVACY[case]
    given = BLT(n, d, cycle_length=_cycle(n, sep, k), error=error, decays=(theta, theta_hat))
    assert given.expected_error() == pytest.approx(loss, rel=1e-9)
    assert given.sensitivity ** 2 == pytest.approx(sens2, rel=1e-9)
    mine = BLT(n, d, cycle_length=_cycle(n, sep, k), error=error)
    assert mine.expected_error() <= loss * (1 + 1e-7)
    assert bool((mine.output_scale >= 0).all() and (mine.inverse_scale <= 0).all())


def test_the_inverse_pair_and_the_matrices():
    """``C C^-1 = I`` (float64), ``C``'s first column from its decays and scales, and
    the two pairs of scales of Lemma 5.2 make inverse generating functions."""
    mech = BLT(40, 3, cycle_length=10)
    eye = torch.eye(40, dtype=torch.float64)
    torch.testing.assert_close(mech.matrix @ mech.noise_matrix, eye, rtol=0, atol=1e-12)
    c = blt_coefs(mech.buf_decay, mech.output_scale, 40)
    torch.testing.assert_close(mech.matrix[:, 0] * mech.sensitivity, c)
    assert torch.equal(c, c.sort(descending=True).values) and float(c[-1]) > 0
    w, w_hat = inverse_pair(mech.buf_decay, mech.inverse_decay)
    torch.testing.assert_close(w, mech.output_scale)
    torch.testing.assert_close(w_hat, mech.inverse_scale)


@pytest.mark.parametrize(("steps", "cycle"), [(12, 3), (11, 4), (9, 9), (10, 1)])
def test_the_sensitivity_is_the_worst_participation_pattern(steps, cycle):
    """Brute force over every set of releases at least ``cycle`` apart: the largest
    ``||C u||`` of the first ``t`` releases is ``prefix_sensitivity[t - 1]`` (the whole
    run's is 1: the matrix is scaled to it), reached by ``0, s, 2s, ...``."""
    mech = BLT(steps, 2, cycle_length=cycle, decays=([0.9, 0.5], [0.7, 0.2]))
    C = mech.matrix
    patterns = [p for r in range(1, steps + 1) for p in itertools.combinations(range(steps), r)
                if all(b - a >= cycle for a, b in zip(p, p[1:]))]
    for t in range(1, steps + 1):
        worst = max(float(C[:t, list(p)].sum(1).norm()) for p in patterns)
        assert worst == pytest.approx(float(mech.prefix_sensitivity[t - 1]), rel=1e-12)
    assert float(mech.prefix_sensitivity[-1]) == 1.0
    assert mech.participations(steps) == -(-steps // cycle)


def test_a_blt_without_valid_decays_is_refused():
    with pytest.raises(ValueError, match="its output scales must be nonnegative"):
        BLT(10, 2, decays=([0.5, 0.9], [0.95, 0.2]))  # not interlaced
    with pytest.raises(ValueError, match="decays must be two sequences of 2"):
        BLT(10, 2, decays=([0.5], [0.2]))
    with pytest.raises(ValueError, match="cycle_length must be an int >= 1"):
        BLT(10, 2, cycle_length=0)


def test_the_step_accounts_one_gaussian_mechanism():
    """BLT releases compose, in the accountant, to the Gaussian mechanism of noise
    multiplier ``sigma / P_t`` after ``t`` releases (``P`` the prefix sensitivity), by
    RDP and PLD against dp_accounting's own Gaussian event; the whole run's is
    ``sigma``'s, whatever the sample rate (no amplification)."""
    import dp_accounting

    mech = BLT(12, 2, cycle_length=4, decays=([0.9, 0.5], [0.7, 0.2]))
    for kind, fresh in (("rdp", dp_accounting.rdp.RdpAccountant),
                        ("pld", dp_accounting.pld.PLDAccountant)):
        net = nn.Linear(4, 3)
        step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=2.0,
                           expected_batch_size=4, sample_rate=0.25, accountant=kind,
                           generator=torch.Generator().manual_seed(0), mechanism=mech)
        for t in range(12):
            step.release()
            if t in (0, 5, 11):
                sigma = 2.0 / float(mech.prefix_sensitivity[t])
                want = fresh().compose(dp_accounting.GaussianDpEvent(sigma)).get_epsilon(1e-5)
                assert step.epsilon(1e-5) == pytest.approx(want, rel=1e-6), (kind, t)
    assert accounted_runs(mech, 2.0, 0.25, 12) == [(2.0, 1.0, 1)]
    assert sum(len(release_runs(mech, 2.0, 0.25, t)) for t in range(12)) <= 12
    assert epsilon(2.0, 1.0, 1, 1e-5, "pld") == pytest.approx(step.epsilon(1e-5), rel=1e-6)


def _data(n: int = 120, index: bool = True):
    """``n`` records ``(x (5,), y, [its index])``."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(x, y, torch.arange(n)) if index else TensorDataset(x, y)


def test_make_private_with_blt_takes_fixed_batches_an_epoch_apart():
    """mechanism='blt': q = 10 / 120, an epoch of 12 fixed batches (each group taken
    whole: rate 12 q = 1), the same order every epoch, so each record is in exactly one
    batch an epoch, 12 steps apart; the noise multiplier is the Gaussian mechanism's
    for the target, spent exactly at the end."""
    from persample.dp import CyclicPoissonSampler

    net = nn.Sequential(nn.Linear(5, 3))
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(),
                           lambda out, y: nn.functional.cross_entropy(out, y), epochs=3,
                           max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5,
                           expected_batch_size=10, physical_batch_size=4, mechanism="blt",
                           buffers=2, generator=torch.Generator().manual_seed(1))
    mech = private.step.mechanism
    assert isinstance(mech, BLT) and (mech.steps, mech.cycle_length, mech.buffers) == (36, 12, 2)
    assert isinstance(private.sampler, CyclicPoissonSampler)
    assert private.noise_multiplier == pytest.approx(noise_multiplier_for(3.0, 1e-5, 1.0, 1))
    seen: dict[int, list[int]] = {}
    t = 0
    for _ in range(3):
        for logical in private.batches():
            for x, y, index in logical:
                private.accumulate(x, y)
                for i in index.tolist():
                    seen.setdefault(i, []).append(t)
            private.release()
            t += 1
    assert t == 36 and sorted(seen) == list(range(120))
    assert all(len(s) == 3 and s[1] - s[0] == 12 and s[2] - s[1] == 12 for s in seen.values())
    assert private.epsilon(1e-5) == pytest.approx(3.0, rel=1e-3)
    assert private.epsilon(1e-5) <= 3.0 + 1e-9


def test_the_front_doors_name_what_they_refuse():
    with pytest.raises(ValueError, match="buffers= goes with mechanism='blt'"):
        resolve_mechanism("bandmf", 10, 0.1, bands=2, buffers=2)
    with pytest.raises(ValueError, match="was made for 10 releases; this run takes 20"):
        resolve_mechanism(BLT(10, 1), 20, 0.1)
    with pytest.raises(ValueError, match="need sample_rate <= 1 / 10"):
        resolve_mechanism(BLT(10, 1), 10, 0.2)


def test_the_privacy_engine_takes_a_blt():
    """make_private_with_epsilon(mechanism='blt', buffers=2): fixed batches (the loader's
    len an epoch), the Gaussian calibration, the target spent."""
    from torch.utils.data import DataLoader

    from persample.dp import BatchMemoryManager, PrivacyEngine

    model = nn.Linear(5, 3)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(100, index=False), batch_size=10), target_epsilon=4.0,
        target_delta=1e-5, epochs=2, max_grad_norm=1.0, mechanism="blt", buffers=2)
    assert engine.steps[-1].mechanism.cycle_length == 10
    for _ in range(2):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4,
                                optimizer=optimizer) as physical:
            for xb, yb in physical:
                optimizer.zero_grad()
                nn.CrossEntropyLoss()(model(xb), yb).backward()
                optimizer.step()
    assert engine.steps[-1].noise.t == 20
    assert engine.get_epsilon(1e-5) == pytest.approx(4.0, rel=1e-3)
