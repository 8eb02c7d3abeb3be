"""How one DP-SGD step's clipped sums become ``p.grad``: one reducer per mode.

A :class:`~persample.dp.PrivateStep` adds each micro-batch's clipped sums ``sum_i c_i
g_i`` (:mod:`persample.dp.microbatch`) to sums it keeps; its release sets ``p.grad = (sums +
N(0, sigma^2 C^2 I)) / B'`` (Abadi et al. 2016). Where the sums live, who draws the
noise and how the processes' sums meet depend on the mode: one :class:`Reducer` per
mode, picked once by :func:`reducer_for` when the step is made.

- :class:`Local`, one process: nothing to reduce. The first micro-batch of a step adds
  its sums straight into the step's sums (one buffer of the parameters' size, made
  after the backward, so that it is not held while the activations are); a later one
  adds into a temporary, added to the sums once it is complete (a failed micro-batch
  adds nothing). The release adds the noise into the sums in place, divides them in
  place and makes them ``p.grad``: one buffer of the parameters' size in all. For the
  single call of :func:`~persample.dp.private_grad` the noise is drawn into that
  buffer as it is made and the clipped sums are added to it.
- :class:`AllReduce`, several processes with ``torch.distributed`` (a plain model or
  the module of a ``DistributedDataParallel``): as :class:`Local`, but only rank 0 adds
  the noise, and one all-reduce per buffer sums every rank's sums. Before it the ranks
  agree on the parameters and the divisor, and a non-finite gradient on any rank
  raises on every rank.
- :class:`Sharded`, FSDP2 (``fully_shard``): each FSDP unit's sums are reduce-scattered
  to the shards as the micro-batch goes (no rank holds more than one unit's sums in
  full); the release adds to each shard its part of the counter-based noise
  (:mod:`persample.dp.noise`), the same as one process draws from the same seed.

``p.grad`` is written in one place, :func:`_write_grads`. Source: Abadi et al. 2016
(DP-SGD); Zhao et al. 2023 (PyTorch FSDP).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import checks
from ..inputs import Batch
from ..precision import accumulate_dtype
from ..sharded import Sharding, as_sharded_grad, fsdp_units, reduce_to_shards, shard_rows
from .mechanisms import CorrelatedNoise
from .microbatch import Accumulated, check_finite
from .noise import (
    SecureSource,
    add_gaussian,
    fill_gaussian,
    gaussian_like,
    noise_range,
    pooled_like,
    release_seed,
    secure_normal,
)


@dataclass(frozen=True)
class Terms:
    """What a reducer needs of its step.

    Attributes:
        params: ``{name: parameter}``, the step's trainable parameters as the optimizer
            holds them (FSDP2: sharded ``DTensor``), ``named_parameters()`` order.
        std: ``sigma * C``, the noise's standard deviation (loss units per parameter
            unit).
        generator: the noise's ``torch.Generator`` (``None``: torch's default), or a
            :class:`~persample.dp.noise.SecureSource` (``secure_mode``).
        divisor: ``B' > 0``, the expected batch size the noised sums are divided by.
        users: the users (user-level DP) this process accumulated in the step: no two
            processes may hold records of one user.
        noise: a mechanism's correlated noise (:mod:`persample.dp.mechanisms`): each
            parameter's independent draw becomes its noise through it; ``None``:
            DP-SGD's independent noise.

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> terms = Terms(dict(net.named_parameters()), std=1.1 * 1.0, generator=None,
        ...               divisor=64.0)
        >>> list(terms.params), terms.std
        (['weight', 'bias'], 1.1)
    """

    params: dict[str, nn.Parameter]
    std: float
    generator: torch.Generator | SecureSource | None
    divisor: float
    users: frozenset[int] = frozenset()
    noise: CorrelatedNoise | None = None


@dataclass
class Sums:
    """A step's clipped sums.

    Attributes:
        tensors: ``{name: tensor}``, each parameter's shape (FSDP2: its shard's local
            shape), in the dtype sums accumulate in (float32 at least).
        buffers: the 1-d buffers the tensors view (one per dtype and device), empty where
            the tensors are not the step's own (loaded from a checkpoint).
        noised: the release's noise is in them already (the single call of
            ``private_grad``).

    Examples:
        >>> from persample.dp.noise import pooled_like
        >>> net = nn.Linear(3, 2)
        >>> buffers = []
        >>> tensors = pooled_like(list(net.parameters()), lambda b: b.zero_(), buffers,
        ...                       accumulate=True)
        >>> sums = Sums(dict(zip(["weight", "bias"], tensors)), buffers)
        >>> sums.tensors["weight"].shape, [b.shape for b in sums.buffers]
        (torch.Size([2, 3]), [torch.Size([8])])
    """

    tensors: dict[str, Tensor]
    buffers: list[Tensor] = field(default_factory=list)
    noised: bool = False


class Reducer(ABC):
    """What :class:`~persample.dp.PrivateStep` asks of its mode: the parameters, the
    validation of a micro-batch, where its clipped sums go, what a non-finite gradient
    does, the ranks' agreement and the release. The base is one process's: nothing to
    agree on. :class:`Local`'s example goes through every method.
    """

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The step's parameters as the optimizer holds them.

        Args:
            model: the step's module.

        Returns:
            ``{name: parameter}``, the trainable ones, ``named_parameters()`` order.

        Raises:
            ValueError: the model has no trainable parameter.
        """
        return checks.trainable_parameters(model)

    def begin(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable
              ) -> tuple[Batch, int, dict[str, nn.Parameter]]:
        """Validate one micro-batch's call.

        Args:
            model, inputs, targets, loss_fn: as for ``per_sample_grads``.

        Returns:
            ``(batch, n, params)``: the inputs read, the number of samples, and ``{name:
            parameter}`` the forward reads.

        Raises:
            ValueError, TypeError: the errors of ``per_sample_grads``'s validation.
        """
        return checks.validate_call(model, inputs, targets, loss_fn, "auto", None)

    @abstractmethod
    def micro_batch(self, sums: Sums | None, params: dict[str, nn.Parameter], terms: Terms
                    ) -> Accumulation:
        """Where one micro-batch's clipped sums go.

        Args:
            sums: the step's sums so far (``None``: this is the step's first micro-batch).
            params: ``{name: parameter}`` the forward reads (:meth:`begin`'s).
            terms: the step's.

        Returns:
            The micro-batch's :class:`Accumulation`, for ``clipped_sums``; its ``commit()``
            is the step's new sums once the micro-batch is complete.
        """

    def failed(self, err: FloatingPointError, n: int) -> Accumulated:
        """A micro-batch of ``n`` samples had a non-finite gradient (``err``, raised
        before anything was added): raised here.

        Returns:
            What ``accumulate`` returns instead where the error is deferred (several
            processes: ``(n,)`` NaN losses and norms).

        Raises:
            FloatingPointError: ``err`` (one process; FSDP2, where every rank raised it).
        """
        raise err

    def agree(self, terms: Terms, drop: Callable[[], None]) -> None:
        """Before a release: every rank holds the same step. One process: nothing to
        check.

        Args:
            terms: the step's.
            drop: empties the step's sums, called where a failure loses them.

        Raises:
            FloatingPointError, ValueError, RuntimeError: several processes (see
            :class:`AllReduce`, :class:`Sharded`).
        """
        return None

    @abstractmethod
    def release(self, sums: Sums | None, terms: Terms) -> None:
        """Set ``p.grad = (sums + N(0, std^2 I)) / divisor`` for every parameter of
        ``terms``, in the parameter's dtype (Abadi et al. 2016).

        Args:
            sums: the step's sums (``None``: nothing accumulated: the noise alone); their
                memory may become ``p.grad``, so they are the reducer's after this.
            terms: the step's.
        """


class Accumulation(ABC):
    """One micro-batch's clipped sums on their way to the step's: a
    :class:`~persample.dp.microbatch.Destination` for :func:`~persample.dp.microbatch.clipped_sums`,
    then :meth:`commit` once the micro-batch is complete (a failed micro-batch is never
    committed: the step's sums stay as they were). :class:`Local`'s example uses one.
    """

    groups: list[list[int]]

    def check(self, norms: Tensor) -> None:
        """Refuse non-finite ``(n,)`` norms before anything is summed."""
        check_finite(norms)

    @abstractmethod
    def make(self, group: list[int]) -> dict[int, Tensor]:
        """The memory the sums of ``group`` (parameter ids) are added into, ``{id(p):
        tensor}`` of ``p``'s shape in the dtype sums accumulate in, initialised."""

    def flush(self, sums: dict[int, Tensor]) -> None:
        """The group's sums, complete (kept where they are until :meth:`commit`)."""
        return None

    @abstractmethod
    def commit(self) -> Sums:
        """The step's sums with this micro-batch's added (the first micro-batch's: the
        memory :meth:`make` gave, as it is)."""


def reducer_for(model: nn.Module, timeout: timedelta, *, one_call: bool = False) -> Reducer:
    """The reducer of a step of ``model``: :class:`Sharded` for FSDP2, :class:`AllReduce`
    where ``torch.distributed`` is initialised (unless ``one_call``: the single call of
    ``private_grad``, whose sums are this process's), else :class:`Local`.

    Args:
        model: the module (a ``DistributedDataParallel`` already unwrapped).
        timeout: how long the ranks wait for each other (gloo).
        one_call: one micro-batch released at once: the noise is drawn into the sums as
            they are made.

    Returns:
        The reducer, for the step's lifetime.

    Raises:
        ValueError: ``model`` is or contains an FSDP1 ``FullyShardedDataParallel``.

    Examples:
        >>> from datetime import timedelta
        >>> net = nn.Linear(3, 2)
        >>> reducer = reducer_for(net, timedelta(seconds=300))
        >>> type(reducer).__name__, list(reducer.trainable(net))
        ('Local', ['weight', 'bias'])
    """
    units = fsdp_units(model)
    if units:
        return Sharded(Sharding(model, units), timeout)
    if one_call:
        return Local(noise_first=True)
    if world() is not None:
        return AllReduce(timeout)
    return Local()


def world() -> tuple[int, int] | None:
    """``(world size, rank)`` when ``torch.distributed`` is initialised, else ``None``.

    Examples:
        >>> world() is None  # no process group here
        True
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def total_samples(model: nn.Module, n: int) -> int:
    """``private_grad``'s default divisor: ``n``, or for a model sharded with FSDP2 the
    samples of every rank (one all-reduce, so every rank calls it alike).

    Args:
        model: the module.
        n: this process's samples.

    Returns:
        The number of samples of the step.

    Examples:
        >>> total_samples(nn.Linear(3, 2), 16)
        16
    """
    if not fsdp_units(model) or world() is None:
        return n
    total = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def _write_grads(terms: Terms, tensors: Iterable[Tensor],
                 as_grad: Callable[[nn.Parameter, Tensor], Tensor] | None = None) -> None:
    """``p.grad = tensor / divisor`` for each parameter of ``terms`` (the tensors in their
    order, the step's own memory, divided in place), in the parameter's dtype as
    autograd gives it (``as_grad(p, tensor)``: FSDP2's sharded ``DTensor``). The one
    place ``p.grad`` is written; ``tensors`` may be drawn lazily, one at a time (a list is
    divided by one ``_foreach_div_``: one call, and on a GPU a few kernels, for all)."""
    whole = isinstance(tensors, list)
    if whole and tensors:
        torch._foreach_div_(tensors, terms.divisor)
    for p, t in zip(terms.params.values(), tensors):
        t = t if whole else t.div_(terms.divisor)
        p.grad = t.to(p.dtype) if as_grad is None else as_grad(p, t)


# -- one process --------------------------------------------------------------------------


class Local(Reducer):
    """One process: the step's sums are one buffer of the parameters' size, made by the
    first micro-batch after its backward, that becomes ``p.grad`` at release.

    Args:
        noise_first: draw the release's noise into the buffer as it is made (the single
            call of ``private_grad``: the clipped sums are added to the noise, and the
            release only divides).

    Examples:
        >>> from persample.dp.microbatch import MicroBatch, clipped_sums
        >>> net = nn.Linear(3, 2)
        >>> x, y = torch.randn(4, 3), torch.randn(4, 2)
        >>> local = Local()
        >>> batch, n, params = local.begin(net, x, y, nn.MSELoss())
        >>> terms = Terms(local.trainable(net), std=0.0, generator=None, divisor=4.0)
        >>> into = local.micro_batch(None, params, terms)
        >>> from persample.dp.clipping import Clipping
        >>> losses, norms = clipped_sums(MicroBatch(net, batch, y, nn.MSELoss(), params),
        ...                              clipping=Clipping.flat(1.0).bound(list(params)), into=into)
        >>> local.release(into.commit(), terms)
        >>> net.weight.grad.shape
        torch.Size([2, 3])
    """

    def __init__(self, noise_first: bool = False) -> None:
        self.noise_first = noise_first

    def micro_batch(self, sums: Sums | None, params: dict[str, nn.Parameter], terms: Terms
                    ) -> Accumulation:
        """The first micro-batch's sums straight into the step's new buffer (zeros, or
        ``noise_first`` the noise); a later one's into a temporary."""
        if not self.noise_first:
            return _IntoWhole(sums, params, _zeros)
        return _IntoWhole(sums, params, lambda ps, buffers: gaussian_like(
            ps, terms.std, terms.generator, buffers, accumulate=True), noised=True)

    def release(self, sums: Sums | None, terms: Terms) -> None:
        """The noise added to the sums in place (or drawn into a new buffer where there
        are none of the step's own), divided in place: ``p.grad`` is that memory."""
        _write_grads(terms, _noised(sums, terms, []))


class _IntoWhole(Accumulation):
    """One micro-batch's sums of an unsharded model, in one group: the first of a step
    straight into the step's new sums (made by ``fill(params, buffers)``); a later one
    into a temporary, added to the sums at :meth:`commit`."""

    def __init__(self, sums: Sums | None, params: dict[str, nn.Parameter],
                 fill: Callable[[list[nn.Parameter], list[Tensor]], list[Tensor]],
                 noised: bool = False) -> None:
        self.sums, self.params, self.fill, self.noised = sums, params, fill, noised
        self.groups = [[id(p) for p in params.values()]]
        self.made: Sums | None = None

    def make(self, group: list[int]) -> dict[int, Tensor]:
        ps = list(self.params.values())
        buffers: list[Tensor] = []
        if self.sums is None:  # the step's sums, made now: after the backward
            tensors = self.fill(ps, buffers)
        else:  # a temporary: the sums change only once the micro-batch is complete
            tensors = _zeros(ps, [])
        self.made = Sums(dict(zip(self.params, tensors)), buffers, self.noised)
        return dict(zip(map(id, ps), tensors))

    def commit(self) -> Sums:
        if self.sums is None:
            return self.made
        for name, t in self.sums.tensors.items():
            t.add_(self.made.tensors[name])
        return self.sums


def _noised(sums: Sums | None, terms: Terms, buffers: list[Tensor]) -> list[Tensor]:
    """``sums + noise`` of each parameter of ``terms``, in its order, in buffers appended
    to ``buffers``: the sums' own, the noise added in place (if not in them already), or,
    for sums that have none (none accumulated, or loaded), a new buffer the noise is
    drawn into and the sums added to."""
    if sums is not None and sums.buffers:
        tensors = [sums.tensors[name] for name in terms.params]
        if terms.noise is not None:  # drawn into the mechanism's ring, settled, added
            names = list(terms.params)
            fill_gaussian([terms.noise.slot(name, t) for name, t in zip(names, tensors)],
                          terms.std, terms.generator)
            for name, tensor in zip(names, tensors):
                w, scale = terms.noise.settle(name)
                tensor.view(-1).add_(w, alpha=scale)
        elif not sums.noised:
            add_gaussian(tensors, terms.std, terms.generator)
        buffers += sums.buffers
        return tensors
    return _plus(_drawn(terms, buffers), sums, terms)


def _drawn(terms: Terms, buffers: list[Tensor]) -> list[Tensor]:
    """The release's noise of each parameter of ``terms``, in buffers appended to
    ``buffers``: the independent draw, correlated by the mechanism if there is one."""
    drawn = gaussian_like(list(terms.params.values()), terms.std, terms.generator, buffers,
                          accumulate=True)
    if terms.noise is not None:
        for name, z in zip(terms.params, drawn):
            terms.noise.correlate(name, z)
    return drawn


def _summed(sums: Sums | None, terms: Terms, buffers: list[Tensor]) -> list[Tensor]:
    """The sums alone, as :func:`_noised` lays them out (a rank that draws no noise)."""
    if sums is not None and sums.buffers:
        buffers += sums.buffers
        return [sums.tensors[name] for name in terms.params]
    return _plus(_zeros(list(terms.params.values()), buffers), sums, terms)


def _plus(grads: list[Tensor], sums: Sums | None, terms: Terms) -> list[Tensor]:
    """``grads`` (in the order of ``terms.params``) with ``sums`` added in place."""
    if sums is not None:
        for name, grad in zip(terms.params, grads):
            grad.add_(sums.tensors[name])
    return grads


def _zeros(params: list[nn.Parameter], buffers: list[Tensor]) -> list[Tensor]:
    """Zeros for ``params``' sums, views of pooled buffers appended to ``buffers``."""
    return pooled_like(params, _zero, buffers, accumulate=True)


def _zero(buffer: Tensor) -> None:
    buffer.zero_()


# -- several processes ----------------------------------------------------------------------


class AllReduce(Local):
    """Several processes (``torch.distributed``, any backend), each with its own samples:
    the sums of every rank, and rank 0's noise, summed by one all-reduce per buffer, so
    that every rank gets the same ``p.grad`` and the noise is added once.

    A non-finite gradient is not raised by ``accumulate`` (the other ranks would wait in
    the all-reduce) but at the release, on every rank, the step's sums dropped. Where the
    process group is gone by the time of a call, the step is this process's alone.

    Args:
        timeout: how long :meth:`agree` waits for every rank (gloo; NCCL's collectives
            time out as the process group was set up to).

    Examples:
        >>> import os, tempfile
        >>> from persample.dp import PrivateStep
        >>> store = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> net = nn.Linear(3, 2)
        >>> step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
        ...                    expected_batch_size=4, generator=torch.Generator().manual_seed(0))
        >>> type(step.reducer).__name__
        'AllReduce'
        >>> losses, norms = step.accumulate(torch.randn(4, 3), torch.randn(4, 2))
        >>> step.release()  # every rank's sums and rank 0's noise, one all-reduce
        >>> net.weight.grad.shape
        torch.Size([2, 3])
        >>> dist.destroy_process_group()
    """

    def __init__(self, timeout: timedelta) -> None:
        super().__init__()
        self.ranks = _Ranks(timeout)
        self.failure: str | None = None  # this rank's non-finite micro-batch, if any

    def failed(self, err: FloatingPointError, n: int) -> Accumulated:
        """Deferred to the release (the other ranks would wait in the all-reduce): the
        ``(n,)`` losses and norms are NaN."""
        ranks = world()
        if ranks is None:
            raise err
        self.failure = f"rank {ranks[1]}: {err}"  # every rank raises it at the release
        nan = torch.full((n,), float("nan"))
        return Accumulated(nan, nan)

    def agree(self, terms: Terms, drop: Callable[[], None]) -> None:
        """Every rank arrived (gloo: within the timeout) and holds the same parameters
        and divisor; a rank's non-finite gradient raises on every rank, the step's sums
        dropped."""
        self.ranks.arrive("release()")
        failure, self.failure = self.failure, None
        self.ranks.agree(terms, failure, drop=drop)

    def release(self, sums: Sums | None, terms: Terms) -> None:
        """Rank 0 adds the noise to its sums in place; every rank's buffers are summed by
        one all-reduce each and divided in place: ``p.grad``, the same on every rank."""
        ranks = world()
        buffers: list[Tensor] = []  # the 1-d buffers the new p.grad tensors view
        if ranks is None or ranks[1] == 0:  # the noise, drawn once
            tensors = _noised(sums, terms, buffers)
        else:
            tensors = _summed(sums, terms, buffers)
        if ranks is not None:
            for buffer in buffers:  # every rank's sums, plus rank 0's noise, once
                dist.all_reduce(buffer)
        _write_grads(terms, tensors)


class _Ranks:
    """The processes of one distributed step: they arrive together and agree before a
    reduction. Nothing to do where ``torch.distributed`` is not initialised."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def arrive(self, where: str) -> None:
        """Every rank reached ``where`` within the timeout (gloo's monitored barrier names
        the ones that did not; NCCL has none: its own timeout applies).

        Raises:
            RuntimeError: a rank did not arrive in time (named).
        """
        if world() is not None and dist.get_backend() == dist.Backend.GLOO:
            try:
                dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)
            except RuntimeError as err:
                raise RuntimeError(f"{where}: not every process arrived within "
                                   f"{self.timeout.total_seconds():.0f} s ({err})") from err

    def agree(self, terms: Terms, failed: str | None, *, sharded: bool = False,
              drop: Callable[[], None] | None = None) -> None:
        """Every rank checks that all ranks hold the same parameters and divisor (and,
        ``sharded``, noise generator), and that none saw a non-finite gradient
        (``failed``: this rank's description); ``drop()`` first where the step's sums are
        lost with it (several processes: a failure seen at the release).

        Raises:
            FloatingPointError: a rank's gradient was not finite (on every rank).
            ValueError: the ranks differ (on every rank), naming what and where.
        """
        ranks = world()
        if ranks is None:
            return
        size, rank = ranks
        mine = {"shapes": [(name, tuple(p.shape)) for name, p in terms.params.items()],
                "expected_batch_size": terms.divisor, "failed": failed,
                "noise": _stream(terms.generator), "users": terms.users}
        every: list[Any] = [None] * size
        dist.all_gather_object(every, mine)
        failures = [e["failed"] for e in every if e["failed"]]
        if failures:
            if drop is not None:
                drop()
            raise FloatingPointError(
                f"a per-sample gradient was not finite ({failures[0]}); p.grad was left "
                "unchanged on every rank and " + (
                    "nothing of this micro-batch was added on any rank" if sharded else
                    "this step's sums dropped") + ". Drop those samples and accumulate again.")
        for k, e in enumerate(every):
            _same(mine, e, rank, k, sharded)


def _same(mine: dict[str, Any], theirs: dict[str, Any], rank: int, k: int, sharded: bool
          ) -> None:
    """Rank ``rank``'s step (``mine``) against rank ``k``'s; raises ``ValueError``."""
    if theirs["expected_batch_size"] != mine["expected_batch_size"]:
        raise ValueError(
            f"expected_batch_size differs between ranks: {mine['expected_batch_size']}"
            f" on rank {rank}, {theirs['expected_batch_size']} on rank {k}: give every "
            "rank the logical batch's expected size (q * N)")
    if theirs["shapes"] != mine["shapes"]:
        other, ours = dict(theirs["shapes"]), dict(mine["shapes"])
        name = next((n for n in ours if other.get(n) != ours[n]), None) or next(
            n for n in other if n not in ours)
        raise ValueError(
            f"the ranks hold different models: parameter {name!r} is "
            f"{ours.get(name)} on rank {rank} and {other.get(name)} on rank {k}")
    shared = sorted(mine["users"] & theirs["users"]) if k != rank else []
    if shared:
        raise ValueError(
            f"user {shared[0]} has records on rank {rank} and rank {k}: a user's records of "
            "one logical batch must be on one process, so that its gradient is clipped as a "
            "whole; give each rank whole users")
    if sharded and theirs["noise"] != mine["noise"]:
        raise ValueError(
            f"the noise generator's state differs between rank {rank} and rank {k}: "
            "with a sharded model every rank draws the noise of its own shards from "
            "one stream, so give every rank the same generator, e.g. "
            "torch.Generator().manual_seed(seed) with the same seed")


def _stream(generator: torch.Generator | SecureSource | None) -> str:
    """A digest of the noise generator's state (torch's default CPU one for ``None``;
    ``secure_mode``'s source has none)."""
    if isinstance(generator, SecureSource):
        return "secure_mode"
    state = (generator.get_state() if generator is not None else torch.get_rng_state())
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()


# -- FSDP2 ----------------------------------------------------------------------------------


class Sharded(Reducer):
    """A model sharded with FSDP2 (``fully_shard`` per block and at the root): each rank
    keeps the sums of its shards, never the whole model's.

    Each micro-batch's clipped sums are computed one FSDP unit at a time and
    reduce-scattered over FSDP's process group as each unit completes; the ranks agree
    (shapes, divisor, noise generator, finiteness) before each reduction, so every rank
    calls ``accumulate`` and ``release`` alike. The release adds to each shard its part
    of the release's noise, drawn from a counter-based stream (one seed per release,
    the same on every rank; :mod:`persample.dp.noise`), and writes ``p.grad`` as a
    ``DTensor`` sharded as the parameter, in its dtype.

    Args:
        sharding: the model's parameters in their two forms
            (:class:`~persample.sharded.Sharding`).
        timeout: how long the ranks wait for each other (gloo).

    Examples:
        >>> import os, tempfile
        >>> from torch.distributed.fsdp import fully_shard
        >>> from persample.dp import PrivateStep
        >>> store = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
        ...                         world_size=1)
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> _ = fully_shard(net[0]), fully_shard(net)  # a unit per block, then the root
        >>> step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
        ...                    expected_batch_size=4, generator=torch.Generator().manual_seed(0))
        >>> type(step.reducer).__name__
        'Sharded'
        >>> losses, norms = step.accumulate(torch.randn(4, 3), torch.randn(4, 2))
        >>> step.release()
        >>> type(net[0].weight.grad).__name__  # sharded as the parameter
        'DTensor'
        >>> dist.destroy_process_group()

    Source: Zhao et al. 2023 (PyTorch FSDP); Salmon et al. 2011 (counter-based noise).
    """

    def __init__(self, sharding: Sharding, timeout: timedelta) -> None:
        self.sharding = sharding
        self.ranks = _Ranks(timeout)

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters as the optimizer holds them (``DTensor`` shards)."""
        found = Sharding(model, self.sharding.units).sharded
        if not found:
            checks.trainable_parameters(model)  # raises: nothing to differentiate
        return found

    def begin(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable
              ) -> tuple[Batch, int, dict[str, nn.Parameter]]:
        """As :meth:`Reducer.begin`, every rank arrived, the rules only.

        Raises:
            ValueError: ``torch.distributed`` is not initialised.
            RuntimeError: a rank did not arrive within the timeout.
        """
        if world() is None:
            raise ValueError("the model is sharded with FSDP2 but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group first")
        self.ranks.arrive("accumulate()")
        return checks.validate_call(model, inputs, targets, loss_fn, "rules", None)

    def micro_batch(self, sums: Sums | None, params: dict[str, nn.Parameter], terms: Terms
                    ) -> Accumulation:
        """One unit's sums in full at a time, reduce-scattered to the shards."""
        return _IntoShards(self, sums, params, terms)

    def agree(self, terms: Terms, drop: Callable[[], None]) -> None:
        """Every rank arrived and holds the same parameters, divisor and generator."""
        self.ranks.arrive("release()")
        self.ranks.agree(terms, None, sharded=True)

    def release(self, sums: Sums | None, terms: Terms) -> None:
        """One seed from the generator; each shard's part of its noise plus the shard's
        sums, divided: ``p.grad`` as a ``DTensor``, one parameter at a time."""
        secure = isinstance(terms.generator, SecureSource)
        seed = None if secure else release_seed(terms.generator)
        _write_grads(terms, self._noised(sums, terms, seed), as_sharded_grad)

    def _noised(self, sums: Sums | None, terms: Terms, seed: int | None) -> Iterator[Tensor]:
        """Each parameter's shard of ``sums + noise``, one at a time (the noise of the
        release ``seed``: this rank's blocks of it; ``None``: ``secure_mode``'s)."""
        for index, (name, p) in enumerate(terms.params.items()):
            local = self.sharding.local_like(name, accumulate_dtype(p.dtype))
            _shard_noise(self.sharding, name, local, terms.std, seed, index)
            if terms.noise is not None:  # each shard's draws correlated where they are
                terms.noise.correlate(name, local)
            if sums is not None:
                local.add_(sums.tensors[name])
            yield local


class _IntoShards(Accumulation):
    """One micro-batch's sums of an FSDP2 model: one unit's in full at a time, each
    reduce-scattered to the shards once complete; the shards' sums added to the step's
    at :meth:`commit`."""

    def __init__(self, reducer: Sharded, sums: Sums | None,
                 params: dict[str, nn.Parameter], terms: Terms) -> None:
        self.sharding, self.ranks = reducer.sharding, reducer.ranks
        self.sums, self.params, self.terms = sums, params, terms
        self.groups = self.sharding.groups()
        self.names = {id(p): name for name, p in params.items()}
        self.staged: dict[str, Tensor] = {}  # name -> this rank's shard of the sum

    def check(self, norms: Tensor) -> None:
        """Every rank's norms finite (agreed before anything is reduced).

        Raises:
            FloatingPointError: on every rank, naming the rank and its samples.
        """
        bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        mine = f"rank {world()[1]}: samples {bad[:10]} are not finite" if bad else None
        self.ranks.agree(self.terms, mine, sharded=True)

    def make(self, group: list[int]) -> dict[int, Tensor]:
        ps = [self.params[self.names[pid]] for pid in group]
        return dict(zip(group, _zeros(ps, [])))

    def flush(self, sums: dict[int, Tensor]) -> None:
        self.staged.update(reduce_to_shards(self.sharding,
                                            {self.names[k]: t for k, t in sums.items()}))

    def commit(self) -> Sums:
        if self.sums is not None:
            for name, t in self.staged.items():
                self.sums.tensors[name].add_(t)
            return self.sums
        return Sums({name: self._first(name, p) for name, p in self.terms.params.items()})

    def _first(self, name: str, p: nn.Parameter) -> Tensor:
        """The step's sums of ``name`` from its first micro-batch: the shard reduced to
        this rank as it is (no second copy), in the dtype the sums accumulate in."""
        dtype = accumulate_dtype(p.dtype)
        got = self.staged.get(name)
        if got is not None and got.dtype == dtype:
            return got
        sums = self.sharding.local_like(name, dtype)
        return sums if got is None else sums.add_(got)


def _shard_noise(sharding: Sharding, name: str, local: Tensor, std: float, seed: int | None,
                 index: int) -> None:
    """Fill ``local`` (``sharding.local_like(name, ...)``) with this rank's part of the
    noise of parameter ``index`` of the release ``seed`` (:mod:`persample.dp.noise`): for
    a shard of rows, only the blocks of the rows it holds are drawn. ``seed=None``
    (``secure_mode``): rank 0 draws the parameter's noise and broadcasts it."""
    p, fp = sharding.sharded[name], sharding.fsdp.get(name)
    if seed is not None and fp is not None and fp.fsdp_placement.dim == 0:  # a row range
        start = shard_rows(fp)[0] * p.shape[1:].numel()
        noise_range(local.view(-1), std, seed, index, start, p.numel())
        return
    full = torch.empty(p.numel(), dtype=local.dtype, device=local.device)
    if seed is not None:
        noise_range(full, std, seed, index, 0, p.numel())
    else:  # secure_mode: rank 0's draw, the same on every rank
        if dist.get_rank() == 0:
            full.copy_(secure_normal(p.numel(), std, full.dtype, full.device))
        dist.broadcast(full, src=0)
    full = full.view(p.shape)
    if fp is not None:
        start, length = shard_rows(fp)
        full = full.narrow(fp.fsdp_placement.dim, start, length)
    local.copy_(full)
