"""``persample.dp.setup``: each rank's share of a logical batch, its cut into physical
batches, the seeds every rank shares; and ``make_private`` over two gloo processes
against one process."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import setup_workers as workers
from persample.dp import (
    CyclicPoissonSampler,
    PoissonBatchSampler,
    PrivacyEngine,
    UserPoissonSampler,
)
from persample.dp.setup import (
    PhysicalBatches,
    Seeds,
    even_parts,
    physical_batches,
    share,
    shared_seeds,
)
from spawned import ranks_of


@st.composite
def logical_batches(draw, users: bool = True):
    """``(drawn, user_of)``: a logical batch of up to 12 users of 1 to 6 records (each
    user's records consecutive, the users in a random order, ids not 0..U-1), or of
    records alone (``user_of`` ``None``)."""
    sizes = draw(st.lists(st.integers(1, 6 if users else 1), max_size=12))
    ids = draw(st.permutations(range(len(sizes))))
    user_of = torch.tensor([5 * u + 3 for u, n in zip(ids, sizes) for _ in range(n)],
                           dtype=torch.int64)  # (N,) records of a user consecutive
    order = draw(st.permutations(range(len(sizes))))  # the users in the drawn order
    starts = [sum(sizes[:u]) for u in range(len(sizes))]
    drawn = [starts[u] + k for u in order for k in range(sizes[u])]
    return drawn, (user_of if users else None)


def _runs(drawn, user_of):
    """The batch's users (or records), each its records, by a scan of ``drawn``."""
    runs = []
    for i in drawn:
        if runs and user_of is not None and user_of[i] == user_of[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _user_of_batch(batch, user_of):
    return {int(user_of[i]) for i in batch} if user_of is not None else set(batch)


@settings(max_examples=150, deadline=None)
@given(batch=st.one_of(logical_batches(), logical_batches(users=False)),
       world_size=st.integers(1, 4))
def test_the_shares_of_all_ranks_partition_the_logical_batch(batch, world_size):
    """Every record in exactly one rank's share, in the drawn order; the k-th user (or
    record) of the batch on rank k mod world_size, with all its records."""
    drawn, user_of = batch
    shares = [share(drawn, r, world_size, user_of) for r in range(world_size)]
    assert Counter(i for s in shares for i in s) == Counter(drawn)
    for s in shares:
        assert s == [i for i in drawn if i in set(s)]  # drawn's order
    runs = _runs(drawn, user_of)
    for r, s in enumerate(shares):
        assert s == [i for run in runs[r::world_size] for i in run]
    owners = [_user_of_batch(s, user_of) for s in shares]
    assert sum(len(o) for o in owners) == len(set().union(*owners))  # no user on two ranks


@settings(max_examples=150, deadline=None)
@given(batch=st.one_of(logical_batches(), logical_batches(users=False)),
       world_size=st.integers(1, 4), size=st.integers(1, 8))
def test_physical_batches_of_at_most_size_keep_users_whole(batch, world_size, size):
    drawn, user_of = batch
    cuts = [physical_batches(drawn, size, user_of=user_of, rank=r, world_size=world_size)
            for r in range(world_size)]
    assert len({len(c) for c in cuts}) == 1  # as many on every rank
    for r, cut in enumerate(cuts):
        assert [i for b in cut for i in b] == share(drawn, r, world_size, user_of)
        filled = [b for b in cut if b]
        assert cut == filled + [[]] * (len(cut) - len(filled))  # empty ones at the end
        runs = _runs([i for b in filled for i in b], user_of)
        for b in filled:  # at most size, unless one user with more records alone
            assert len(b) <= size or len(_runs(b, user_of)) == 1
        for b, after in zip(filled, filled[1:]):  # the fewest: the next user did not fit
            assert len(b) + len(_runs(after, user_of)[0]) > size
        assert sum(len(_runs(b, user_of)) for b in filled) == len(runs)  # no user split
    everywhere = [_user_of_batch(b, user_of) for c in cuts for b in c]
    assert sum(len(u) for u in everywhere) == len(set().union(*everywhere))
    if world_size == 1:
        assert all(cuts[0]) and (len(cuts[0]) == 0) == (len(drawn) == 0)
    if user_of is None:  # records: the fewest that hold the largest share
        assert len(cuts[0]) == -(-len(share(drawn, 0, world_size)) // size)


@settings(max_examples=150, deadline=None)
@given(batch=st.one_of(logical_batches(), logical_batches(users=False)),
       world_size=st.integers(1, 4), parts=st.integers(1, 5))
def test_physical_batches_into_parts_keep_users_whole(batch, world_size, parts):
    drawn, user_of = batch
    for r in range(world_size):
        mine = share(drawn, r, world_size, user_of)
        cut = physical_batches(drawn, parts=parts, user_of=user_of, rank=r,
                               world_size=world_size)
        assert len(cut) == parts and [i for b in cut for i in b] == mine
        assert sum(len(_runs(b, user_of)) for b in cut) == len(_runs(mine, user_of))
        if user_of is None:  # records: cut at floor(k b / parts)
            n = len(mine)
            assert cut == [mine[k * n // parts:(k + 1) * n // parts] for k in range(parts)]
        else:  # each user in the part that holds its middle record
            for k, b in enumerate(cut):
                for run in _runs(b, user_of):
                    middle = mine.index(run[0]) + (len(run) + 1) / 2  # 1-based
                    assert k * len(mine) / parts < middle <= (k + 1) * len(mine) / parts


@settings(max_examples=100, deadline=None)
@given(batch=logical_batches(users=False), world_size=st.integers(1, 4),
       size=st.integers(1, 8))
def test_even_parts_hold_every_ranks_share(batch, world_size, size):
    """Opacus's count (BatchMemoryManager, dp-finetune's windows): as many on every rank,
    at least one, each of at most size records, sizes differing by at most one."""
    drawn, _ = batch
    parts = even_parts(len(drawn), size, world_size)
    assert parts == max(1, -(-len(drawn) // (size * world_size)))
    for r in range(world_size):
        cut = physical_batches(drawn, parts=parts, rank=r, world_size=world_size)
        sizes = [len(b) for b in cut]
        assert len(cut) == parts and max(sizes) <= size and max(sizes) - min(sizes) <= 1


def test_a_user_with_more_records_than_a_physical_batch_gets_one_of_its_own():
    """The decision for a user larger than ``size``: alone, in one batch larger than
    ``size`` (make_private and dp-finetune refuse such a size beforehand)."""
    user_of = torch.tensor([0, 1, 1, 1, 1, 1, 2, 3])
    assert physical_batches([0, 1, 2, 3, 4, 5, 6, 7], 3, user_of=user_of) == [
        [0], [1, 2, 3, 4, 5], [6, 7]]
    drawn = [6, 1, 2, 3, 4, 5, 0, 7]
    assert [physical_batches(drawn, 3, user_of=user_of, rank=r, world_size=2)
            for r in (0, 1)] == [[[6, 0], []], [[1, 2, 3, 4, 5], [7]]]


def test_the_examples_of_each_cut():
    users = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    assert share([0, 1, 2, 3, 4, 5, 6], 1, 2, users) == [2, 6]
    assert physical_batches(list(range(7)), 4, user_of=users) == [[0, 1, 2], [3, 4, 5, 6]]
    assert physical_batches(list(range(7)), parts=2, user_of=users) == [[0, 1, 2],
                                                                        [3, 4, 5, 6]]
    assert physical_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert physical_batches(list(range(7)), parts=3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert physical_batches([], 3) == [] and physical_batches([], parts=2) == [[], []]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: physical_batches([0, 1], 2, parts=1), "pass size .* or parts"),
    (lambda: physical_batches([0, 1]), "pass size .* or parts"),
    (lambda: physical_batches([0, 1], 0), "size must be an int >= 1, got 0"),
    (lambda: physical_batches([0, 1], parts=True), "parts must be an int >= 1, got True"),
    (lambda: share([0, 1], 2, 2), "need 0 <= rank < world_size, got rank 2"),
    (lambda: share([0, 1], 0, 0), "need 0 <= rank < world_size"),
    (lambda: share([0, 1, 2], 0, 2, torch.tensor([4, 5, 4])),
     "a user's records must be consecutive"),
    (lambda: even_parts(4, 0), "size must be an int >= 1"),
    (lambda: even_parts(4, 2, world_size=0), "world_size must be an int >= 1"),
    (lambda: shared_seeds(1.5), "seed must be an int"),
    (lambda: shared_seeds(1 << 64), "seed must be an int"),
    (lambda: PhysicalBatches(PoissonBatchSampler(10, 0.5, 2, torch.Generator(), 0, 2), 4),
     "takes the sampler of the whole logical batches"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_seeds_of_an_int_a_generator_or_torchs():
    assert shared_seeds(7) == Seeds(7, 8)
    g = torch.Generator().manual_seed(3)
    seeds = shared_seeds(g)
    twin = torch.Generator().manual_seed(3)
    assert seeds.sampling == int(torch.randint(1 << 62, (1,), generator=twin))
    assert seeds.noise == seeds.sampling + 1
    assert torch.equal(g.get_state(), twin.get_state())  # one draw taken from it
    torch.manual_seed(5)
    a = shared_seeds()
    torch.manual_seed(5)
    assert shared_seeds() == a != shared_seeds()  # torch's generator, advanced
    assert torch.equal(torch.rand(3, generator=a.sampling_generator()),
                       torch.rand(3, generator=torch.Generator().manual_seed(a.sampling)))
    assert torch.equal(torch.rand(3, generator=a.noise_generator()),
                       torch.rand(3, generator=torch.Generator().manual_seed(a.noise)))


def test_the_batch_sampler_plans_and_cuts():
    users = torch.arange(40) // 3  # 14 users of 3 (the last of 1)
    logical = UserPoissonSampler(users, 0.5, 4, torch.Generator().manual_seed(2))
    by_size = PhysicalBatches(logical, 5, rank=1, world_size=2)
    counts = by_size.plan()
    again = torch.Generator().manual_seed(2)
    drawn = list(UserPoissonSampler(users, 0.5, 4, again))
    want = [physical_batches(d, 5, user_of=users, rank=1, world_size=2) for d in drawn]
    assert counts == [len(w) for w in want] and list(by_size) == [b for w in want for b in w]
    into = PhysicalBatches(PoissonBatchSampler(30, 0.4, 3, torch.Generator()), parts=2)
    assert len(into) == 6 and len(list(into)) == 6


def test_the_batch_sampler_cuts_cyclic_samples_into_every_ranks_share():
    """Cyclic Poisson sampling through the same cut: each rank's physical batches of
    step t come from group t mod b, and the ranks' together are the step's sample."""
    def logical():
        return CyclicPoissonSampler(50, 0.2, 3, generator=torch.Generator().manual_seed(4))

    drawn = list(logical())
    ranks = [PhysicalBatches(logical(), 4, rank=r, world_size=2) for r in range(2)]
    counts = [r.plan() for r in ranks]
    assert counts[0] == counts[1] and len(counts[0]) == len(drawn) == 5
    parts = [iter(list(r)) for r in ranks]
    groups = logical().groups
    for t, (whole, k) in enumerate(zip(drawn, counts[0])):
        mine = [[i for _ in range(k) for i in next(p)] for p in parts]
        assert sorted(mine[0] + mine[1]) == whole and set(whole) <= set(groups[t % 3])


def test_privacy_engine_refuses_user_level_dp_by_name():
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    for option in (dict(user_ids=torch.arange(20) // 2), dict(records_per_user=2)):
        with pytest.raises(ValueError, match=r"does not take user-level DP \(user_ids=, "
                                             r"records_per_user=\).*make_private"):
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(data, batch_size=5), noise_multiplier=1.0,
                max_grad_norm=1.0, **option)


# ---------------------------------------------------------------------------
# two gloo processes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of two gloo processes saw (spawned once for the tests below)."""
    return ranks_of(workers.worker, tmp_path_factory.mktemp("setup"), 2, timeout=240,
                    what="make_private workers")


@pytest.mark.slow  # several processes
def test_every_rank_gets_rank_0s_seeds(ranks):
    """Each rank's torch generator seeded apart: every rank gets rank 0's draw; given
    each its own int, rank 0's."""
    own = [r["seeds"]["own"] for r in ranks]
    assert own[0] != own[1]
    for r in ranks:
        assert r["seeds"]["drawn"] == Seeds(own[0], own[0] + 1)
        assert r["seeds"]["given"] == Seeds(0, 1)


@pytest.mark.slow
def test_make_private_refuses_secure_mode_with_several_processes(ranks):
    for r in ranks:
        assert "does not take secure_mode with several processes" in r["secure"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "how", "users"), workers.SCENARIOS)
def test_make_private_over_two_processes_is_one_process(ranks, name, how, users):
    """make_private in two processes (the model plain, in DDP or sharded with FSDP2;
    record- or user-level), sigma 0: the ranks' physical batches of each logical batch
    are disjoint, as many on each rank, of at most SIZE records, a user on one rank in
    one of them, and together the one process's logical batch; every rank ends with
    the weights of one process on the same logical batches (float64, to rounding)."""
    one = workers.train("plain", users)
    two = [r[name] for r in ranks]
    assert two[0]["sharded"] == two[1]["sharded"] == (how == "fsdp")
    steps = 4 if users else 5  # round(1 / q): q = 5 / 20 users, or 12 / 60 records
    assert len(two[0]["seen"]) == len(two[1]["seen"]) == len(one["seen"]) == steps
    split = False
    for k, logical in enumerate(one["seen"]):
        mine = [r["seen"][k] for r in two]  # each rank's physical batches
        assert len(mine[0]) == len(mine[1])
        split |= len(mine[0]) > 1
        records = [i for parts in mine for b in parts for i in b]
        assert sorted(records) == sorted(i for b in logical for i in b)
        assert len(records) == len(set(records))  # disjoint
        assert all(len(b) <= workers.SIZE for parts in mine for b in parts)
        if users:
            owners = [{int(workers.USERS[i]) for i in b} for parts in mine for b in parts]
            assert sum(len(o) for o in owners) == len(set().union(*owners))
    assert split  # the shares were cut
    if not users:  # a physical batch of one record (captured at n = 1 under FSDP2)
        assert any(len(b) == 1 for r in two for parts in r["seen"] for b in parts)
    for p, q, r in zip(two[0]["weights"], two[1]["weights"], one["weights"]):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)
    assert any(not torch.equal(p, q) for p, q in zip(one["weights"],
                                                     workers.net().parameters()))
