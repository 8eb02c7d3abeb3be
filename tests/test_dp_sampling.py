"""Poisson sampling of batches: statistics with a fixed generator, empties, DataLoader;
cyclic Poisson sampling (a record in one step of every cycle)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from persample.dp.sampling import (
    CyclicPoissonSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    poisson_batches,
    poisson_loader,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_batch_sizes_and_inclusion_frequencies():
    n, q, steps = 500, 0.05, 2000
    batches = list(PoissonBatchSampler(n, q, steps, _gen()))
    assert len(batches) == steps
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    # Binomial(500, 0.05): mean 25, std sqrt(23.75) = 4.87; the mean of 2000 has std 0.11
    assert sizes.mean().item() == pytest.approx(n * q, abs=0.6)
    assert sizes.std().item() == pytest.approx(math.sqrt(n * q * (1 - q)), rel=0.1)
    counts = torch.zeros(n)
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)  # distinct, in range
        counts[b] += 1
    freq = counts / steps  # each ~ Binomial(2000, 0.05) / 2000: std 0.0049
    assert freq.mean().item() == pytest.approx(q, abs=0.002)
    assert freq.min().item() > q - 0.025 and freq.max().item() < q + 0.025
    assert freq.std().item() == pytest.approx(math.sqrt(q * (1 - q) / steps), rel=0.15)


def test_batches_are_independent_of_each_other():
    batches = list(PoissonBatchSampler(200, 0.5, 400, _gen(3)))
    masks = torch.zeros(400, 200)
    for k, b in enumerate(batches):
        masks[k, b] = 1
    # consecutive batches share q^2 N = 50 indices on average, not more or fewer
    shared = (masks[1:] * masks[:-1]).sum(1).mean().item()
    assert shared == pytest.approx(50, abs=1.5)


def test_empty_batches_happen():
    batches = list(PoissonBatchSampler(20, 0.02, 500, _gen()))
    empty = sum(len(b) == 0 for b in batches)
    # P(empty) = 0.98 ** 20 = 0.668
    assert empty / 500 == pytest.approx(0.98**20, abs=0.06)


def test_same_seed_same_batches_and_epochs_differ():
    a = PoissonBatchSampler(100, 0.1, 20, _gen(7))
    b = PoissonBatchSampler(100, 0.1, 20, _gen(7))
    first_a, first_b = list(a), list(b)
    assert first_a == first_b
    assert list(a) != first_a  # the generator moves on: the next epoch is new
    assert list(PoissonBatchSampler(100, 0.1, 20, _gen(8))) != first_a


def test_global_seed_drives_the_default_generator():
    torch.manual_seed(5)
    a = list(PoissonBatchSampler(100, 0.1, 10))
    torch.manual_seed(5)
    assert list(PoissonBatchSampler(100, 0.1, 10)) == a


def test_default_steps_per_epoch_and_expected_batch_size():
    sampler = PoissonBatchSampler(1437, 64 / 1437)
    assert len(sampler) == round(1437 / 64) == 22
    assert sampler.expected_batch_size == pytest.approx(64)
    assert len(PoissonBatchSampler(10, 1.0)) == 1
    assert [len(b) for b in PoissonBatchSampler(10, 1.0, 3)] == [10, 10, 10]


def test_works_with_dataloader_including_empty_batches():
    x, y = torch.randn(30, 2, 3), torch.arange(30)
    ds = TensorDataset(x, y)
    sampler = PoissonBatchSampler(30, 0.05, 60, _gen(1))
    expected = list(PoissonBatchSampler(30, 0.05, 60, _gen(1)))
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=EmptySafeCollate(ds))
    got = list(loader)
    assert len(got) == 60
    assert any(len(b) == 0 for b in expected)  # the case that breaks default_collate
    for (xb, yb), idx in zip(got, expected):
        assert xb.shape == (len(idx), 2, 3) and yb.dtype == torch.int64
        assert torch.equal(yb, torch.tensor(idx, dtype=torch.int64))
        assert torch.equal(xb, x[idx])


def test_default_collate_fails_on_empty_so_the_wrapper_matters():
    ds = TensorDataset(torch.randn(5, 2))
    with pytest.raises(IndexError):
        list(DataLoader(ds, batch_sampler=[[]]))
    (empty,) = list(DataLoader(ds, batch_sampler=[[]], collate_fn=EmptySafeCollate(ds)))
    assert empty[0].shape == (0, 2)


def test_poisson_loader_and_its_guards():
    ds = TensorDataset(torch.randn(40, 4), torch.arange(40))
    loader = poisson_loader(ds, 0.1, generator=_gen(2))
    assert len(loader) == 10 and loader.batch_sampler.expected_batch_size == pytest.approx(4)
    sizes = [len(yb) for _, yb in loader]
    assert sizes == [len(b) for b in PoissonBatchSampler(40, 0.1, None, _gen(2))]
    with pytest.raises(ValueError, match="batch_size"):
        poisson_loader(ds, 0.1, batch_size=4)


def test_poisson_batches_of_tensors():
    x, y = torch.randn(80, 3), torch.arange(80)
    got = list(poisson_batches((x, y), 0.02, steps=40, generator=_gen(4)))
    expected = list(PoissonBatchSampler(80, 0.02, 40, _gen(4)))
    assert len(got) == 40 and any(len(b) == 0 for b in expected)
    for (xb, yb), idx in zip(got, expected):
        assert torch.equal(yb, torch.tensor(idx, dtype=torch.int64))
        assert torch.equal(xb, x[idx]) and xb.shape[1:] == (3,)
    (only,) = next(poisson_batches(x, 1.0, generator=_gen()))
    assert torch.equal(only, x)
    (from_ds,) = next(poisson_batches(TensorDataset(x), 1.0, generator=_gen()))
    assert torch.equal(from_ds, x)


@pytest.mark.parametrize("args,match", [
    ((0, 0.1), "num_samples"),
    ((10, 0.0), r"sample_rate \(q\) must be in \(0, 1\]"),
    ((10, 1.5), "sample_rate"),
    ((10, 0.1, 0), "steps_per_epoch"),
])
def test_sampler_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        PoissonBatchSampler(*args)


def test_poisson_batches_rejects_bad_input():
    with pytest.raises(ValueError, match="same number of rows"):
        next(poisson_batches((torch.zeros(3), torch.zeros(4)), 0.5))
    with pytest.raises(ValueError, match="must be a tensor"):
        next(poisson_batches([], 0.5))


def test_empty_batch_of_a_mapping_collator_has_zero_rows():
    """A collator returning a UserDict (as a tokenizer's BatchEncoding is): the empty
    batch is a dict of 0-row tensors, not the one example collated."""
    from collections import UserDict

    examples = [{"input_ids": torch.arange(4) + i, "labels": torch.tensor(i)} for i in range(3)]

    def collate(batch):
        return UserDict({k: torch.stack([b[k] for b in batch]) for k in batch[0]})

    empty = EmptySafeCollate(examples, collate)([])
    assert isinstance(empty, dict)
    assert empty["input_ids"].shape == (0, 4) and empty["labels"].shape == (0,)
    assert EmptySafeCollate(examples, collate)(examples[:2])["input_ids"].shape == (2, 4)


def test_cyclic_poisson_draws_each_step_from_its_group_only():
    """N = 103 records in b = 4 groups of 25-26 (a random split, drawn once): step t
    draws from group t mod 4 alone at rate b * q, so a record takes part in at most one
    of any 4 consecutive steps; the cycle runs on across epochs; each record's
    frequency is q, as with Poisson sampling."""
    n, q, b = 103, 0.075, 4
    sampler = CyclicPoissonSampler(n, q, b, generator=_gen(2))
    groups = [set(g) for g in sampler.groups]
    assert sorted(len(g) for g in groups) == [25, 26, 26, 26]
    assert set().union(*groups) == set(range(n))
    assert sorted(groups[0]) != list(range(len(groups[0])))  # shuffled, not cut in order
    assert len(sampler) == round(1 / q) == 13 and sampler.group_rate == pytest.approx(0.3)
    batches = [bt for _ in range(300) for bt in sampler]  # 300 epochs, the cycle running on
    assert sampler.steps == len(batches) == 3900
    last: dict[int, int] = {}
    for t, bt in enumerate(batches):
        assert bt == sorted(set(bt)) and set(bt) <= groups[t % b]
        for i in bt:
            assert t - last.get(i, -b) >= b  # at least b steps apart
            last[i] = t
    counts = torch.zeros(n)
    for bt in batches:
        counts[bt] += 1
    freq = counts / len(batches)  # each ~ Binomial(975, 0.3) / 3900: std 0.0037
    assert freq.mean().item() == pytest.approx(q, abs=0.002)
    assert freq.min().item() > q - 0.018 and freq.max().item() < q + 0.018
    sizes = torch.tensor([len(bt) for bt in batches], dtype=torch.float64)
    assert sampler.expected_batch_size == pytest.approx(q * n)
    assert sizes.mean().item() == pytest.approx(q * n, abs=0.3)
    assert sampler.participations(12) == 3 and sampler.participations(13) == 4


def test_cyclic_poisson_is_reproduced_by_its_seed_and_shared_by_ranks():
    """The same seed, the same split and batches; two ranks seeded alike get disjoint
    halves of each step's sample; one group is plain Poisson sampling."""
    a, b = (CyclicPoissonSampler(40, 0.15, 3, generator=_gen(5)) for _ in range(2))
    assert a.groups == b.groups and list(a) == list(b)
    whole = list(CyclicPoissonSampler(40, 0.15, 3, generator=_gen(6)))
    ranks = [list(CyclicPoissonSampler(40, 0.15, 3, generator=_gen(6), rank=r, world_size=2))
             for r in range(2)]
    for t, drawn in enumerate(whole):
        assert sorted(ranks[0][t] + ranks[1][t]) == drawn
        assert not set(ranks[0][t]) & set(ranks[1][t])
    one = CyclicPoissonSampler(40, 0.25, 1, generator=_gen(1))
    assert one.groups == [list(range(40))] and len(one) == 4
    assert one.expected_batch_size == PoissonBatchSampler(40, 0.25).expected_batch_size


@pytest.mark.parametrize("args,match", [
    ((10, 0.1, 0), "cycle_length must be an int >= 1"),
    ((10, 0.1, 2.0), "cycle_length must be an int >= 1"),
    ((3, 0.1, 4), "cycle_length 4 needs at least as many records"),
    ((10, 0.3, 4), "need sample_rate <= 1 / cycle_length"),
    ((10, 0.0, 2), "sample_rate"),
])
def test_cyclic_sampler_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        CyclicPoissonSampler(*args)
