"""PrivateStep across processes (torch.distributed, gloo, 2 processes on this machine):
the same p.grad on every rank, equal to one process on the whole batch; the noise added
once; DDP-wrapped models; mismatches and non-finite gradients raise on every rank with
p.grad unchanged; the distributed Poisson sampler splits one sample across ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dist_workers
from battery import clipped_sum_by_hand
from persample import loop_per_sample_grads
from persample.dp import BandMF, PoissonBatchSampler, PrivateStep, epsilon, private_grad
from spawned import ranks_of

pytestmark = pytest.mark.slow  # several processes

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of two gloo processes saw (spawned once for all the tests here)."""
    return ranks_of(dist_workers.worker, tmp_path_factory.mktemp("dist"), WORLD,
                    what="distributed workers")


def _whole_batch() -> dict:
    net = dist_workers.model()
    x, y = dist_workers.data()
    private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=dist_workers.C,
                 noise_multiplier=0.0, expected_batch_size=dist_workers.N)
    return dist_workers.grads(net)


@pytest.mark.parametrize("scenario", ["plain", "ddp"])
def test_two_processes_equal_one_on_the_whole_batch(ranks, scenario):
    want = _whole_batch()
    for name, g in want.items():
        torch.testing.assert_close(ranks[0][scenario][name], g, rtol=1e-10, atol=1e-13)
        assert torch.equal(ranks[0][scenario][name], ranks[1][scenario][name])


@pytest.mark.parametrize("kind", list(dist_workers.CLIPPINGS))
def test_clipping_by_group_and_automatic_across_ranks(ranks, kind):
    """Each rank's clipped sums of its samples, summed: the by-hand clipped mean of the
    whole batch (the loop's per-sample gradients)."""
    net = dist_workers.model()
    x, y = dist_workers.data()
    options = dist_workers.CLIPPINGS[kind]
    grads = loop_per_sample_grads(net, x, y, nn.CrossEntropyLoss())
    want = clipped_sum_by_hand(grads, options["max_grad_norm"],
                               param_groups=options.get("param_groups"),
                               gamma=options.get("automatic_gamma", 0.01),
                               divisor=dist_workers.N)
    flat = clipped_sum_by_hand(grads, 0.05, divisor=dist_workers.N)
    assert not torch.allclose(want["fc.weight"], flat["fc.weight"])
    for name, g in want.items():
        torch.testing.assert_close(ranks[0][kind][name], g, rtol=1e-10, atol=1e-13)
        assert torch.equal(ranks[0][kind][name], ranks[1][kind][name])


def test_user_level_across_ranks(ranks):
    """Whole users on each rank: one process's user-level step on the whole batch. A
    user with records on both ranks: refused on every rank, p.grad unchanged."""
    net = dist_workers.model()
    x, y = dist_workers.data()
    private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=dist_workers.C,
                 noise_multiplier=0.0, expected_batch_size=4,
                 user_ids=dist_workers.USERS["users"])
    for name, g in dist_workers.grads(net).items():
        for seen in ranks:
            err, got = seen["users"]
            assert err == "no error"
            torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-13)
    for seen in ranks:
        err, got = seen["split user"]
        assert "user 2 has records on rank" in err and "give each rank whole users" in err
        assert all(g is None for g in got.values())


def test_secure_noise_is_rank_0s_added_once(ranks):
    z0, z1 = ranks[0]["secure noise"], ranks[1]["secure noise"]  # (30, 620)
    assert torch.equal(z0, z1)
    want = 1.3 * 0.5 / 10
    assert abs(float(z0.std()) / want - 1) < 0.04
    assert not torch.equal(z0[0], z0[1])  # a fresh draw each release
    assert all(seen["secure left torch's generator"] for seen in ranks)


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_banded_noise_is_rank_0s_correlated_draws_added_once(ranks, kind):
    """BandMF (and BLT) with two processes: rank 0's draws (its generator's), correlated
    by its recursion, added once: ``C^-1 Z`` of the independent noise one process
    draws."""
    z0, z1 = ranks[0][f"{kind} noise"], ranks[1][f"{kind} noise"]  # (12, 620)
    assert torch.equal(z0, z1)
    net = nn.Linear(30, 20).double()
    step = PrivateStep(net, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(1))
    independent = []
    for _ in range(12):
        step.release()
        independent.append(torch.cat([net.weight.grad.flatten(), net.bias.grad]))
    mech = BandMF(12, 3) if kind == "banded" else dist_workers.GIVEN_BLT()
    want = mech.noise_matrix @ torch.stack(independent)
    torch.testing.assert_close(z0, want, rtol=1e-10, atol=1e-14)


def test_the_noise_is_added_once(ranks):
    z0, z1 = ranks[0]["noise"], ranks[1]["noise"]  # (100, 620) each
    assert torch.equal(z0, z1)  # identical p.grad on every rank
    want = 1.3 * 0.5 / 10  # sigma C / B'; twice the noise would give sqrt(2) times it
    assert abs(float(z0.std()) / want - 1) < 0.03
    assert abs(float(z0.mean())) < 4 * want / math.sqrt(z0.numel())


def test_mismatched_expected_batch_size_raises_on_every_rank(ranks):
    for r in range(WORLD):
        message, grads = ranks[r]["mismatch"]
        assert message.startswith("ValueError: expected_batch_size differs between ranks")
        assert all(g is None for g in grads.values())  # p.grad unchanged
        assert ranks[r]["mismatch accounted"] == 0  # a failed release is no step


def test_every_rank_accounts_each_release_alike(ranks):
    want = epsilon(1.3, 0.1, 100, 1e-5)
    for r in range(WORLD):
        steps, eps = ranks[r]["accounted"]
        assert steps == 100 and eps == pytest.approx(want, rel=1e-9)


def test_a_non_finite_gradient_on_one_rank_raises_on_every_rank(ranks):
    assert ranks[0]["nan accumulate"] == "no error"
    assert ranks[1]["nan accumulate"] == "no error"  # deferred to release: no hang
    for r in range(WORLD):
        message, grads = ranks[r]["nan"]
        assert message.startswith("FloatingPointError: a per-sample gradient was not finite")
        assert "rank 1" in message
        assert all(g is None for g in grads.values())


def test_ranks_holding_different_models_raise_on_every_rank(ranks):
    for r in range(WORLD):
        message, grads = ranks[r]["models"]
        assert message.startswith("ValueError: the ranks hold different models: parameter "
                                  "'head.weight'")
        assert all(g is None for g in grads.values())


def test_a_rank_that_never_arrives_is_named_instead_of_a_hang(ranks):
    message, grads = ranks[0]["absent"]
    assert message.startswith("RuntimeError: release(): not every process arrived within 3 s")
    assert "Ranks 1 failed to pass" in message and all(g is None for g in grads.values())


def test_the_distributed_poisson_sampler_splits_one_sample():
    n, q, steps = 1000, 0.1, 50
    whole = list(PoissonBatchSampler(n, q, steps, torch.Generator().manual_seed(3)))
    shares = [list(PoissonBatchSampler(n, q, steps, torch.Generator().manual_seed(3),
                                       rank=r, world_size=3)) for r in range(3)]
    sizes = []
    for k, batch in enumerate(whole):
        parts = [set(share[k]) for share in shares]
        assert set().union(*parts) == set(batch)  # the union is one Poisson sample
        assert sum(len(p) for p in parts) == len(batch)  # no sample twice
        sizes.append(len(batch))
    rate = sum(sizes) / (n * steps)
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (n * steps))


def test_the_distributed_sampler_needs_a_generator():
    with pytest.raises(ValueError, match="generator"):
        PoissonBatchSampler(10, 0.5, rank=0, world_size=2)
