"""Private training set up in one call: :func:`make_private`.

From a model, an optimizer, a dataset or the ``DataLoader`` the user already has, a
privacy target (or a noise multiplier) and the batch sizes it gives what a DP-SGD
loop needs, as Opacus's ``PrivacyEngine.make_private`` and
``make_private_with_epsilon`` do, without wrapping or changing the model or the
optimizer: Poisson-sampled logical batches (Abadi et al. 2016) split into physical
ones that fit in memory, loaded by a ``DataLoader`` with the user's collate
function, workers and pinned memory, a :class:`~persample.dp.PrivateStep` with the
noise multiplier that reaches the target epsilon after the planned steps
(:func:`~persample.dp.noise_multiplier_for`), and its accountant, stepped once per
release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from .accounting import noise_multiplier_for
from .adaptive import AdaptiveClipping
from .clipping import Clipping
from .mechanisms import Mechanism, accounted_runs, resolve_mechanism
from .microbatch import Accumulated
from .reduce import world
from .sampling import (
    EmptySafeCollate,
    PoissonBatchSampler,
    dataset_size,
    loader_options,
    logical_sampler,
    users_of_records,
)
from .setup import PhysicalBatches, shared_seeds
from .step import PrivateStep


@dataclass
class PrivateRun:
    """What :func:`make_private` sets up. ``step``: the :class:`PrivateStep` (its
    ``accountant`` counts the releases); ``loader``: the ``DataLoader`` of the physical
    batches (the user's dataset, collate function, workers and pinned memory; its
    batch sampler draws each epoch's Poisson sample and cuts it); ``sampler``: the
    logical batches' :class:`PoissonBatchSampler`; ``noise_multiplier``,
    ``sample_rate`` (``q``), ``steps_per_epoch`` and ``epochs`` as planned.

    Examples:
        >>> from torch.utils.data import TensorDataset
        >>> from persample.dp import make_private
        >>> net = nn.Linear(4, 3)
        >>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 3, (100,)))
        >>> private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data,
        ...                        nn.CrossEntropyLoss(), target_epsilon=2.0,
        ...                        target_delta=1e-5, epochs=1, max_grad_norm=1.0,
        ...                        expected_batch_size=20, physical_batch_size=8,
        ...                        generator=torch.Generator().manual_seed(0))
        >>> private.steps_per_epoch, private.sample_rate
        (5, 0.2)
        >>> logical = next(private.batches())  # one Poisson sample, in physical batches
        >>> all(len(y) <= 8 for _, y in logical)
        True
    """

    step: PrivateStep
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    sampler: PoissonBatchSampler
    physical_batch_size: int
    noise_multiplier: float
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    users: Tensor | None = field(default=None, init=False)
    """User-level DP: the users of the physical batch :meth:`batches` gave last."""

    @property
    def dataset(self) -> Dataset:
        """The dataset the batches are drawn from."""
        return self.loader.dataset

    def batches(self) -> Iterator[Iterator[Any]]:
        """One epoch: ``steps_per_epoch`` logical batches, each drawn by Poisson
        sampling (possibly empty) and yielded as an iterator of its physical batches
        (collated by the loader, at most ``physical_batch_size`` samples each; an empty
        logical batch yields none). A logical batch left unfinished is skipped whole
        when the next one is asked for."""
        cut = self.loader.batch_sampler
        counts = cut.plan()  # the epoch's Poisson sample, drawn once
        try:
            loaded = zip(self.loader, cut.planned)
            for count in counts:
                left = [count]
                yield self._physical(loaded, left)
                for _ in range(left[0]):
                    next(loaded)
        finally:
            cut.planned, self.users = None, None

    def _physical(self, loaded: Iterator[tuple[Any, list[int]]], left: list[int]
                  ) -> Iterator[Any]:
        """The next ``left[0]`` physical batches of ``loaded`` (counted down as taken);
        with users, :attr:`users` set to each one's."""
        user_of = getattr(self.sampler, "user_of", None)
        while left[0] > 0:
            left[0] -= 1
            batch, indices = next(loaded)
            if user_of is not None:
                self.users = user_of[torch.tensor(indices, dtype=torch.int64)]
            yield batch

    def accumulate(self, inputs: Any, targets: Any, user_ids: Tensor | None = None
                   ) -> Accumulated:
        """``step.accumulate``: one physical batch's clipped sums; its ``(b,)`` losses and
        norms. User-level DP: ``user_ids`` default to the users of the physical batch
        :meth:`batches` gave last."""
        if user_ids is None:
            user_ids = self.users
        return self.step.accumulate(inputs, targets, user_ids)

    def release(self) -> None:
        """The end of a logical batch: ``step.release()`` (noise, ``p.grad``, one
        accounted step), then ``optimizer.step()`` and ``optimizer.zero_grad()``."""
        self.step.release()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def epsilon(self, delta: float) -> float:
        """The privacy spent by the releases so far, at ``delta``."""
        return self.step.epsilon(delta)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer,
                 data: Dataset | DataLoader, loss_fn: Callable[[Any, Any], Tensor], *,
                 epochs: int, max_grad_norm: Any = None, clipping: Clipping | None = None,
                 target_epsilon: float | None = None,
                 target_delta: float | None = None, noise_multiplier: float | None = None,
                 expected_batch_size: int | None = None, physical_batch_size: int | None = None,
                 accountant: str = "rdp", generator: torch.Generator | None = None,
                 collate_fn: Callable[[list], Any] | None = None, per_layer: bool = False,
                 secure_mode: bool = False, param_groups: list[list[str]] | None = None,
                 automatic_gamma: float = 0.01, user_ids: Any = None,
                 records_per_user: int | None = None,
                 adaptive_clipping: AdaptiveClipping | None = None,
                 mechanism: Mechanism | str | None = None, bands: int | None = None,
                 buffers: int | None = None,
                 check: str | int | None = None) -> PrivateRun:
    """Set up DP-SGD to spend at most ``(target_epsilon, target_delta)`` in ``epochs``
    (or to run ``epochs`` with a given ``noise_multiplier``).

    The sample rate is ``q = expected_batch_size / N`` (``N`` samples); an epoch is
    ``round(1 / q)`` logical batches, so training takes ``epochs * round(1 / q)``
    steps, and the noise multiplier is the smallest that keeps them within the target
    (``noise_multiplier_for``). Neither the model nor the optimizer is wrapped or
    changed: the loop calls ``accumulate`` per physical batch and ``release`` per
    logical one. ``data`` may be the ``DataLoader`` an Opacus user passes to
    ``make_private``: its dataset, collate function, workers, pinned memory and
    worker settings are kept, its batch size is the expected logical batch size, and
    its sampler and ``drop_last`` are replaced by Poisson sampling (as Opacus's
    ``DPDataLoader`` does).

    Several processes (``torch.distributed`` initialised, every rank calling
    ``make_private`` alike; the model plain, in ``DistributedDataParallel`` or sharded
    with FSDP2's ``fully_shard``): every rank draws the same logical batches (the seeds
    rank 0 draws: :func:`~persample.dp.setup.shared_seeds`), takes its share of each,
    whole users with ``user_ids`` (:func:`~persample.dp.setup.share`), in as many
    physical batches as every other rank (empty ones at the end where its share is
    smaller: the loader collates them as empty tensors); :meth:`PrivateRun.release`
    sums the ranks' clipped sums, the noise added once (:class:`PrivateStep`), so the
    run is the one of a single process on the whole logical batches.

    Args:
        model: the ``nn.Module`` (plain, or wrapped in ``DistributedDataParallel``).
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        data: a map-style dataset (``dataset[i]`` one sample, ``len(dataset)`` =
            ``N``), or a ``torch.utils.data.DataLoader`` over one.
        loss_fn: ``loss_fn(output, targets)``, as for :class:`PrivateStep`.
        epochs: passes over the data planned, ``>= 1``.
        clipping: a :class:`~persample.dp.Clipping`, or ``max_grad_norm``: the clipping
            norm ``C > 0`` (with the shorthand keywords, a list of norms, one per group
            of ``param_groups``, or ``"automatic"``), as for :class:`PrivateStep`.
        target_epsilon: the epsilon budget, ``> 0``; or pass ``noise_multiplier``.
        target_delta: ``delta`` in ``(0, 1)`` (below ``1 / N`` as a rule), with
            ``target_epsilon``.
        noise_multiplier: ``sigma >= 0`` instead of a target (Opacus's
            ``make_private``); :meth:`PrivateRun.epsilon` then says what it spent.
        expected_batch_size: the logical batch size expected, ``q * N``, ``>= 1``;
            default the ``DataLoader``'s ``batch_size`` (required with a dataset); with
            ``user_ids``, the users expected per logical batch (required).
        physical_batch_size: the most samples one forward and backward takes,
            ``>= 1``; default ``expected_batch_size`` (a Poisson batch above it is cut).
        accountant: ``"rdp"``, ``"pld"`` or ``"prv"``: how epsilon is computed, for the
            calibration and during training.
        generator: a ``torch.Generator`` to seed the run from (seed it to reproduce
            a run; default torch's, so a run follows ``torch.manual_seed``): one draw
            ``s`` from it (rank 0's, with several processes) seeds the batches' CPU
            generator, and ``s + 1`` the noise's, on the parameters' device
            (:func:`~persample.dp.setup.shared_seeds`).
        collate_fn: how samples become a batch (default: the ``DataLoader``'s, else
            ``default_collate``); an empty logical batch has no physical batch to
            collate (its release is noise only).
        per_layer, param_groups, automatic_gamma, adaptive_clipping, check: as for
            :class:`PrivateStep` (adaptive clipping: record-level DP only).
        user_ids: user-level DP: each record's user, ``(N,)`` integers, or the name of
            the dataset's field that holds it (``"user_id"``: a column of a Hugging
            Face ``datasets.Dataset``, or a key of each sample). Users are then sampled
            (``q = expected_batch_size / U`` over the ``U`` users), each user's
            gradient in a logical batch, the sum of its records', is clipped once, a
            user's records stay in one physical batch, and epsilon is per user
            (Chua et al. 2024, "Mind the Privacy Unit! User-Level Differential Privacy
            for Language Model Fine-Tuning"; McMahan et al. 2018).
        records_per_user: at most this many of a user's records per step (drawn at
            random), ``>= 1``; default all. Every user's (capped) records must fit in
            one physical batch.
        mechanism: correlated noise: ``"bandmf"`` with ``bands=b`` (the strategy
            optimised for the planned steps, :class:`~persample.dp.BandMF`), ``"blt"``
            with ``buffers=d`` (:class:`~persample.dp.BLT`), or either made for exactly
            ``epochs * round(1 / q)`` steps; ``None`` (default): DP-SGD. The logical
            batches then come from cyclic Poisson sampling over the mechanism's
            ``cycle_length`` groups ``s`` (:class:`~persample.dp.CyclicPoissonSampler`,
            each group at rate ``s q``): BandMF's ``b`` groups, the noise multiplier
            calibrated, and epsilon accounted, as DP-SGD over ``ceil(T / b)`` steps at
            rate ``b q`` (Choquette-Choo et al. 2023, Theorem 4); BLT's ``floor(1 / q)``
            (fixed batches, an epoch apart), as one Gaussian mechanism of the BLT's
            sensitivity. With ``user_ids`` the users are split and sampled so
            (:class:`~persample.dp.CyclicUserPoissonSampler`); not with
            ``adaptive_clipping``.
        bands: the bands of ``mechanism="bandmf"``, ``1 <= b <= 1 / q``.
        buffers: the buffers of ``mechanism="blt"`` (default 3).
        secure_mode: the noise and the Poisson sampling from the operating system's
            cryptographically secure generator (``os.urandom``), as Opacus's
            ``secure_mode``: nothing to learn from a seed; not with ``generator``, nor
            with several processes, which must draw one sample alike (threat model and
            cost: :class:`persample.dp.noise.SecureSource`).

    Returns:
        a :class:`PrivateRun`: ``batches()`` per epoch, ``accumulate`` and
        ``release``, ``epsilon(delta)``, the ``loader``, and the plan
        (``noise_multiplier``, ``sample_rate``, ``steps_per_epoch``).

    Raises:
        ValueError: an argument outside its range, both or neither of
            ``target_epsilon`` and ``noise_multiplier``, ``target_epsilon`` without
            ``target_delta``, an empty dataset or one without ``len()`` (an
            ``IterableDataset``), no ``expected_batch_size`` with a dataset (or a
            ``DataLoader`` without a ``batch_size``), an expected batch larger than
            the dataset, ``secure_mode`` with several processes, or a ``mechanism``
            this run cannot take (made for other steps, ``cycle_length * q > 1``;
            ``bands`` without ``"bandmf"``, ``buffers`` without ``"blt"``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from persample.dp import make_private
        >>> net = nn.Linear(4, 3)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> data = TensorDataset(torch.randn(200, 4), torch.randint(0, 3, (200,)))
        >>> loader = DataLoader(data, batch_size=50, shuffle=True)  # as for Opacus
        >>> private = make_private(net, opt, loader, nn.CrossEntropyLoss(),
        ...                        target_epsilon=2.0, target_delta=1e-5, epochs=1,
        ...                        max_grad_norm=1.0, physical_batch_size=20,
        ...                        generator=torch.Generator().manual_seed(0))
        >>> for logical in private.batches():
        ...     for x, y in logical:
        ...         losses, norms = private.accumulate(x, y)
        ...     private.release()
        >>> private.step.accountant.steps, private.epsilon(1e-5) <= 2.0
        (4, True)

    Source: Abadi et al. 2016 (DP-SGD with Poisson-sampled lots); Opacus's
    ``make_private``, ``make_private_with_epsilon``, ``DPDataLoader`` and virtual steps.
    """
    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    n = dataset_size(dataset, "DataLoader's dataset" if loader is not None else "dataset")
    users = None if user_ids is None else users_of_records(dataset, user_ids, n)
    clipping = Clipping.resolve(clipping, max_grad_norm, per_layer=per_layer,
                                param_groups=param_groups, automatic_gamma=automatic_gamma,
                                adaptive_clipping=adaptive_clipping)
    if users is not None and clipping.adaptive is not None:
        raise ValueError("adaptive_clipping counts unclipped samples, not users: pass "
                         "user_ids or adaptive_clipping, not both")
    if users is not None and expected_batch_size is None:
        raise ValueError("with user_ids, pass expected_batch_size: the number of users "
                         "expected per logical batch (q * U)")
    if expected_batch_size is None:
        expected_batch_size = loader.batch_size if loader is not None else None
        if expected_batch_size is None:
            raise ValueError(
                "pass expected_batch_size, the logical batch size expected (q * N): "
                + ("the DataLoader has no batch_size (it was given a batch_sampler)"
                   if loader is not None else "a dataset has no batch size"))
    if physical_batch_size is None:
        physical_batch_size = expected_batch_size
    for name, value in (("epochs", epochs), ("expected_batch_size", expected_batch_size),
                        ("physical_batch_size", physical_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    units = n if users is None else len(torch.unique(users))
    if n == 0 or expected_batch_size > units:
        what = "samples" if users is None else "users"
        raise ValueError(f"expected_batch_size ({expected_batch_size}) must be at most the "
                         f"number of {what} ({units})")
    q = expected_batch_size / units
    steps_per_epoch = max(1, round(1 / q))
    mech = resolve_mechanism(mechanism, epochs * steps_per_epoch, q, bands=bands,
                             buffers=buffers)
    (rate, compositions), = [(r, k) for _, r, k in accounted_runs(
        mech, 0.0, q, epochs * steps_per_epoch)]
    sigma = _noise_multiplier(target_epsilon, target_delta, noise_multiplier, rate,
                              compositions, accountant)
    size, rank = world() or (1, 0)
    batches_from, noise = _sources(model, generator, secure_mode, size)
    step = PrivateStep(model, loss_fn, clipping=clipping, noise_multiplier=sigma,
                       expected_batch_size=expected_batch_size, generator=noise,
                       sample_rate=q, accountant=accountant, secure_mode=secure_mode,
                       mechanism=mech, check=check)
    batches_from = batches_from or step.generator  # secure_mode: the step's SecureSource
    sampler = logical_sampler(n, q, steps_per_epoch, batches_from, user_of=users,
                              records_per_user=records_per_user,
                              cycle_length=None if mech is None else mech.cycle_length)
    if users is not None:
        if sampler.most_records > physical_batch_size:
            raise ValueError(
                f"a user brings {sampler.most_records} records to a step, more than "
                f"physical_batch_size ({physical_batch_size}): a user's records are clipped "
                "together, in one physical batch; raise physical_batch_size or cap "
                "records_per_user")
    options = loader_options(loader) if loader is not None else {}
    if collate_fn is not None:
        options["collate_fn"] = collate_fn
    if size > 1:  # a rank's share may be cut in fewer batches than another's: empty ones
        options["collate_fn"] = EmptySafeCollate(dataset, options.get("collate_fn"))
    cut = PhysicalBatches(sampler, physical_batch_size, rank=rank, world_size=size)
    physical = DataLoader(dataset, batch_sampler=cut, **options)
    return PrivateRun(step, optimizer, physical, sampler, physical_batch_size,
                           sigma, q, steps_per_epoch, epochs)


def _sources(model: nn.Module, generator: torch.Generator | None, secure_mode: bool,
             size: int) -> tuple[torch.Generator | None, torch.Generator | None]:
    """The batches' generator and the noise's, from the seeds every rank shares; with
    ``secure_mode`` (one process) neither: both come from the step's secure source."""
    if secure_mode:
        if size > 1:
            raise ValueError("make_private does not take secure_mode with several "
                             "processes: the ranks split one Poisson sample, which they "
                             "must draw alike from a shared seed")
        return None, generator  # (a generator with secure_mode: PrivateStep refuses it)
    seeds = shared_seeds(generator)
    device = next(model.parameters()).device
    return seeds.sampling_generator(), seeds.noise_generator(device)


def _noise_multiplier(target_epsilon: float | None, target_delta: float | None,
                      noise_multiplier: float | None, q: float, steps: int,
                      accountant: str) -> float:
    """The given ``noise_multiplier``, or the one that spends the target in ``steps``."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("pass either target_epsilon (with target_delta) or noise_multiplier, "
                         f"not {'both' if noise_multiplier is not None else 'neither'}")
    if noise_multiplier is not None:
        return noise_multiplier
    if target_delta is None:
        raise ValueError("target_epsilon needs target_delta, e.g. 1 / N or below")
    return noise_multiplier_for(target_epsilon, target_delta, q, steps, accountant)
