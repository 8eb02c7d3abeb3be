"""One set-up of a DP-SGD run's batches and seeds, shared by every front door.

A logical batch (Abadi et al. 2016's "lot") is one Poisson sample of the records, or,
with user-level DP, of the users, each drawn user bringing all its records (McMahan et
al. 2018), or, with cyclic Poisson sampling, of one group of the records, the groups
taken in turn (Choquette-Choo et al. 2023). With several processes every rank draws
the same sample and keeps its :func:`share`: the records (or whole users) at positions
``rank, rank + world_size, ...`` of it, so that the ranks' shares partition the sample
and the privacy analysis is the one of a single process. :func:`physical_batches` cuts
a rank's share into the batches one forward takes: the fewest of at most ``size``
samples, as many on every rank, or a given number of near-equal ones
(:func:`even_parts`: the fewest that hold ``size``); a user's records are never in two
of them. :func:`shared_seeds` gives the seeds of the sampling and of the noise, rank 0's on every
rank; :class:`PhysicalBatches` is the ``DataLoader`` batch sampler that applies the cut
to a sampler's logical batches.

Every front door sets its batches up here: :func:`~persample.dp.make_private`,
:class:`~persample.dp.PrivacyEngine` (with :class:`~persample.dp.BatchMemoryManager`),
:class:`~persample.integrations.transformers.PrivateTrainer`, ``persample dp-train`` and
``persample dp-finetune``; :class:`~persample.dp.PoissonBatchSampler`,
:class:`~persample.dp.UserPoissonSampler` and :class:`~persample.dp.CyclicPoissonSampler`
take their ``rank``'s :func:`share`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler

from .reduce import world

SEED_BOUND = 1 << 62  # seeds are drawn in [0, 2^62)


def share(drawn: Sequence[int], rank: int = 0, world_size: int = 1,
          user_of: Tensor | None = None) -> list[int]:
    """Process ``rank``'s share of one logical batch: its records at positions ``rank,
    rank + world_size, ...``; with ``user_of``, its users at those positions of the
    batch's users, each with all its records.

    Args:
        drawn: the logical batch, ``b`` record indices, the same on every rank; with
            ``user_of``, a user's records consecutive (as
            :class:`~persample.dp.UserPoissonSampler` yields them).
        rank, world_size: this process among ``world_size >= 1``, ``0 <= rank <
            world_size``.
        user_of: ``(N,)`` integers, each record's user (user-level DP), or ``None``.

    Returns:
        The share's record indices, in ``drawn``'s order. The shares of all ranks
        partition ``drawn``: every record in exactly one, a user's records in one.

    Raises:
        ValueError: ``rank`` or ``world_size`` out of range; with ``user_of``, a user
            whose records are not consecutive in ``drawn``.

    Examples:
        >>> share([3, 5, 8, 9, 12], rank=1, world_size=2)
        [5, 9]
        >>> users = torch.tensor([0, 0, 1, 2, 2, 2, 3])
        >>> share([0, 1, 2, 3, 4, 5, 6], rank=0, world_size=2, user_of=users)
        [0, 1, 3, 4, 5]

    Source: Abadi et al. 2016 (Poisson-sampled lots); McMahan et al. 2018 (user-level
    DP: the user is the unit sampled and clipped).
    """
    check_world(rank, world_size)
    return _flat(_ranks_runs(_runs(drawn, user_of), rank, world_size))


def physical_batches(drawn: Sequence[int], size: int | None = None, *,
                     parts: int | None = None, user_of: Tensor | None = None,
                     rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Process ``rank``'s :func:`share` of one logical batch cut into physical batches,
    each a list of record indices, a user's records always in one of them.

    Exactly one of ``size`` and ``parts``:

    - ``size``: the fewest batches of at most ``size`` records, filled in order (each
      full but the last, consecutive users sharing a batch while they fit); ranks with
      fewer batches than the rank with most get empty ones at the end, so every rank
      takes as many forwards (FSDP2's collectives need it). A user with more than
      ``size`` records gets a batch of its own, larger than ``size``: the front doors
      refuse such a ``size`` beforehand.
    - ``parts``: exactly ``parts`` batches of near-equal size (empty ones included):
      each user (or record) in the part that holds its middle record, part ``k``
      holding the positions ``(k b' / parts, (k + 1) b' / parts]`` of the share's
      ``b'`` records (records alone: the cuts at ``floor(k b' / parts)``).

    Args:
        drawn: the logical batch, ``b`` record indices, the same on every rank (a user's
            records consecutive).
        size: the most records of a physical batch, ``>= 1``.
        parts: the number of physical batches, ``>= 1``.
        user_of: ``(N,)`` each record's user (user-level DP), or ``None``.
        rank, world_size: as for :func:`share`.

    Returns:
        The physical batches, in ``drawn``'s order: their concatenation is this rank's
        share. With ``size`` and one process, no batch is empty and an empty ``drawn``
        has none.

    Raises:
        ValueError: neither or both of ``size`` and ``parts``, either not an int ``>=
            1``, and the errors of :func:`share`.

    Examples:
        >>> physical_batches([0, 1, 2, 3, 4], 2)
        [[0, 1], [2, 3], [4]]
        >>> physical_batches([0, 1, 2, 3, 4], parts=2)
        [[0, 1], [2, 3, 4]]
        >>> users = torch.tensor([0, 0, 1, 2, 2, 1])
        >>> physical_batches([0, 1, 2, 5, 3, 4], 5, user_of=users)  # user 2 not split
        [[0, 1, 2, 5], [3, 4]]
        >>> [physical_batches([0, 1, 2, 3, 4], 2, rank=r, world_size=2) for r in (0, 1)]
        [[[0, 2], [4]], [[1, 3], []]]

    Source: Abadi et al. 2016 (a lot processed in groups, the noise added once per lot);
    McMahan et al. 2018 (a user's records clipped together).
    """
    check_world(rank, world_size)
    if (size is None) == (parts is None):
        raise ValueError("pass size (the most records of a physical batch) or parts (how "
                         f"many physical batches), one of them: got size={size!r}, "
                         f"parts={parts!r}")
    _check_count("size" if parts is None else "parts", size if parts is None else parts)
    runs = _runs(drawn, user_of)  # (users or records,) each a list of records
    if parts is not None:
        return _split(_ranks_runs(runs, rank, world_size), parts)
    cuts = [_fill(_ranks_runs(runs, r, world_size), size) for r in range(world_size)]
    count = max(len(c) for c in cuts)  # as many on every rank
    return cuts[rank] + [[] for _ in range(count - len(cuts[rank]))]


def even_parts(records: int, size: int, world_size: int = 1) -> int:
    """How many near-equal physical batches (``physical_batches(..., parts=)``) hold
    every rank's share of a logical batch of ``records`` records, at most ``size``
    each: ``ceil(records / (size * world_size))``, at least one (an empty logical batch
    is one empty physical batch), the same on every rank. Opacus's
    ``BatchMemoryManager`` cuts this way; for records only (users are lumpier: cut them
    with ``size``).

    Args:
        records: ``b``, the logical batch's records (every rank's), ``>= 0``.
        size: the most records of a physical batch, ``>= 1``.
        world_size: the processes sharing the batch.

    Returns:
        The number of parts, ``>= 1``: each rank's share (at most ``ceil(b /
        world_size)`` records) cut in that many holds at most ``size`` in each.

    Raises:
        ValueError: ``size`` or ``world_size`` not an int ``>= 1``.

    Examples:
        >>> even_parts(7, 3), even_parts(7, 3, world_size=2), even_parts(0, 3)
        (3, 2, 1)
        >>> physical_batches(list(range(7)), parts=even_parts(7, 3))
        [[0, 1], [2, 3], [4, 5, 6]]

    Source: Opacus (Yousefpour et al. 2021), ``BatchMemoryManager``; Abadi et al. 2016
    (a lot processed in groups).
    """
    _check_count("size", size)
    _check_count("world_size", world_size)
    return max(1, math.ceil(records / (size * world_size)))


@dataclass(frozen=True)
class Seeds:
    """The seeds every rank of a run shares: ``sampling`` for the Poisson draws,
    ``noise`` for the noise (``sampling + 1``).

    Examples:
        >>> seeds = Seeds(7, 8)
        >>> torch.equal(torch.rand(2, generator=seeds.sampling_generator()),
        ...             torch.rand(2, generator=torch.Generator().manual_seed(7)))
        True
    """

    sampling: int
    noise: int

    def sampling_generator(self) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded with ``sampling`` (the samplers draw on the
        CPU)."""
        return torch.Generator().manual_seed(self.sampling)

    def noise_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A ``torch.Generator`` on ``device`` (the parameters') seeded with ``noise``."""
        return torch.Generator(device=device).manual_seed(self.noise)


def shared_seeds(seed: int | torch.Generator | None = None) -> Seeds:
    """The sampling and noise seeds of a run, the same on every rank: rank 0's.

    Every rank turns ``seed`` into one integer ``s``: ``seed`` itself; or one draw from
    ``seed``, a ``torch.Generator``; or with ``None`` one draw from torch's default
    generator (so that runs follow ``torch.manual_seed``). When ``torch.distributed`` is
    initialised with several processes, rank 0's ``s`` is sent to every rank (one
    ``broadcast_object_list``: every rank must call this at the same point). The
    sampling seed is ``s``, the noise's ``s + 1``.

    Args:
        seed: an int in ``[-2^63, 2^64 - 1)``, a ``torch.Generator`` (advanced by one
            draw on every rank), or ``None``.

    Returns:
        :class:`Seeds` ``(s, s + 1)``.

    Raises:
        ValueError: ``seed`` neither an int in range, a generator nor ``None``.

    Examples:
        >>> shared_seeds(3)
        Seeds(sampling=3, noise=4)
        >>> a = shared_seeds(torch.Generator().manual_seed(0))
        >>> a == shared_seeds(torch.Generator().manual_seed(0)), 0 <= a.sampling < 2**62
        (True, True)

    Source: Abadi et al. 2016 (one Poisson sample per lot, one noise draw per lot: the
    ranks must draw the same sample, and the noise once).
    """
    s = _own_seed(seed)
    if (world() or (1, 0))[0] > 1:
        box = [s]
        dist.broadcast_object_list(box, src=0)  # rank 0's is every rank's
        s = box[0]
    return Seeds(s, s + 1)


class PhysicalBatches(Sampler[list[int]]):
    """A ``DataLoader`` batch sampler: each logical batch of ``logical``, this rank's
    :func:`physical_batches` (of at most ``size`` records, or ``parts`` of them).

    :meth:`plan` draws an epoch ahead and says how many physical batches each logical
    one has; iterating then gives that epoch (a ``DataLoader`` with workers starts its
    sampler twice), else a freshly drawn one.

    Args:
        logical: a sampler of whole logical batches, the same on every rank (a
            :class:`~persample.dp.PoissonBatchSampler` or
            :class:`~persample.dp.UserPoissonSampler` of ``world_size`` 1, seeded
            alike); its ``user_of``, if any, keeps users whole.
        size, parts: as for :func:`physical_batches` (one of them).
        rank, world_size: this process among ``world_size``.

    Raises:
        ValueError: ``logical`` already a share (its ``world_size`` above 1), and the
            errors of :func:`physical_batches`.

    Examples:
        >>> from persample.dp import PoissonBatchSampler
        >>> logical = PoissonBatchSampler(10, 0.5, 2, torch.Generator().manual_seed(0))
        >>> cut = PhysicalBatches(logical, 2)
        >>> counts = cut.plan()
        >>> parts = list(cut)
        >>> len(parts) == sum(counts) and all(0 < len(p) <= 2 for p in parts)
        True

    Source: Abadi et al. 2016 (lots processed in groups); Opacus's ``BatchMemoryManager``
    and virtual steps.
    """

    def __init__(self, logical: Any, size: int | None = None, *, parts: int | None = None,
                 rank: int = 0, world_size: int = 1):
        if getattr(logical, "world_size", 1) != 1:
            raise ValueError("PhysicalBatches takes the sampler of the whole logical batches "
                             "(world_size=1, seeded alike on every rank) and takes this "
                             "rank's share itself")
        physical_batches([], size, parts=parts, rank=rank, world_size=world_size)  # checks
        self.logical, self.size, self.parts = logical, size, parts
        self.rank, self.world_size = rank, world_size
        self.user_of: Tensor | None = getattr(logical, "user_of", None)
        self.planned: list[list[int]] | None = None

    def cut(self, drawn: list[int]) -> list[list[int]]:
        """One logical batch: this rank's physical batches."""
        return physical_batches(drawn, self.size, parts=self.parts, user_of=self.user_of,
                                rank=self.rank, world_size=self.world_size)

    def plan(self) -> list[int]:
        """Draw an epoch's logical batches; the number of physical batches of each."""
        self.planned, counts = [], []
        for drawn in self.logical:
            parts = self.cut(drawn)
            self.planned += parts
            counts.append(len(parts))
        return counts

    def __len__(self) -> int:
        """Exact with ``parts``; else an estimate (Poisson sizes vary; a user counted as
        one record): the expected physical batches per epoch."""
        if self.parts is not None:
            return len(self.logical) * self.parts
        share = self.logical.expected_batch_size / self.world_size
        return len(self.logical) * max(1, math.ceil(share / self.size))

    def __iter__(self) -> Iterator[list[int]]:
        if self.planned is not None:  # (planned by PrivateRun.batches)
            return iter(self.planned)
        return (part for drawn in self.logical for part in self.cut(drawn))


def check_world(rank: int, world_size: int) -> None:
    """Check that ``rank`` is a process among ``world_size``: ints, ``0 <= rank <
    world_size``.

    Raises:
        ValueError: either out of range, or not an int.

    Examples:
        >>> check_world(1, 2)
        >>> check_world(2, 2)
        Traceback (most recent call last):
        ...
        ValueError: need 0 <= rank < world_size, got rank 2, world_size 2
    """
    if not (isinstance(world_size, int) and not isinstance(world_size, bool)
            and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank!r}, world_size "
                         f"{world_size!r}")


def _runs(drawn: Sequence[int], user_of: Tensor | None) -> list[list[int]]:
    """``drawn`` in runs: each user's records (consecutive), or each record alone."""
    drawn = list(drawn)
    if user_of is None:
        return [[i] for i in drawn]
    if not drawn:
        return []
    users = user_of[torch.tensor(drawn, dtype=torch.int64)]  # (b,)
    ends = ((users[1:] != users[:-1]).nonzero()[:, 0] + 1).tolist()  # (runs - 1,)
    bounds = [0, *ends, len(drawn)]
    if len(bounds) - 1 != len(torch.unique(users)):
        raise ValueError("a user's records must be consecutive in the logical batch (as "
                         "UserPoissonSampler yields them): they are clipped together, on "
                         "one rank, in one physical batch")
    return [drawn[a:b] for a, b in zip(bounds, bounds[1:])]


def _ranks_runs(runs: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """The share of ``rank``: the runs (users, or records) at positions ``rank, rank +
    world_size, ...``."""
    return runs[rank::world_size]


def _fill(runs: list[list[int]], size: int) -> list[list[int]]:
    """Runs packed in order, each batch taking runs while they fit in ``size`` (a longer
    run alone)."""
    batches: list[list[int]] = []
    for run in runs:
        if batches and len(batches[-1]) + len(run) <= size:
            batches[-1] += run
        else:
            batches.append(list(run))
    return batches


def _split(runs: list[list[int]], parts: int) -> list[list[int]]:
    """Runs in ``parts`` batches, each in the part that holds its middle record."""
    total = sum(len(run) for run in runs)
    batches: list[list[int]] = [[] for _ in range(parts)]
    done = 0
    for run in runs:
        middle2 = 2 * done + len(run) + 1  # twice the middle record's 1-based position
        batches[-(-middle2 * parts // (2 * total)) - 1] += run  # ceil(mid * parts / b') - 1
        done += len(run)
    return batches


def _flat(runs: list[list[int]]) -> list[int]:
    return [i for run in runs for i in run]


def _own_seed(seed: int | torch.Generator | None) -> int:
    """This rank's ``s``: ``seed``, or one draw from it or from torch's generator."""
    if isinstance(seed, torch.Generator):
        return int(torch.randint(SEED_BOUND, (1,), generator=seed, device=seed.device))
    if seed is None:
        return int(torch.randint(SEED_BOUND, (1,)))
    if isinstance(seed, bool) or not isinstance(seed, int) or not (
            -(1 << 63) <= seed < (1 << 64) - 1):
        raise ValueError(f"seed must be an int in [-2^63, 2^64 - 1) (torch.Generator's "
                         f"seeds, and the next), a torch.Generator or None, got {seed!r}")
    return seed


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
