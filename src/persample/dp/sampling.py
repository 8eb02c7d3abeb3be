"""Poisson sampling of batches, the sampling DP-SGD's privacy guarantee assumes.

Each step includes every example independently with probability ``q`` (the
sample rate), so the batch size is random: ``Binomial(N, q)``, mean ``q * N``,
and a batch may be empty. The privacy analysis (Abadi et al. 2016; Mironov,
Talwar & Zhang 2019; :mod:`persample.dp.accounting`) is for this sampling, not
for shuffling and cutting into fixed-size batches.

Two consequences for the training step:

- divide the clipped, noised sum by the *expected* batch size ``q * N``, not by
  the batch's own size (which depends on the data): pass
  ``expected_batch_size=round(q * N)`` to ``persample.dp.private_grad``;
- an empty batch is still a step: it contributes noise only, and the accountant
  counts it like any other.

Randomness comes from the ``torch.Generator`` you pass, so a seed reproduces the
batches exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    TensorDataset,
    default_collate,
)

from .noise import SecureSource, secure_uniform
from .setup import check_world, share


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches of indices, each index included independently with probability ``q``.

    A ``batch_sampler`` for ``torch.utils.data.DataLoader``: each iteration
    yields ``steps_per_epoch`` lists of indices in increasing order, each of
    random length ``Binomial(num_samples, q)``, possibly empty. The default
    ``collate_fn`` cannot collate an empty batch; pass
    ``collate_fn=EmptySafeCollate(dataset)`` (or use :func:`poisson_loader`).

    Args:
        num_samples: ``N``, the size of the dataset, ``>= 1``.
        sample_rate: ``q`` in ``(0, 1]``; the expected batch size is ``q * N``.
        steps_per_epoch: batches per iteration, ``>= 1``; default ``round(1 / q)``,
            so that an epoch sees ``N`` examples in expectation.
        generator: the ``torch.Generator`` (CPU) that draws the batches; default a
            fresh one seeded from torch's global RNG, so results follow
            ``torch.manual_seed``; or a :class:`~persample.dp.noise.SecureSource`: the
            operating system's secure generator (one process only).
        rank, world_size: for several processes: every rank draws the same Poisson
            sample of the whole dataset (so every rank needs a generator seeded
            alike) and keeps the indices at positions ``rank, rank + world_size, ...``
            of it (:func:`persample.dp.setup.share`): the ranks' batches are disjoint
            and their union is one Poisson sample, so the privacy analysis is the
            single-process one. Default: the whole sample (one process).

    Raises:
        ValueError: an argument outside its range.

    Examples:
        >>> import torch
        >>> sampler = PoissonBatchSampler(10, 0.3, generator=torch.Generator().manual_seed(0))
        >>> len(sampler), [len(b) <= 10 for b in sampler]
        (3, [True, True, True])
        >>> data = torch.arange(10.0)
        >>> loader = torch.utils.data.DataLoader(
        ...     data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))
        >>> all(batch.dim() == 1 for batch in loader)
        True
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        _check_rate(sample_rate)
        check_world(rank, world_size)
        if world_size > 1 and (generator is None or isinstance(generator, SecureSource)):
            raise ValueError("with world_size > 1 pass a generator seeded alike on every "
                             "rank: the ranks must draw the same Poisson sample to split it")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1 / sample_rate))
        if (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be an int >= 1 or None, got "
                             f"{steps_per_epoch!r}")
        self.num_samples = num_samples
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = steps_per_epoch
        self.generator = generator
        self.rank, self.world_size = rank, world_size

    @property
    def expected_batch_size(self) -> float:
        """``q * N``: what to divide the noised sum by (``private_grad``'s argument)."""
        return self.sample_rate * self.num_samples

    user_of: Tensor | None = None  # (N,) each record's user, for samplers of users

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for drawn in self.draws():
            yield share(drawn, self.rank, self.world_size, self.user_of)

    def draws(self) -> Iterator[list[int]]:
        """One epoch's whole samples (every rank's share together), as drawn."""
        gen = self._generator()
        for _ in range(self.steps_per_epoch):
            yield poisson_mask(self.num_samples, self.sample_rate, gen).nonzero()[:, 0].tolist()

    def whole(self) -> WholeSamples:
        """This sampler as one process draws it (its :meth:`draws`): the same generator
        and state, so that iterating either advances both."""
        return WholeSamples(self)

    def _generator(self) -> torch.Generator | SecureSource:
        """The epoch's generator: the one given, or one seeded from torch's global RNG
        (like torch's ``RandomSampler``)."""
        if self.generator is not None:
            return self.generator
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return torch.Generator().manual_seed(seed)


class UserPoissonSampler(PoissonBatchSampler):
    """Logical batches of users (user-level DP): each user included independently with
    probability ``q``, and with it its records (at most ``records_per_user`` of them,
    drawn at random without replacement each step), a user's records together.

    The unit of privacy is the user: the step clips each user's gradient, the sum of
    its records', once (``user_ids=`` of :meth:`PrivateStep.accumulate`), and the
    accountant's sample rate is ``q`` over the users. Records whose user the sampler
    did not draw are not in the step; capping a user's records bounds the work per
    step, not the privacy (a user's whole contribution is clipped either way).

    Args:
        user_ids: ``(N,)`` integers, each record's user (any ids).
        sample_rate: ``q`` in ``(0, 1]`` over the users.
        steps_per_epoch: batches per iteration; default ``round(1 / q)``.
        generator: as for :class:`PoissonBatchSampler` (the same on every rank).
        records_per_user: at most this many records of a user per step, ``>= 1``;
            default all of them.
        rank, world_size: several processes: each rank keeps the users at positions
            ``rank, rank + world_size, ...`` of the sample, whole
            (:func:`persample.dp.setup.share`).

    Raises:
        ValueError: ``user_ids`` not a 1-d integer sequence, or an argument outside its
            range.

    Examples:
        >>> users = torch.tensor([7, 7, 3, 9, 9, 9, 3, 1])
        >>> sampler = UserPoissonSampler(users, 0.5, 4, torch.Generator().manual_seed(0),
        ...                              records_per_user=2)
        >>> sampler.num_users, sampler.expected_batch_size
        (4, 2.0)
        >>> all(len(users[b].unique()) * 2 >= len(b) for b in sampler)  # at most 2 each
        True
    """

    def __init__(self, user_ids: Any, sample_rate: float, steps_per_epoch: int | None = None,
                 generator: torch.Generator | SecureSource | None = None,
                 records_per_user: int | None = None, rank: int = 0, world_size: int = 1):
        users = torch.as_tensor(user_ids)
        if users.dim() != 1 or users.numel() == 0 or users.is_floating_point() \
                or users.dtype == torch.bool:
            raise ValueError("user_ids must be a non-empty 1-d sequence of integers, each "
                             f"record's user, got {tuple(users.shape)} {users.dtype}")
        if records_per_user is not None and (isinstance(records_per_user, bool) or not
                                             isinstance(records_per_user, int)
                                             or records_per_user < 1):
            raise ValueError(f"records_per_user must be an int >= 1 or None, got "
                             f"{records_per_user!r}")
        ids, inverse = torch.unique(users, return_inverse=True)
        super().__init__(len(ids), sample_rate, steps_per_epoch, generator, rank, world_size)
        self.user_of = users  # (N,) each record's user id
        order = torch.argsort(inverse, stable=True)
        self.records = order.split(torch.bincount(inverse).tolist())  # each user's records
        self.records_per_user = records_per_user

    @property
    def num_users(self) -> int:
        """The number of distinct users."""
        return self.num_samples

    @property
    def most_records(self) -> int:
        """The most records one user brings to a step."""
        most = max(len(r) for r in self.records)
        return most if self.records_per_user is None else min(most, self.records_per_user)

    def draws(self) -> Iterator[list[int]]:
        gen = self._generator()
        for _ in range(self.steps_per_epoch):
            picked = poisson_mask(self.num_users, self.sample_rate, gen).nonzero()[:, 0]
            yield self._records_of(picked.tolist(), gen)

    def _records_of(self, users: list[int], gen: torch.Generator | SecureSource) -> list[int]:
        """The records of the drawn ``users`` (positions among the distinct ids), each
        user's consecutive, at most ``records_per_user`` of them drawn at random."""
        k, drawn = self.records_per_user, []
        for u in users:  # every rank draws every user's records alike
            records = self.records[u]
            if k is not None and len(records) > k:
                records = records[_choice(len(records), k, gen)].sort().values
            drawn += records.tolist()
        return drawn


class CyclicPoissonSampler(PoissonBatchSampler):
    """Cyclic Poisson sampling: the records split once, at random, into ``cycle_length``
    groups of near-equal size; step ``t`` draws a Poisson sample of group
    ``t mod cycle_length`` only, at rate ``cycle_length * q``, so that a record takes part
    in at most one step of every ``cycle_length`` consecutive ones.

    The sampling the matrix-factorization mechanisms' amplified accounting assumes
    (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", its
    b-min-separated participation with ``b = cycle_length``; JAX-Privacy's cyclic Poisson
    sampling). ``q`` means what it means for :class:`PoissonBatchSampler`: the expected
    batch size is ``q * N`` and an epoch is ``round(1 / q)`` steps, so a run switches
    sampling without changing either. With independent noise each step, a record's
    privacy loss composes over the ``ceil(T / b)`` steps of its own group
    (:meth:`participations`), each sampling it at rate ``b * q``. The step counter runs
    on across epochs (epoch 2 carries on the cycle where epoch 1 left it); the split is
    drawn once, when the sampler is made, from ``generator``.

    Args:
        num_samples: ``N``, ``>= cycle_length``.
        sample_rate: ``q`` in ``(0, 1 / cycle_length]``: ``b * q = 1`` takes the whole
            group each time (shuffled once, then cycled: DP-FTRL's fixed batches,
            Kairouz et al. 2021).
        cycle_length: ``b >= 1``, the number of groups; ``1`` is Poisson sampling.
        steps_per_epoch: batches per iteration; default ``round(1 / q)``, an epoch
            seeing each record once in expectation.
        generator, rank, world_size: as for :class:`PoissonBatchSampler` (the same
            generator on every rank: the split and the draws must agree).

    Raises:
        ValueError: an argument outside its range, ``b * q > 1``, or fewer records than
            groups.

    Examples:
        >>> sampler = CyclicPoissonSampler(12, 1 / 6, 3,
        ...                                generator=torch.Generator().manual_seed(0))
        >>> len(sampler), sampler.expected_batch_size, sampler.group_rate
        (6, 2.0, 0.5)
        >>> sorted(i for g in sampler.groups for i in g) == list(range(12))  # a partition
        True
        >>> all(set(b) <= set(sampler.groups[t % 3]) for t, b in enumerate(sampler))
        True
        >>> sampler.participations(len(sampler))  # each record: at most 2 of the 6 steps
        2
    """

    def __init__(self, num_samples: int, sample_rate: float, cycle_length: int,
                 steps_per_epoch: int | None = None,
                 generator: torch.Generator | SecureSource | None = None,
                 rank: int = 0, world_size: int = 1):
        if (isinstance(cycle_length, bool) or not isinstance(cycle_length, int)
                or cycle_length < 1):
            raise ValueError(f"cycle_length must be an int >= 1, got {cycle_length!r}")
        super().__init__(num_samples, sample_rate, steps_per_epoch, generator, rank,
                         world_size)
        _split(self, cycle_length)

    def participations(self, steps: int) -> int:
        """The most steps of the first ``steps`` that one record can take part in:
        ``ceil(steps / b)`` (the accountant's number of compositions)."""
        return -(-steps // self.cycle_length)

    def draws(self) -> Iterator[list[int]]:
        gen = self._generator()
        for _ in range(self.steps_per_epoch):
            yield _next_group_sample(self, gen)


class CyclicUserPoissonSampler(UserPoissonSampler):
    """Cyclic Poisson sampling of users (user-level DP with a correlated mechanism): the
    users split once, at random, into ``cycle_length`` groups; step ``t`` draws a
    Poisson sample of group ``t mod cycle_length`` at rate ``cycle_length * q``, each
    drawn user bringing its records (at most ``records_per_user``), as
    :class:`UserPoissonSampler` does; a user takes part in at most one step of every
    ``cycle_length`` (Choquette-Choo et al. 2023's b-min-separated participation, the
    user as the unit).

    Args:
        user_ids, sample_rate, generator: as for :class:`UserPoissonSampler` (``q``
            over the users).
        steps_per_epoch, records_per_user, rank, world_size: likewise.
        cycle_length: ``b >= 1``, the number of groups of users, at most the users.

    Raises:
        ValueError: as :class:`UserPoissonSampler` and :class:`CyclicPoissonSampler`.

    Examples:
        >>> users = torch.arange(24) // 3  # 8 users (ids 0..7) of 3 records each
        >>> sampler = CyclicUserPoissonSampler(users, 0.25, 2,
        ...                                    generator=torch.Generator().manual_seed(0))
        >>> all(set(users[b].tolist()) <= set(sampler.groups[t % 2])
        ...     for t, b in enumerate(sampler))  # (groups: positions among the sorted ids)
        True
        >>> all(len(b) % 3 == 0 for b in sampler)  # whole users
        True
    """

    def __init__(self, user_ids: Any, sample_rate: float, cycle_length: int,
                 steps_per_epoch: int | None = None,
                 generator: torch.Generator | SecureSource | None = None,
                 records_per_user: int | None = None, rank: int = 0, world_size: int = 1):
        if (isinstance(cycle_length, bool) or not isinstance(cycle_length, int)
                or cycle_length < 1):
            raise ValueError(f"cycle_length must be an int >= 1, got {cycle_length!r}")
        super().__init__(user_ids, sample_rate, steps_per_epoch, generator, records_per_user,
                         rank, world_size)
        _split(self, cycle_length)

    participations = CyclicPoissonSampler.participations

    def draws(self) -> Iterator[list[int]]:
        gen = self._generator()
        for _ in range(self.steps_per_epoch):
            yield self._records_of(_next_group_sample(self, gen), gen)


def logical_sampler(num_samples: int, sample_rate: float, steps_per_epoch: int | None,
                    generator: torch.Generator | SecureSource | None, *,
                    user_of: Tensor | None = None, records_per_user: int | None = None,
                    cycle_length: int | None = None) -> PoissonBatchSampler:
    """The sampler of a run's logical batches, as every front door picks it: Poisson
    sampling of the ``num_samples`` records, or with ``user_of`` ``(N,)`` of the users
    (whole, at most ``records_per_user`` records each); with ``cycle_length`` (a
    mechanism's bands) cyclic Poisson sampling of either.

    Raises:
        ValueError: as the sampler picked raises it.

    Examples:
        >>> gen = torch.Generator().manual_seed(0)
        >>> type(logical_sampler(12, 0.25, None, gen, cycle_length=2)).__name__
        'CyclicPoissonSampler'
        >>> type(logical_sampler(12, 0.25, None, gen, user_of=torch.arange(12) // 3)).__name__
        'UserPoissonSampler'

    Source: Abadi et al. 2016 (Poisson lots); McMahan et al. 2018 (users);
    Choquette-Choo et al. 2023 (cyclic Poisson sampling).
    """
    if user_of is None:
        if cycle_length is None:
            return PoissonBatchSampler(num_samples, sample_rate, steps_per_epoch, generator)
        return CyclicPoissonSampler(num_samples, sample_rate, cycle_length, steps_per_epoch,
                                    generator)
    if cycle_length is None:
        return UserPoissonSampler(user_of, sample_rate, steps_per_epoch, generator,
                                  records_per_user)
    return CyclicUserPoissonSampler(user_of, sample_rate, cycle_length, steps_per_epoch,
                                    generator, records_per_user)


def _split(sampler: PoissonBatchSampler, cycle_length: int) -> None:
    """Set up a cyclic sampler: its ``num_samples`` units (records or users) split at
    random into ``cycle_length`` groups, each sampled at rate ``b * q``.

    Raises:
        ValueError: ``b * q > 1``, or fewer units than groups.
    """
    n, q = sampler.num_samples, sampler.sample_rate
    if cycle_length * q > 1 + 1e-12:
        raise ValueError(f"sample_rate {q} with cycle_length {cycle_length} samples each "
                         f"group at rate {cycle_length * q:g} > 1: need sample_rate <= 1 / "
                         f"cycle_length")
    if n < cycle_length:
        raise ValueError(f"cycle_length {cycle_length} needs at least as many records (or "
                         f"users), got {n}")
    sampler.cycle_length = cycle_length
    sampler.group_rate = min(1.0, cycle_length * q)  # b * q
    order = _choice(n, n, sampler._generator())  # (n,) the split
    sampler.groups = [g.sort().values.tolist() for g in order.tensor_split(cycle_length)]
    sampler.steps = 0  # steps drawn so far, across epochs: the next one's group


def _next_group_sample(sampler: Any, gen: torch.Generator | SecureSource) -> list[int]:
    """The next step's Poisson sample of its group's units (the cycle advanced)."""
    group = sampler.groups[sampler.steps % sampler.cycle_length]
    sampler.steps += 1
    picked = poisson_mask(len(group), sampler.group_rate, gen).nonzero()[:, 0]
    return [group[i] for i in picked.tolist()]


class WholeSamples(Sampler[list[int]]):
    """A sampler's whole samples (:meth:`PoissonBatchSampler.draws`), as one process
    draws them: ``world_size`` 1, the sampler's other attributes its own.

    Examples:
        >>> sampler = PoissonBatchSampler(10, 0.5, 2, torch.Generator().manual_seed(0),
        ...                               rank=1, world_size=2)
        >>> whole = sampler.whole()
        >>> whole.world_size, len(whole), whole.expected_batch_size
        (1, 2, 5.0)
    """

    world_size, rank = 1, 0

    def __init__(self, sampler: PoissonBatchSampler):
        self.sampler = sampler

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # (not yet set: a copy being made)
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.draws()


def _choice(n: int, k: int, generator: torch.Generator | SecureSource) -> Tensor:
    """``k`` of ``range(n)`` drawn without replacement."""
    if isinstance(generator, SecureSource):
        return secure_uniform(n).argsort()[:k]
    return torch.randperm(n, generator=generator)[:k]


def poisson_mask(num_samples: int, sample_rate: float,
                 generator: torch.Generator | SecureSource) -> Tensor:
    """One Poisson draw: ``(num_samples,)`` bool, each entry ``True`` with probability ``q``
    (``generator`` a :class:`~persample.dp.noise.SecureSource`: from the operating
    system's secure generator).

    Returns:
        ``(num_samples,)`` bool tensor on the CPU. Raises nothing itself; the
        callers check ``sample_rate``.

    Examples:
        >>> m = poisson_mask(1000, 0.1, torch.Generator().manual_seed(0))
        >>> m.shape, 50 < int(m.sum()) < 150
        (torch.Size([1000]), True)
    """
    if isinstance(generator, SecureSource):
        return secure_uniform(num_samples) <= sample_rate  # (N,): u in (0, 1]
    return torch.rand(num_samples, generator=generator) < sample_rate  # (N,)


def poisson_batches(
    data: Tensor | Sequence[Tensor] | TensorDataset,
    sample_rate: float,
    steps: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[Tensor, ...]]:
    """Poisson-sampled batches of in-memory tensors, without a DataLoader.

    Args:
        data: a tensor ``(N, ...)``, a sequence of tensors all with ``N`` rows, or a
            ``TensorDataset``.
        sample_rate: ``q`` in ``(0, 1]``.
        steps: how many batches; default ``round(1 / q)`` (one epoch in expectation).
        generator: ``torch.Generator`` for the draws (see :class:`PoissonBatchSampler`).

    Yields:
        a tuple with one tensor per input, ``(n, ...)`` rows of each, the same rows
        for all, ``n ~ Binomial(N, q)``; ``n`` may be 0 (empty tensors of the right
        trailing shape and dtype). Rows are on the inputs' device.

    Raises:
        ValueError: tensors of different lengths, no tensors, or a bad argument.

    Examples:
        >>> x, y = torch.randn(100, 3), torch.arange(100)
        >>> batches = list(poisson_batches((x, y), 0.1, generator=torch.Generator().manual_seed(0)))
        >>> len(batches), batches[0][0].shape[1:], all(len(a) == len(b) for a, b in batches)
        (10, torch.Size([3]), True)
    """
    tensors = _as_tensors(data)
    n = tensors[0].shape[0]
    sampler = PoissonBatchSampler(n, sample_rate, steps, generator)
    for indices in sampler:
        index = torch.tensor(indices, dtype=torch.int64, device=tensors[0].device)  # (n,)
        yield tuple(t[index] for t in tensors)


def poisson_loader(
    dataset: Dataset,
    sample_rate: float,
    steps_per_epoch: int | None = None,
    generator: torch.Generator | None = None,
    **loader_kwargs: Any,
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over ``dataset`` with Poisson-sampled batches (empty ones included).

    Args:
        dataset: a map-style dataset with ``len()``.
        sample_rate: ``q`` in ``(0, 1]``.
        steps_per_epoch: batches per epoch; default ``round(1 / q)``.
        generator: ``torch.Generator`` for the draws.
        **loader_kwargs: more ``DataLoader`` arguments (``num_workers``, ``pin_memory``);
            not ``batch_size``, ``shuffle``, ``sampler`` or ``drop_last``, which the
            sampler replaces. A ``collate_fn`` given here is used for non-empty batches.

    Returns:
        the ``DataLoader``; its ``batch_sampler.expected_batch_size`` is ``q * N``.

    Raises:
        ValueError: an empty dataset, or an argument the sampler replaces.

    Examples:
        >>> ds = TensorDataset(torch.randn(50, 2), torch.arange(50))
        >>> loader = poisson_loader(ds, 0.02, generator=torch.Generator().manual_seed(1))
        >>> [tuple(x.shape) for x, _ in loader][:3]
        [(1, 2), (1, 2), (0, 2)]
    """
    clash = {"batch_size", "shuffle", "sampler", "drop_last", "batch_sampler"} & set(loader_kwargs)
    if clash:
        raise ValueError(f"poisson_loader sets the batches itself; drop {sorted(clash)}")
    collate = loader_kwargs.pop("collate_fn", None)
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps_per_epoch, generator)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset, collate),
        **loader_kwargs)


class EmptySafeCollate:
    """A ``collate_fn`` that turns an empty batch into empty tensors of the right shape.

    Non-empty batches go to ``collate_fn`` (default ``default_collate``). An empty
    one collates ``dataset[0]`` and keeps 0 rows of every tensor in the result (a
    mapping such as a tokenizer's ``BatchEncoding`` comes back as a ``dict``), so the
    model sees ``(0, *sample_shape)`` with the right dtype.

    Args:
        dataset: the dataset being loaded (indexed once, at the first empty batch).
        collate_fn: the collate function for non-empty batches.

    Examples:
        >>> data = TensorDataset(torch.randn(5, 3), torch.arange(5))
        >>> x, y = EmptySafeCollate(data)([])
        >>> x.shape, y.dtype
        (torch.Size([0, 3]), torch.int64)
    """

    def __init__(self, dataset: Dataset, collate_fn: Any = None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty: Any = None

    def __call__(self, batch: list) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._empty is None:
            one = self.collate_fn([self.dataset[0]])
            if isinstance(one, Mapping) and not isinstance(one, dict):
                one = dict(one)  # a BatchEncoding (a UserDict) is no pytree node: open it
            self._empty = tree_map(
                lambda t: t[:0] if isinstance(t, Tensor) else t, one)
        return self._empty


def _as_tensors(data: Tensor | Sequence[Tensor] | TensorDataset) -> tuple[Tensor, ...]:
    if isinstance(data, TensorDataset):
        data = data.tensors
    tensors = (data,) if isinstance(data, Tensor) else tuple(data)
    if not tensors or not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        raise ValueError("data must be a tensor (N, ...), a sequence of such tensors, or a "
                         "TensorDataset")
    lengths = {t.shape[0] for t in tensors}
    if len(lengths) != 1:
        raise ValueError(f"all tensors need the same number of rows N, got lengths "
                         f"{[t.shape[0] for t in tensors]}")
    return tensors


def _check_rate(sample_rate: float) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not (
            0 < sample_rate <= 1):
        raise ValueError(
            f"sample_rate (q) must be in (0, 1], got {sample_rate!r}: q = expected batch size "
            "/ number of examples")


def users_of_records(dataset: Any, user_ids: Any, n: int) -> Tensor:
    """``(N,)`` each record's user: ``user_ids`` as given, or the dataset's field of that
    name (a ``datasets.Dataset`` column, or each sample's key).

    Args:
        dataset: the map-style dataset of ``n`` records.
        user_ids: ``(N,)`` integers, or a field name (``"user_id"``).
        n: ``len(dataset)``.

    Returns:
        ``(N,)`` integer tensor.

    Raises:
        ValueError: no such field in the samples, or not one integer per record.

    Examples:
        >>> rows = [{"x": 1.0, "user_id": 7}, {"x": 2.0, "user_id": 3}]
        >>> users_of_records(rows, "user_id", 2)
        tensor([7, 3])
    """
    if isinstance(user_ids, str):
        if user_ids in getattr(dataset, "column_names", ()):
            user_ids = dataset[user_ids]
        else:
            try:
                user_ids = [dataset[i][user_ids] for i in range(n)]
            except (KeyError, TypeError, IndexError) as err:
                raise ValueError(
                    f"user_ids={user_ids!r} names a field, but the dataset's samples have "
                    f"none of that name ({type(err).__name__}: {err}): pass the ids as a "
                    "(N,) tensor, or samples with that key") from err
    users = torch.as_tensor(user_ids)
    if users.shape != (n,) or users.is_floating_point() or users.dtype == torch.bool:
        raise ValueError(f"user_ids must give one integer user per record, ({n},), got "
                         f"{tuple(users.shape)} {users.dtype}")
    return users


def loader_options(loader: DataLoader) -> dict[str, Any]:
    """The ``DataLoader`` arguments of ``loader`` to keep when its batches are drawn
    anew (all but its batching): the collate function, workers, pinned memory.

    Examples:
        >>> options = loader_options(DataLoader(range(10), batch_size=2, num_workers=0))
        >>> options["num_workers"], options["pin_memory"]
        (0, False)
    """
    keep = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                pin_memory=loader.pin_memory, timeout=loader.timeout,
                worker_init_fn=loader.worker_init_fn,
                multiprocessing_context=loader.multiprocessing_context,
                persistent_workers=loader.persistent_workers,
                pin_memory_device=loader.pin_memory_device)
    if loader.num_workers > 0:
        keep["prefetch_factor"] = loader.prefetch_factor
    return keep


def dataset_size(dataset: Any, given: str) -> int:
    """``len(dataset)``, or a ``ValueError`` that says why it is needed (``given``: how
    the dataset came, e.g. ``"DataLoader's dataset"``).

    Examples:
        >>> dataset_size(list(range(5)), "dataset")
        5
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"Poisson sampling needs the number of samples N of the {given} to sample "
            f"logical batches (each sample kept with probability q = expected_batch_size "
            f"/ N), but its {type(dataset).__name__} has no len(): pass a map-style "
            "dataset (dataset[i] and len(dataset)), e.g. a TensorDataset or a "
            "datasets.Dataset")
    return len(dataset)
