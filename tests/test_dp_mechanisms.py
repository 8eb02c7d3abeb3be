"""BandMF, the banded matrix factorization mechanism: its strategy against JAX-Privacy's,
the matrices it implies, the noise recursion against ``C^-1 Z``, the amplified
accounting's runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from persample.dp import BLT, PrivateStep
from persample.dp.mechanisms import (
    BandMF,
    CorrelatedNoise,
    _loss,
    accounted_runs,
    check_mechanism,
    max_error_coefs,
    workload_coefs,
)

# JAX-Privacy 2.0.0 (jax 0.10.2, x64), for (steps, bands):
# toeplitz.optimize_banded_toeplitz(n, bands), then toeplitz.loss(coef, n=n) ("mean")
# and toeplitz.loss(coef, n=n, reduction_fn=jnp.max) ("max")
JAX_PRIVACY = {
    (64, 4): (10.501446861055825, 19.05753379814566),
    (256, 8): (20.681211081439287, 38.080111632263936),
    (1000, 16): (39.41531727284133, 73.38988416305021),
    (2000, 32): (42.02465456957093, 77.02640284424717),
}
JAX_PRIVACY_COEFS_64_4 = [0.708060770482, 0.474552809218, 0.397744883258, 0.33948281902]
# toeplitz.per_query_error(strategy_coef=<the (256, 8) coefs>, n=256,
# workload_coef=(1 - 0.9 ** (k + 1)) / (1 - 0.9)), its mean
JAX_PRIVACY_MOMENTUM_256_8 = 1616.664050763864


@pytest.mark.parametrize(("steps", "bands"), list(JAX_PRIVACY))
def test_the_strategy_is_jax_privacys(steps, bands):
    """The optimised coefficients reach JAX-Privacy's expected error (the mean, the
    objective, to 1e-12 relative; the max error at that optimum, which the optimum's
    flat directions leave free to a few 1e-9, to 1e-8): the same optimum, found by a
    different optimiser."""
    mech = BandMF(steps, bands)
    mean, most = JAX_PRIVACY[(steps, bands)]
    assert mech.expected_error() == pytest.approx(mean, rel=1e-12)
    assert mech.expected_error("max") == pytest.approx(most, rel=1e-8)
    assert float(mech.coefs.norm()) == pytest.approx(1.0, abs=1e-14)
    if (steps, bands) == (64, 4):
        torch.testing.assert_close(mech.coefs, torch.tensor(JAX_PRIVACY_COEFS_64_4,
                                                            dtype=torch.float64),
                                   rtol=0, atol=1e-8)


def test_the_momentum_workloads_error_is_jax_privacys():
    mech = BandMF(256, 8)  # the prefix workload's strategy, scored on momentum 0.9
    a = workload_coefs(256, "momentum", 0.9)
    assert _loss(mech.coefs.numpy(), a, "mean")[0] == pytest.approx(
        JAX_PRIVACY_MOMENTUM_256_8, rel=1e-9)  # (the coefficients agree to 1e-8)
    tuned = BandMF(256, 8, workload="momentum", momentum=0.9)
    assert tuned.expected_error() < JAX_PRIVACY_MOMENTUM_256_8 * 0.99  # tuned for it


def test_the_gradient_of_the_error_is_exact():
    """The analytic gradient against central differences, both errors and workloads."""
    c = np.array([1.0, 0.6, 0.3, 0.1])
    for a in (workload_coefs(40), workload_coefs(40, "momentum", 0.8)):
        for error in ("mean", "max"):
            _, grad = _loss(c, a, error)
            h = 1e-6
            numeric = [(_loss(c + h * e, a, error)[0] - _loss(c - h * e, a, error)[0]) / (2 * h)
                       for e in np.eye(4)]
            np.testing.assert_allclose(grad, numeric, rtol=1e-6)


def test_one_band_is_dp_sgd():
    """``bands=1``: C the identity, the noise independent, DP-SGD's error on the prefix
    sums ((T + 1) / 2 on average, T at the last step), DP-SGD's accounting."""
    mech = BandMF(50, 1)
    assert mech.coefs.tolist() == [1.0]
    eye = torch.eye(50, dtype=torch.float64)
    assert torch.equal(mech.matrix, eye) and torch.equal(mech.noise_matrix, eye)
    assert mech.expected_error() == pytest.approx(51 / 2)
    assert mech.expected_error("max") == pytest.approx(50)
    assert accounted_runs(mech, 1.1, 0.02, 50) == [(1.1, 0.02, 50)]


@pytest.mark.parametrize(("steps", "bands"), [(30, 4), (7, 7), (12, 1), (25, 6)])
def test_the_matrices(steps, bands):
    """C: lower-triangular, ``bands`` diagonals (Toeplitz but for its last columns'
    scale), every column of norm 1; ``noise_matrix`` its inverse; more bands, less
    error than DP-SGD."""
    mech = BandMF(steps, bands)
    C = mech.matrix
    k = torch.arange(steps)
    outside = (k[:, None] < k[None, :]) | (k[:, None] - k[None, :] >= bands)
    assert bool((C[outside] == 0).all()) and bool((C.diagonal() > 0).all())
    torch.testing.assert_close(C.norm(dim=0), torch.ones(steps, dtype=torch.float64))
    torch.testing.assert_close(mech.noise_matrix @ C, torch.eye(steps, dtype=torch.float64),
                               rtol=0, atol=1e-10)
    if bands > 1:
        assert mech.expected_error() < BandMF(steps, 1).expected_error()


def test_the_noise_recursion_is_the_noise_matrix():
    """:class:`CorrelatedNoise` over T releases of independent draws Z (two parameters,
    float64) gives ``C^-1 Z`` exactly: the recursion keeps a ring of ``bands`` draws
    (reused, not reallocated), and the last rows are scaled up."""
    steps, bands = 20, 5
    mech = BandMF(steps, bands)
    g = torch.Generator().manual_seed(0)
    z = {"w": torch.randn(steps, 3, 4, generator=g), "b": torch.randn(steps, 4, generator=g)}
    noise, got = CorrelatedNoise(mech), {"w": [], "b": []}
    for t in range(steps):
        for name in z:
            draw = z[name][t].clone()
            noise.correlate(name, draw)
            got[name].append(draw)
        noise.advance()
        assert noise.history["w"].shape == (bands, 12)  # one ring, reused
    for name in z:
        want = (mech.noise_matrix @ z[name].flatten(1)).view_as(z[name])
        torch.testing.assert_close(torch.stack(got[name]), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="was made for 20 releases; this is release 21"):
        noise.correlate("w", torch.zeros(3, 4))


def test_a_resumed_state_continues_the_same_noise():
    mech = BandMF(12, 3)
    z = torch.randn(12, 6, generator=torch.Generator().manual_seed(1))

    def run(noise, ts):
        out = []
        for t in ts:
            draw = z[t].clone()
            noise.correlate("p", draw)
            noise.advance()
            out.append(draw)
        return out

    whole = run(CorrelatedNoise(mech), range(12))
    first = CorrelatedNoise(mech)
    head = run(first, range(5))
    saved = first.state_dict()
    resumed = CorrelatedNoise(mech)
    resumed.load_state_dict(saved)
    tail = run(resumed, range(5, 12))
    assert all(torch.equal(a, b) for a, b in zip(whole, head + tail))


def test_amplified_accounting_runs():
    """Theorem 4 of Choquette-Choo et al. 2023: ceil(T / b) steps at rate b q."""
    mech = BandMF(100, 8)
    assert accounted_runs(mech, 0.9, 0.01, 100) == [(0.9, 0.08, 13)]
    assert accounted_runs(mech, 0.9, 0.01, 96) == [(0.9, 0.08, 12)]
    assert accounted_runs(None, 0.9, 0.01, 100) == [(0.9, 0.01, 100)]
    assert mech.participations(100) == math.ceil(100 / 8) == 13


def test_given_coefficients_and_the_starting_point():
    mech = BandMF(10, 3, coefs=[2.0, 1.0, 0.5])
    torch.testing.assert_close(mech.coefs, torch.tensor([2.0, 1.0, 0.5],
                                                        dtype=torch.float64) / math.sqrt(5.25))
    assert max_error_coefs(4).tolist() == [1.0, 0.5, 0.375, 0.3125]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0, "bands": 1}, "steps must be an int >= 1"),
    ({"steps": 10, "bands": 1.5}, "bands must be an int >= 1"),
    ({"steps": 3, "bands": 4}, "bands must be at most steps"),
    ({"steps": 10, "bands": 2, "workload": "adam"}, "workload must be one of"),
    ({"steps": 10, "bands": 2, "error": "rms"}, "error must be one of"),
    ({"steps": 10, "bands": 2, "workload": "momentum", "momentum": 1.0}, "momentum must be"),
    ({"steps": 10, "bands": 2, "coefs": [1.0]}, "coefs must be 2 finite numbers"),
    ({"steps": 10, "bands": 2, "coefs": [-1.0, 0.5]}, "coefs\\[0\\] > 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BandMF(**kwargs)


def test_only_a_mechanism_is_taken():
    assert check_mechanism(None) is None
    with pytest.raises(TypeError, match="mechanism must be a persample.dp.BandMF"):
        check_mechanism("bandmf")


# ---------------------------------------------------------------------------
# the mechanism in PrivateStep


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _releases(mechanism, steps: int, sigma: float = 1.3, data=None, **options) -> list:
    """``steps`` releases of a PrivateStep (seeded noise); each release's p.grad, flat;
    ``data``: a micro-batch accumulated before each release."""
    net = _net()
    step = PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=0.7, noise_multiplier=sigma,
                       expected_batch_size=8, generator=torch.Generator().manual_seed(3),
                       mechanism=mechanism, **options)
    out = []
    for _ in range(steps):
        if data is not None:
            step.accumulate(*data)
        step.release()
        out.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    return out, step


def _blt(steps: int, cycle_length: int = 2) -> BLT:
    """A BLT of given decays (two buffers)."""
    return BLT(steps, 2, cycle_length=cycle_length, decays=([0.9, 0.5], [0.7, 0.2]))


@pytest.mark.parametrize("mech", [BandMF(10, 4), _blt(10)], ids=["bandmf", "blt"])
def test_the_steps_noise_is_the_noise_matrix_times_dp_sgds(mech):
    """With the same generator, a BandMF (or BLT) step's p.grad over T releases is
    ``C^-1`` times the independent noise DP-SGD's step draws (float64, to rounding);
    ``bands=1`` is DP-SGD's p.grad exactly."""
    independent, _ = _releases(None, 10)
    correlated, _ = _releases(mech, 10)
    want = mech.noise_matrix @ torch.stack(independent)
    torch.testing.assert_close(torch.stack(correlated), want, rtol=1e-12, atol=1e-15)
    one, _ = _releases(BandMF(10, 1), 10)
    assert all(torch.equal(a, b) for a, b in zip(one, independent))


def test_without_noise_every_mechanism_is_the_clipped_mean():
    g = torch.Generator().manual_seed(5)
    data = (torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g))
    plain, _ = _releases(None, 3, sigma=0.0, data=data)
    for mech in (BandMF(3, 2), BandMF(3, 3, workload="momentum"), _blt(3), BLT(3, 1)):
        got, _ = _releases(mech, 3, sigma=0.0, data=data)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.parametrize("mech", [BandMF(6, 3), _blt(6, 3)], ids=["bandmf", "blt"])
def test_the_noise_covariance_across_steps(mech):
    """Statistical: over 40,000 coordinates of zero-gradient releases, the covariance of
    the T = 6 releases' noise is ``(sigma C / B')^2 C^-1 C^-T`` (entries within 4 standard
    errors), C of sensitivity 1."""
    net = nn.Linear(200, 200, bias=False)
    step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=2.0,
                       expected_batch_size=4, generator=torch.Generator().manual_seed(0),
                       mechanism=mech)
    draws = []
    for _ in range(6):
        step.release()
        draws.append(net.weight.grad.flatten().double() * 4 / 2.0)  # in units of sigma C
    x = torch.stack(draws)  # (T, P)
    got = x @ x.T / x.shape[1]
    inv = mech.noise_matrix
    want = inv @ inv.T
    se = torch.sqrt((want.diagonal()[:, None] * want.diagonal()[None, :] + want ** 2)
                    / x.shape[1])
    assert bool(((got - want).abs() <= 4 * se + 1e-12).all()), (got - want).abs() / se


@pytest.mark.parametrize("mech", [BandMF(9, 3), _blt(9)], ids=["bandmf", "blt"])
def test_a_resumed_step_continues_the_same_noise(mech):
    """state_dict after 4 of 9 releases, loaded into a new step with the same mechanism:
    the last 5 releases' noise is the uninterrupted run's; a state without the mechanism
    (or with one into a step without) is refused by name."""
    whole, _ = _releases(mech, 9)
    head, step = _releases(mech, 4)
    saved = {k: v for k, v in step.state_dict().items()}
    net = _net()
    resumed = PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=0.7, noise_multiplier=1.3,
                          expected_batch_size=8, generator=torch.Generator(), mechanism=mech)
    resumed.load_state_dict(saved)
    tail = []
    for _ in range(5):
        resumed.release()
        tail.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(whole, head + tail))
    plain = PrivateStep(_net(), nn.CrossEntropyLoss(), max_grad_norm=0.7,
                        noise_multiplier=1.3, expected_batch_size=8)
    with pytest.raises(ValueError, match="with a mechanism .correlated noise.: pass the same"):
        plain.load_state_dict(saved)
    with pytest.raises(ValueError, match="without a mechanism: this one correlates"):
        resumed.load_state_dict(plain.state_dict())
    with pytest.raises(RuntimeError, match="was made for 9 releases; this is release 10"):
        resumed.release()  # its tenth


def test_the_step_accounts_the_accounted_runs():
    """sample_rate q with b bands: every b-th release one step at rate b q, so that
    epsilon after T releases is DP-SGD's of ceil(T / b) steps at b q (dp_accounting by
    the same accountant)."""
    from persample.dp import epsilon

    _, step = _releases(BandMF(10, 4), 10, sample_rate=0.05)
    assert step.accountant.steps == 3
    assert step.epsilon(1e-5) == pytest.approx(epsilon(1.3, 0.2, 3, 1e-5), rel=1e-12)
    _, plain = _releases(None, 10, sample_rate=0.05)
    assert step.epsilon(1e-5) != plain.epsilon(1e-5)
    import dp_accounting  # the same events composed by hand in Google's library

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.2, dp_accounting.GaussianDpEvent(1.3)), 3)
    for kind, accountant in (("rdp", dp_accounting.rdp.RdpAccountant()),
                             ("pld", dp_accounting.pld.PLDAccountant())):
        _, step = _releases(BandMF(10, 4), 10, sample_rate=0.05, accountant=kind)
        want = accountant.compose(event).get_epsilon(1e-5)
        assert step.epsilon(1e-5) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("options", "match"), [
    ({"sample_rate": 0.3}, "need sample_rate <= 1 / 4"),
    ({"adaptive_clipping": "adaptive"}, "mechanism= with adaptive_clipping"),
])
def test_the_step_refuses_what_the_mechanism_cannot_take(options, match):
    from persample.dp import AdaptiveClipping

    if options.get("adaptive_clipping") == "adaptive":
        options = {"adaptive_clipping": AdaptiveClipping(target_unclipped_quantile=0.5,
                                                         unclipped_num_std=4.0)}
        with pytest.raises(ValueError, match=match):
            PrivateStep(_net(), nn.CrossEntropyLoss(), max_grad_norm=1.0,
                        noise_multiplier=1.0, expected_batch_size=8,
                        mechanism=BandMF(10, 4), **options)
        return
    with pytest.raises(ValueError, match=match):
        PrivateStep(_net(), nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                    expected_batch_size=8, mechanism=BandMF(10, 4), **options)
    with pytest.raises(TypeError, match="mechanism must be a persample.dp.BandMF"):
        PrivateStep(_net(), nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                    expected_batch_size=8, mechanism="bandmf")


# ---------------------------------------------------------------------------
# make_private


def _data(n: int = 120):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g),
                         torch.arange(n))


def _loss_of(out, y):
    return nn.functional.cross_entropy(out, y)


def test_make_private_with_bandmf_samples_cyclically_and_spends_the_target():
    """mechanism='bandmf', bands=4: q = 10 / 120, 12 steps an epoch, 24 in two; the
    noise multiplier is DP-SGD's for ceil(24 / 4) = 6 steps at rate 4 q, the target
    spent; every record in at most one of any 4 consecutive logical batches."""
    from persample.dp import CyclicPoissonSampler, make_private, noise_multiplier_for

    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(), _loss_of,
                           epochs=2, max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5,
                           expected_batch_size=10, physical_batch_size=4,
                           mechanism="bandmf", bands=4,
                           generator=torch.Generator().manual_seed(1))
    assert isinstance(private.sampler, CyclicPoissonSampler) and private.sampler.cycle_length == 4
    assert private.step.mechanism.steps == 24 and private.step.mechanism.bands == 4
    assert private.noise_multiplier == pytest.approx(
        noise_multiplier_for(3.0, 1e-5, 4 * 10 / 120, 6), rel=1e-9)
    last: dict[int, int] = {}
    t = 0
    for _ in range(2):
        for logical in private.batches():
            for x, y, index in logical:
                private.accumulate(x, y)
                for i in index.tolist():
                    assert t - last.get(i, -4) >= 4
                    last[i] = t
            private.release()
            t += 1
    assert t == 24 and private.step.accountant.steps == 6
    assert private.epsilon(1e-5) == pytest.approx(3.0, rel=0.02)
    assert private.epsilon(1e-5) <= 3.0 + 1e-9


def test_make_private_with_bandmf_at_user_level():
    """user_ids with mechanism='bandmf', bands=3: 30 users of 4 records, q = 3 / 30;
    the users split into 3 groups, each user (all its records, in one physical batch) in
    at most one of any 3 logical batches; epsilon per user over ceil(T / 3) steps at
    rate 3 q."""
    from persample.dp import CyclicUserPoissonSampler, epsilon, make_private

    users = torch.arange(120) // 4 * 7 + 2  # 30 users, ids not 0..29
    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(), _loss_of,
                           epochs=1, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=3, physical_batch_size=8, user_ids=users,
                           mechanism="bandmf", bands=3,
                           generator=torch.Generator().manual_seed(2))
    assert isinstance(private.sampler, CyclicUserPoissonSampler)
    last: dict[int, int] = {}
    for t, logical in enumerate(private.batches()):
        seen = set()
        for x, y, index in logical:
            private.accumulate(x, y)
            mine = set(users[index].tolist())
            assert not mine & seen and all(int((users[index] == u).sum()) == 4 for u in mine)
            seen |= mine
        for u in seen:
            assert t - last.get(u, -3) >= 3
            last[u] = t
        private.release()
    assert private.step.noise.t == 10 and private.step.accountant.steps == 4
    assert private.epsilon(1e-5) == pytest.approx(epsilon(1.0, 0.3, 4, 1e-5), rel=1e-9)


@pytest.mark.parametrize(("options", "match"), [
    ({"bands": 4}, "bands= goes with mechanism='bandmf'"),
    ({"mechanism": "bandmf"}, "needs bands=b"),
    ({"mechanism": "banded"}, "mechanism must be one of"),
    ({"mechanism": BandMF(10, 2)}, "was made for 10 releases; this run takes 12"),
    ({"mechanism": "bandmf", "bands": 13}, "need sample_rate <= 1 / 13"),
])
def test_make_private_refuses_a_mechanism_it_cannot_run(options, match):
    from persample.dp import make_private

    net = _net()
    with pytest.raises(ValueError, match=match):
        make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), _data(), _loss_of,
                     epochs=1, max_grad_norm=1.0, noise_multiplier=1.0,
                     expected_batch_size=10, **options)


# ---------------------------------------------------------------------------
# the Opacus-compatible engine


def test_privacy_engine_with_bandmf_and_the_batch_memory_manager():
    """make_private_with_epsilon(mechanism='bandmf', bands=3): the strategy made for
    epochs * len(loader) steps, the loader cyclic (one split for the run, the cycle
    running on across the BatchMemoryManager's epochs), each record in at most one of
    every 3 logical batches, the accountant's steps amplified, the target spent."""
    from torch.utils.data import DataLoader, TensorDataset

    from persample.dp import BatchMemoryManager, CyclicPoissonSampler, PrivacyEngine

    n = 100  # 10 logical batches an epoch: not a multiple of the cycle
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(n, dtype=x.dtype)  # each record's index, read back below
    data = TensorDataset(x, torch.randint(0, 3, (n,), generator=torch.Generator()))
    model = nn.Linear(5, 3)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10), target_epsilon=4.0, target_delta=1e-5,
        epochs=2, max_grad_norm=1.0, mechanism="bandmf", bands=3)
    assert isinstance(loader.batch_sampler, CyclicPoissonSampler)
    assert engine.steps[-1].mechanism.steps == 20  # 2 epochs of 10
    noise = engine.steps[-1].noise  # its release count: the logical batch under way
    last: dict[int, int] = {}
    for _ in range(2):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4,
                                optimizer=optimizer) as physical:
            for xb, yb in physical:
                optimizer.zero_grad()
                nn.CrossEntropyLoss()(model(xb), yb).backward()
                for i in xb[:, 0].long().tolist():
                    assert noise.t - last.get(i, -3) >= 3, (i, noise.t, last.get(i))
                    last[i] = noise.t
                optimizer.step()
    assert noise.t == 20 and engine.accountant.steps == 7
    assert engine.get_epsilon(1e-5) == pytest.approx(4.0, rel=0.02)


def test_secure_noise_is_correlated_too():
    """secure_mode: the OS's draws go through the same recursion (the states kept, the
    releases counted); torch's generator untouched."""
    net = nn.Linear(50, 40, bias=False)
    step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                       expected_batch_size=1, secure_mode=True, mechanism=BandMF(5, 3))
    before = torch.get_rng_state()
    grads = []
    for _ in range(5):
        step.release()
        grads.append(net.weight.grad.clone())
    assert step.noise.t == 5 and step.noise.history["weight"].shape == (3, 2000)
    assert torch.equal(before, torch.get_rng_state())
    want = BandMF(5, 3).noise_matrix.norm(dim=1)  # each release's std: its row's norm
    for g, std in zip(grads, want.tolist()):  # 2,000 draws: the std within 10%
        assert bool(torch.isfinite(g).all()) and abs(float(g.std()) / std - 1) < 0.1


def test_a_longer_cycle_keeps_the_columns_disjoint():
    """BandMF with cycle_length s >= bands (fixed batches an epoch apart at s q = 1):
    a record's columns touch disjoint rows, so the worst ``||C u||`` over every pattern
    of releases ``s`` apart is ``sqrt(ceil(T / s))``, what ``ceil(T / s)`` compositions
    at rate ``s q`` account; a cycle shorter than the bands is refused."""
    import itertools

    mech = BandMF(12, 3, cycle_length=4)
    assert mech.runs(1.5, 0.25, 12) == [(1.5, 1.0, 3)] == accounted_runs(mech, 1.5, 0.25, 12)
    C = mech.matrix
    worst = max(float(C[:, list(p)].sum(1).norm())
                for r in range(1, 13) for p in itertools.combinations(range(12), r)
                if all(b - a >= 4 for a, b in zip(p, p[1:])))
    assert worst == pytest.approx(math.sqrt(3), rel=1e-12)
    assert "cycle_length=4" in repr(mech)
    with pytest.raises(ValueError, match="cycle_length must be at least bands"):
        BandMF(12, 3, cycle_length=2)
