"""DP-SGD steps over logical batches larger than memory: accumulate, then release.

A logical batch (thousands of samples, so that the noise divided by the batch size
is small) is processed as physical micro-batches: each :meth:`PrivateStep.accumulate`
adds its samples' clipped gradients ``sum_i c_i g_i`` to sums kept in the object (the
same book-keeping as :func:`persample.dp.private_grad`: one forward and one backward,
no ``(B, P)`` tensor); :meth:`PrivateStep.release` adds the Gaussian noise once,
divides by the expected batch size and writes ``p.grad``. Opacus calls this virtual
steps (``BatchMemoryManager``); Abadi et al. 2016 describe lots of size ``L`` split
into smaller groups. The state (the sums, the samples counted, the versions of the
parameters the sums were computed at, the noise generator) lives in the object,
never on the model, with ``state_dict`` / ``load_state_dict`` for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..precision import accumulate_dtype
from ..sharded import Sharding, as_sharded_grad, fsdp_units, reduce_to_shards, shard_rows
from .accounting import PrivacyAccountant
from .clip import _add_clipped_sums, _check_dp_options
from .noise import gaussian_like, noise_range, pooled_like, release_seed


class PrivateStep:
    """One DP-SGD step's gradient from any number of micro-batches.

    ``accumulate(inputs, targets)`` adds ``sum_i c_i g_i`` of its samples (``g_i``
    sample ``i``'s own gradient, ``c_i = min(1, C / (||g_i|| + 1e-6))``) to the
    step's sums; ``release()`` sets ``p.grad = (sums + N(0, sigma^2 C^2 I)) /
    expected_batch_size`` for every trainable parameter and resets the sums. Micro-
    batches accumulated then released give what ``private_grad`` gives on their
    concatenation (to rounding).

    Args:
        model: the ``nn.Module``; its trainable parameters at construction are the
            step's (``named_parameters()`` order). Nothing is stored on it.
        loss_fn: ``loss_fn(output, targets)``, per-sample ``(b,)`` or a scalar (see
            ``per_sample_grads``).
        max_grad_norm: the clipping norm ``C > 0`` (loss units per parameter unit).
        noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * C``.
        expected_batch_size: ``B' > 0``, the divisor: with Poisson sampling ``q * N``
            (the logical batch's expected size), so that it does not depend on the data.
        generator: ``torch.Generator`` (on the parameters' device) for the noise.
        per_layer: clip each parameter's gradient to ``C / sqrt(K)`` instead of the
            whole gradient to ``C``.
        timeout: seconds :meth:`release` waits for the other processes (distributed,
            gloo; with NCCL the process group's own timeout applies).
        sample_rate: ``q`` in ``(0, 1]``, the Poisson sampling rate of the logical
            batches: each :meth:`release` then records one step of ``(sigma, q)`` in
            :attr:`accountant`, and :meth:`epsilon` is the privacy spent so far. Without
            it nothing is accounted (as before).
        accountant: ``"rdp"`` (default), ``"pld"``, ``"prv"`` or a
            :class:`~persample.dp.PrivacyAccountant` to continue (its steps so far
            count); only with ``sample_rate``.
        loss_reduction: deprecated, no effect (each sample's own loss is evaluated).

    Distributed (``torch.distributed`` initialised, any backend; gloo on CPUs, NCCL on
    GPUs): every process accumulates its own samples; ``release()`` sums the clipped
    sums of all processes with one all-reduce into which rank 0 has added the noise
    (drawn from rank 0's generator), so the noise is added exactly once, no second
    collective is needed, and every rank gets the same ``p.grad``. The model may be
    wrapped in ``DistributedDataParallel``: its module is used directly, so DDP's own
    gradient all-reduce never runs. Before reducing, the ranks compare their
    parameter shapes and ``expected_batch_size`` and whether any saw a non-finite
    gradient (``accumulate`` then defers its ``FloatingPointError`` to ``release``,
    where every rank raises it): a mismatch is an error on every rank with ``p.grad``
    unchanged; a rank that does not arrive within ``timeout`` is named in the error (gloo's
    monitored barrier; NCCL has none, and its collectives time out as the process group
    was set up to).
    With ``sample_rate`` every rank's accountant records each release alike.

    Sharded with FSDP2 (``fully_shard`` per block and at the root): each ``accumulate``
    computes its samples' clipped sums one FSDP unit at a time and reduce-scatters them
    over FSDP's process group (each rank keeps the sums of its shards: never the whole
    model's); the ranks agree (shapes, ``expected_batch_size``, generator, finiteness)
    before each reduction, so every rank calls ``accumulate`` and ``release`` alike.
    ``release()`` adds to each shard its part of the noise, drawn from a counter-based
    stream (one seed per release from ``generator``, the same on every rank; blocks of
    2^20 entries per parameter seeded by ``(seed, parameter, block)``): the noise is the
    one a single process draws from that seed, whatever the number of ranks. ``p.grad``
    is a ``DTensor`` sharded as the parameter, in its dtype (``MixedPrecisionPolicy``:
    the sums in float32), for the optimizer on the sharded model. FSDP1 is refused.

    Raises:
        ValueError: ``max_grad_norm <= 0``, ``noise_multiplier < 0``, a bad
            ``expected_batch_size``, ``sample_rate`` outside ``(0, 1]``, an
            ``accountant`` without ``sample_rate`` or of an unknown kind, a model without trainable
            parameters, a model wrapped in FSDP1's ``FullyShardedDataParallel`` (the
            message names ``fully_shard`` as the fix).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from persample.dp import PrivateStep
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> step = PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=1.0,
        ...                    noise_multiplier=1.1, expected_batch_size=64,
        ...                    generator=torch.Generator().manual_seed(0))
        >>> for _ in range(4):  # a logical batch of 64 in micro-batches of 16
        ...     x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        ...     norms = step.accumulate(x, y)  # (16,) norms before clipping
        >>> step.release()
        >>> opt.step()
        >>> net[0].weight.grad.shape, step.samples
        (torch.Size([8, 4]), 0)
        >>> step = PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=1.0,
        ...                    noise_multiplier=1.1, expected_batch_size=64, sample_rate=0.064)
        >>> for _ in range(3):
        ...     _ = step.accumulate(torch.randn(64, 4), torch.randint(0, 3, (64,)))
        ...     step.release()
        >>> step.accountant.steps, 0 < step.epsilon(delta=1e-5) < 10
        (3, True)

    Source: Abadi et al. 2016 (DP-SGD, lots); Bu et al. 2023 (book-keeping); Opacus's
    virtual steps; Zhao et al. 2023 (PyTorch FSDP).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], *,
                 max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                 generator: torch.Generator | None = None, per_layer: bool = False,
                 timeout: float = 300.0, loss_reduction: str | None = None,
                 sample_rate: float | None = None,
                 accountant: str | PrivacyAccountant | None = None) -> None:
        _check_dp_options(max_grad_norm, noise_multiplier, expected_batch_size)
        self.sample_rate, self.accountant = _accounting(sample_rate, accountant)
        if expected_batch_size is None:
            raise ValueError("expected_batch_size is required: the divisor of the noised sum "
                             "(q * N with Poisson sampling)")
        checks.check_loss_reduction(loss_reduction)
        checks.check_loss_fn(loss_fn, None)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # its own gradient all-reduce must not run: release reduces
        units = fsdp_units(model)
        self.sharding = Sharding(model, units) if units else None  # FSDP2
        self.model, self.loss_fn = model, loss_fn
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.generator, self.per_layer = generator, per_layer
        self.params = self._trainable()  # name -> parameter (sharded: the DTensor)
        self.sums: dict[str, Tensor] | None = None  # allocated at the first accumulate
        self.samples = 0  # accumulated since the last release
        self.versions: dict[str, int] = {}  # each parameter's _version at the first accumulate
        self.timeout = timedelta(seconds=timeout)
        self.failed: str | None = None  # distributed: a non-finite sample, raised at release

    def accumulate(self, inputs: Any, targets: Any) -> Tensor:
        """Add one micro-batch's clipped per-sample gradients to the step's sums.

        Args:
            inputs, targets: as for ``per_sample_grads``; ``b`` samples (0 is fine).

        Returns:
            ``(b,)`` per-sample gradient norms before clipping (over all parameters),
            in at least float32 (the sums accumulate there too).

        Raises:
            ValueError: the model's trainable parameters are not those of the step
                (added, removed, replaced, reshaped), or one was modified (an
                optimizer step) since the first micro-batch of this step: the message
                names it; release first. And the errors of ``private_grad``; the sums
                are then left as they were.
            FloatingPointError: a sample's gradient is not finite (nothing is added).
        """
        self._check_parameters()
        if self.sharding is not None:
            return self._accumulate_sharded(inputs, targets)
        batch, n, _ = checks.validate_call(self.model, inputs, targets, self.loss_fn, "auto",
                                          None, None)
        params = list(self.params.values())
        if self.sums is None:
            self.sums = dict(zip(self.params, pooled_like(params, lambda b: b.zero_(),
                                                          accumulate=True)))
        def zeros(group: list[int]) -> dict[int, Tensor]:
            return dict(zip(map(id, params), pooled_like(params, lambda b: b.zero_(),
                                                         accumulate=True)))

        into: dict[int, Tensor] = {}
        try:
            with checks.kept_buffers(self.model):
                norms = _add_clipped_sums(self.model, batch, targets, self.loss_fn,
                                          self.params, self.max_grad_norm,
                                          self.per_layer, zeros, into.update)
        except FloatingPointError as err:
            if _world() is None:
                raise
            self.failed = f"rank {_world()[1]}: {err}"  # every rank raises it at release
            return torch.full((n,), float("nan"))
        for name, p in self.params.items():  # only once the whole micro-batch succeeded
            self.sums[name].add_(into[id(p)])
        if not self.versions:
            self.versions = {name: p._version for name, p in self.params.items()}
        self.samples += n
        return norms

    def release(self) -> None:
        """Set ``p.grad = (sums + N(0, sigma^2 C^2 I)) / expected_batch_size`` for every
        trainable parameter of the step (overwriting it), then reset the sums.

        With nothing accumulated (Poisson sampling can draw an empty logical batch)
        ``p.grad`` is the noise alone, divided alike. Then step any optimizer.
        """
        params = list(self.params.values())
        world = _world()
        if world is not None:
            self._arrived("release()")
            self._agree(world)
        if self.sharding is not None:
            self._release_sharded()
            return self._account()
        blocks: list[Tensor] = []  # the 1-d blocks the new p.grad tensors view
        if world is None or world[1] == 0:  # the noise, drawn once (rank 0 when distributed)
            grads = gaussian_like(params, self.noise_multiplier * self.max_grad_norm,
                                  self.generator, blocks, accumulate=True)
        else:
            grads = pooled_like(params, lambda b: b.zero_(), blocks, accumulate=True)
        for name, grad in zip(self.params, grads):
            if self.sums is not None:
                grad.add_(self.sums[name])
        if world is not None:
            import torch.distributed as dist

            for block in blocks:  # every rank's sums, plus rank 0's noise, once
                dist.all_reduce(block)
        for p, grad in zip(params, grads):  # in the parameter's dtype, as autograd gives it
            p.grad = grad.div_(self.expected_batch_size).to(p.dtype)
        self.sums, self.samples, self.versions = None, 0, {}
        self._account()

    def _account(self) -> None:
        """One release done: one step of ``(sigma, q)`` for the accountant, if any."""
        if self.accountant is not None:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    def epsilon(self, delta: float) -> float:
        """The privacy spent by the releases so far: epsilon at ``delta`` (0 before the
        first), from :attr:`accountant` (Abadi et al. 2016's moments accountant as RDP,
        Mironov 2017; or PLD, PRV).

        Raises:
            ValueError: the step was made without ``sample_rate`` (nothing is
                accounted), or ``delta`` outside ``(0, 1)``.
        """
        if self.accountant is None:
            raise ValueError("this PrivateStep accounts nothing: pass sample_rate=q (the "
                             "Poisson sampling rate) to PrivateStep to have each release "
                             "accounted")
        return self.accountant.epsilon(delta)

    def _trainable(self) -> dict[str, nn.Parameter]:
        """The trainable parameters by name (sharded: as the optimizer holds them)."""
        if self.sharding is None:
            return checks.trainable_parameters(self.model)
        found = Sharding(self.model, self.sharding.units).sharded
        if not found:
            checks.trainable_parameters(self.model)  # raises: nothing to differentiate
        return found

    def _accumulate_sharded(self, inputs: Any, targets: Any) -> Tensor:
        """``accumulate`` on an FSDP2 model: this rank's clipped sums, unit by unit,
        reduce-scattered to the shards (every rank calls it alike)."""
        world = _world()
        if world is None:
            raise ValueError("the model is sharded with FSDP2 but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group first")
        self._arrived("accumulate()")
        batch, n, working = checks.validate_call(self.model, inputs, targets, self.loss_fn,
                                                "rules", None, None)
        sharding = self.sharding
        names = {id(p): name for name, p in working.items()}
        groups = sharding.groups()
        if self.sums is None:
            self.sums = {name: sharding.local_like(name, accumulate_dtype(p.dtype))
                         for name, p in self.params.items()}
        staged: dict[str, Tensor] = {}

        def make(group: list[int]) -> dict[int, Tensor]:
            ps = [working[names[pid]] for pid in group]
            return dict(zip(group, pooled_like(ps, lambda b: b.zero_(), accumulate=True)))

        def flush(into: dict[int, Tensor]) -> None:
            staged.update(reduce_to_shards(sharding, {names[k]: t for k, t in into.items()}))

        def checked(norms: Tensor) -> None:
            bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
            mine = f"rank {world[1]}: samples {bad[:10]} are not finite" if bad else None
            self._agree(world, mine)

        with checks.kept_buffers(self.model):
            norms = _add_clipped_sums(self.model, batch, targets, self.loss_fn, working,
                                      self.max_grad_norm, self.per_layer, make, flush,
                                      groups, checked)
        for name, t in staged.items():
            self.sums[name].add_(t)
        if not self.versions:
            self.versions = {name: p._version for name, p in self.params.items()}
        self.samples += n
        return norms

    def _release_sharded(self) -> None:
        """``release`` on an FSDP2 model: each rank adds the noise of its own shards (the
        blocks of the release's noise that fall in them) and writes ``p.grad`` as the
        sharded ``DTensor`` FSDP gives."""
        std = self.noise_multiplier * self.max_grad_norm
        seed = release_seed(self.generator)
        for index, (name, p) in enumerate(self.params.items()):
            local = self.sharding.local_like(name, accumulate_dtype(p.dtype))
            _shard_noise(self.sharding, name, local, std, seed, index)
            if self.sums is not None:
                local.add_(self.sums[name])
            p.grad = as_sharded_grad(p, local.div_(self.expected_batch_size))
        self.sums, self.samples, self.versions = None, 0, {}

    def _arrived(self, where: str) -> None:
        """Every rank reached ``where`` within the timeout (gloo's monitored barrier names
        the ones that did not; NCCL has none: its own timeout applies)."""
        import torch.distributed as dist

        if dist.get_backend() == dist.Backend.GLOO:
            try:
                dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)
            except RuntimeError as err:
                raise RuntimeError(f"{where}: not every process arrived within "
                                   f"{self.timeout.total_seconds():.0f} s ({err})") from err

    def _agree(self, world: tuple[int, int], failed: str | None = None) -> None:
        """Every rank checks that all ranks hold the same parameters and divisor (and,
        sharded, noise generator), and that none saw a non-finite gradient (``failed``:
        this rank's, in a sharded ``accumulate``); raises on every rank if not."""
        import torch.distributed as dist

        size, rank = world
        mine = {"shapes": [(name, tuple(p.shape)) for name, p in self.params.items()],
                "expected_batch_size": self.expected_batch_size,
                "failed": failed or self.failed, "noise": _stream(self.generator)}
        every: list[Any] = [None] * size
        dist.all_gather_object(every, mine)
        failed = [e["failed"] for e in every if e["failed"]]
        if failed:
            kept = self.sharding is not None  # (sharded: before this micro-batch is added)
            if not kept:
                self.sums, self.samples, self.versions = None, 0, {}
            self.failed = None
            raise FloatingPointError(
                f"a per-sample gradient was not finite ({failed[0]}); p.grad was left "
                "unchanged on every rank and " + (
                    "nothing of this micro-batch was added on any rank" if kept else
                    "this step's sums dropped") + ". Drop those samples and accumulate again.")
        for k, e in enumerate(every):
            if e["expected_batch_size"] != mine["expected_batch_size"]:
                raise ValueError(
                    f"expected_batch_size differs between ranks: {mine['expected_batch_size']}"
                    f" on rank {rank}, {e['expected_batch_size']} on rank {k}: give every "
                    "rank the logical batch's expected size (q * N)")
            if e["shapes"] != mine["shapes"]:
                theirs, ours = dict(e["shapes"]), dict(mine["shapes"])
                name = next((n for n in ours if theirs.get(n) != ours[n]), None) or next(
                    n for n in theirs if n not in ours)
                raise ValueError(
                    f"the ranks hold different models: parameter {name!r} is "
                    f"{ours.get(name)} on rank {rank} and {theirs.get(name)} on rank {k}")
            if self.sharding is not None and e["noise"] != mine["noise"]:
                raise ValueError(
                    f"the noise generator's state differs between rank {rank} and rank {k}: "
                    "with a sharded model every rank draws the noise of its own shards from "
                    "one stream, so give every rank the same generator, e.g. "
                    "torch.Generator().manual_seed(seed) with the same seed")

    def state_dict(self) -> dict[str, Any]:
        """The step's state for a checkpoint: the sums (``{name: tensor}`` or ``None``),
        the samples accumulated and the noise generator's state (``None`` without a
        generator). Tensors are the step's own (clone them
        to keep a copy that later calls do not change).

        Example:
            >>> net = nn.Linear(2, 1)
            >>> step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
            ...                    expected_batch_size=8)
            >>> sorted(step.state_dict())
            ['generator', 'samples', 'sums']
        """
        state = {"sums": self.sums, "samples": self.samples,
                 "generator": None if self.generator is None else self.generator.get_state()}
        if self.accountant is not None:  # the steps released so far
            state["accountant"] = self.accountant.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (the same model's parameter names and shapes).

        Raises:
            ValueError: the sums' names or shapes are not the step's parameters'.
        """
        sums = state["sums"]
        if sums is not None:
            for name, p in self.params.items():
                if name not in sums or sums[name].shape != p.shape:
                    raise ValueError(
                        f"the saved sums do not match parameter {name!r} of shape "
                        f"{tuple(p.shape)}: load the state of a step of the same model")
            if set(sums) != set(self.params):
                raise ValueError(f"the saved sums have other parameters: "
                                 f"{sorted(set(sums) - set(self.params))}")
            sums = {name: t.to(self.params[name]).clone() for name, t in sums.items()}
        self.sums, self.samples = sums, int(state["samples"])
        self.versions = {}  # the weights were loaded with the checkpoint: compare from now
        if state.get("generator") is not None and self.generator is not None:
            self.generator.set_state(state["generator"])
        if self.accountant is not None and state.get("accountant") is not None:
            self.accountant.load_state_dict(state["accountant"])

    def _check_parameters(self) -> None:
        """The model's trainable parameters are still the step's, and unchanged since the
        first micro-batch of this step."""
        now = self._trainable()
        for name, p in self.params.items():
            q = now.get(name)
            if q is not p:
                raise ValueError(
                    f"parameter {name!r} is no longer the one this PrivateStep was made for "
                    "(removed, replaced or frozen): make a new PrivateStep for the new model")
            if name in self.versions and p._version != self.versions[name]:
                raise ValueError(
                    f"parameter {name!r} was modified since this step's first micro-batch "
                    "(an optimizer step?): its sums would mix gradients at different "
                    "weights. Call release() and optimizer.step() only after the last "
                    "micro-batch of a logical batch")
        extra = sorted(set(now) - set(self.params))
        if extra:
            raise ValueError(f"parameter {extra[0]!r} is trainable but not part of this "
                             "PrivateStep: make a new PrivateStep for the new model")


def _accounting(sample_rate: float | None, accountant: str | PrivacyAccountant | None
                ) -> tuple[float | None, PrivacyAccountant | None]:
    """``(q, accountant)`` for :class:`PrivateStep` (``(None, None)``: no accounting)."""
    if sample_rate is None:
        if accountant is not None:
            raise ValueError("accountant= needs sample_rate= (the Poisson sampling rate q "
                             "of the logical batches): each release is one step of (sigma, q)")
        return None, None
    if not (isinstance(sample_rate, (int, float)) and not isinstance(sample_rate, bool)
            and 0 < sample_rate <= 1):
        raise ValueError(f"sample_rate (the Poisson sampling rate q) must be in (0, 1], "
                         f"got {sample_rate!r}")
    if isinstance(accountant, PrivacyAccountant):
        return float(sample_rate), accountant
    return float(sample_rate), PrivacyAccountant(accountant or "rdp")


def _shard_noise(sharding: Sharding, name: str, local: Tensor, std: float, seed: int,
                 index: int) -> None:
    """Fill ``local`` (``sharding.local_like(name, ...)``) with this rank's part of the
    noise of parameter ``index`` of the release ``seed`` (:mod:`persample.dp.noise`): for
    a shard of rows, only the blocks of the rows it holds are drawn."""
    p, fp = sharding.sharded[name], sharding.fsdp.get(name)
    if fp is not None and fp.fsdp_placement.dim == 0:  # rows: a contiguous range
        start = shard_rows(fp)[0] * p.shape[1:].numel()
        noise_range(local.view(-1), std, seed, index, start, p.numel())
        return
    full = torch.empty(p.numel(), dtype=local.dtype, device=local.device)
    noise_range(full, std, seed, index, 0, p.numel())
    full = full.view(p.shape)
    if fp is not None:
        start, length = shard_rows(fp)
        full = full.narrow(fp.fsdp_placement.dim, start, length)
    local.copy_(full)


def _stream(generator: torch.Generator | None) -> str:
    """A digest of the noise generator's state (torch's default CPU one for ``None``)."""
    import hashlib

    state = (generator.get_state() if generator is not None else torch.get_rng_state())
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()


def _world() -> tuple[int, int] | None:
    """``(world size, rank)`` when ``torch.distributed`` is initialised, else ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None

