"""DP-SGD steps: :class:`PrivateStep` over micro-batches, and :func:`private_grad`, its
single call.

A logical batch (thousands of samples, so that the noise divided by the batch size
is small) is processed as physical micro-batches: each :meth:`PrivateStep.accumulate`
adds its samples' clipped gradients ``sum_i c_i g_i`` to sums kept in the object (the
book-keeping of :mod:`persample.dp.microbatch`: one forward and one backward, no ``(B, P)``
tensor); :meth:`PrivateStep.release` adds the Gaussian noise once, divides by the
expected batch size and writes ``p.grad``, through the step's reducer
(:mod:`persample.dp.reduce`: one process, several, or FSDP2). Opacus calls this
virtual steps (``BatchMemoryManager``); Abadi et al. 2016 describe lots of size ``L``
split into smaller groups. :func:`private_grad` is one step of one micro-batch,
released at once. The state (the sums, the samples counted, the versions of the
parameters the sums were computed at, the noise generator) lives in the object,
never on the model, with ``state_dict`` / ``load_state_dict`` for checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from .. import checks
from ..certificate import check_option
from ..sharded import fsdp_units
from .accounting import PrivacyAccountant
from .adaptive import AdaptiveClipping, unclipped_count
from .clipping import Clipping
from .mechanisms import CorrelatedNoise, Mechanism, check_mechanism, check_sampling, release_runs
from .microbatch import Accumulated, MicroBatch, clipped_sums, refuse_capture
from .noise import noise_source
from .reduce import Local, Reducer, Sums, Terms, reducer_for, total_samples


class PrivateStep:
    """One DP-SGD step's gradient from any number of micro-batches.

    ``accumulate(inputs, targets)`` adds ``sum_i c_i g_i`` of its samples (``g_i``
    sample ``i``'s own gradient, ``c_i = min(1, C / (||g_i|| + 1e-6))``) to the
    step's sums; ``release()`` sets ``p.grad = (sums + N(0, sigma^2 C^2 I)) /
    expected_batch_size`` for every trainable parameter and resets the sums. Micro-
    batches accumulated then released give what ``private_grad`` gives on their
    concatenation (to rounding). One process holds one buffer of the parameters' size
    for the sums (made after the first micro-batch's backward; it becomes ``p.grad`` at
    release) and, while a later micro-batch is summed, a second (so that a failed
    micro-batch adds nothing).

    Args:
        model: the ``nn.Module``; its trainable parameters at construction are the
            step's (``named_parameters()`` order). Nothing is stored on it.
        loss_fn: ``loss_fn(output, targets)``, per-sample ``(b,)`` or a scalar (see
            ``per_sample_grads``).
        clipping: how each sample's gradient is clipped, a
            :class:`~persample.dp.Clipping` (``Clipping.flat(C)``, ``.layerwise(C)``,
            ``.grouped([C_g], groups)``, ``.automatic()``, ``Clipping.flat(C,
            adaptive=...)``); the kinds, their sensitivity ``S`` and their sources:
            :mod:`persample.dp.clipping`. Or the shorthand keywords:
        max_grad_norm: the clipping norm ``C > 0`` (loss units per parameter unit), for
            ``Clipping.flat(C)`` (Opacus's name); with the keywords below, a list of
            norms ``C_g`` (``param_groups``) or ``"automatic"``.
        noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * S`` (``S = C``
            flat or per layer, ``sqrt(sum_g C_g^2)`` by groups, 1 automatic).
        expected_batch_size: ``B' > 0``, the divisor: with Poisson sampling ``q * N``
            (the logical batch's expected size), so that it does not depend on the data.
        generator: ``torch.Generator`` (on the parameters' device) for the noise.
        per_layer, param_groups, automatic_gamma, adaptive_clipping: the shorthand of
            ``Clipping(max_grad_norm, per_layer, param_groups, automatic_gamma,
            adaptive_clipping)`` (:class:`~persample.dp.Clipping`); not with
            ``clipping``. Adaptive clipping (Andrew et al. 2021) moves ``C`` at each
            release towards a quantile of the per-sample norms, from a noised count of
            the unclipped samples; the gradient's noise multiplier becomes
            ``(sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` so that the step still costs
            ``sigma`` (:mod:`persample.dp.adaptive`). One process, flat clipping, no
            ``user_ids``.
        mechanism: correlated noise, a :class:`~persample.dp.BandMF` or
            :class:`~persample.dp.BLT` made for the run's releases: release ``t``'s noise
            is ``sigma * S * (C^-1 Z)_t``, BandMF's recursion over the last
            ``bands - 1`` draws or BLT's over ``buffers`` states (parameter-sized rows
            in the sums' dtype, the release drawn into them; FSDP2: each shard's; rank
            0's with several processes); ``None`` (default): DP-SGD's independent
            noise. With ``sample_rate=q`` the logical batches must come from cyclic
            Poisson sampling over the mechanism's ``cycle_length`` groups ``s``
            (:class:`~persample.dp.CyclicPoissonSampler`, of users
            :class:`~persample.dp.CyclicUserPoissonSampler`: each group at rate
            ``s q``; ``s q = 1`` is fixed batches). BandMF's every ``s``-th release is
            accounted as one step at rate ``s q`` (Choquette-Choo et al. 2023, Theorem
            4); BLT's run as one Gaussian mechanism of its sensitivity, spent as it
            grows. Not with ``adaptive_clipping``.
        check: when a micro-batch's result is certified by identities persample does
            not compute itself (:mod:`persample.certificate`): the per-sample gradients
            behind the norms, the norms, and the clipped sum against the gradient of
            ``sum_i c_i L_i`` with the clip factors held constant (one more forward and
            backward of the micro-batch). ``"first"`` (the first micro-batch of each
            model, shapes and method), ``"always"``, ``"never"`` or ``N`` (the first and
            every ``N``-th). A mismatch warns and takes ``torch.func``, then the loop; an
            FSDP2-sharded model is not certified.
        timeout: seconds :meth:`release` waits for the other processes (distributed,
            gloo; with NCCL the process group's own timeout applies).
        sample_rate: ``q`` in ``(0, 1]``, the Poisson sampling rate of the logical
            batches: each :meth:`release` then records one step of ``(sigma, q)`` in
            :attr:`accountant`, and :meth:`epsilon` is the privacy spent so far. Without
            it nothing is accounted (as before).
        accountant: ``"rdp"`` (default), ``"pld"``, ``"prv"`` or a
            :class:`~persample.dp.PrivacyAccountant` to continue (its steps so far
            count); only with ``sample_rate``.
        secure_mode: draw the noise from the operating system's cryptographically
            secure generator (``os.urandom``) instead of a seeded one, so that it
            cannot be computed from a seed or earlier draws: about 20 ns per number
            against 2.5 (threat model and cost: :class:`persample.dp.noise.SecureSource`);
            not with ``generator``. With several processes rank 0 draws it (FSDP2: and
            sends each parameter's noise to every rank, one broadcast each).

    Distributed (``torch.distributed`` initialised when the step is made, any backend;
    gloo on CPUs, NCCL on GPUs): every process accumulates its own samples;
    ``release()`` sums the clipped sums of all processes with one all-reduce into
    which rank 0 has added the noise
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
        ValueError: a bad clipping (a bound, ``param_groups`` with a parameter in none
            or two or an unknown name, ``automatic_gamma``; ``clipping`` and
            ``max_grad_norm`` both or neither), ``noise_multiplier < 0``
            (with ``adaptive_clipping``: ``>= 2 * unclipped_num_std``), a bad
            ``expected_batch_size``, ``sample_rate`` outside ``(0, 1]``, an
            ``accountant`` without ``sample_rate`` or of an unknown kind, a model without trainable
            parameters, a model wrapped in FSDP1's ``FullyShardedDataParallel`` (the
            message names ``fully_shard`` as the fix).
        TypeError: a complex trainable parameter (named; a DP step clips and noises real
            gradients).

    Examples:
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
        ...     losses, norms = step.accumulate(x, y)  # (16,) each: losses, norms
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

    Attributes:
        params: ``{name: parameter}``, the step's (FSDP2: sharded ``DTensor``).
        clipping: the :class:`~persample.dp.Clipping` (given, or made of the
            shorthand keywords).
        max_grad_norm: its ``C`` (a tuple by groups, or ``"automatic"``); with adaptive
            clipping, the ``C`` of the next micro-batches (updated at each release).
        sums: ``{name: tensor}``, the clipped sums so far (``None`` before a step's first
            micro-batch), in the dtype sums accumulate in (float32 at least).
        samples: the samples accumulated since the last release.
        accountant: the :class:`~persample.dp.PrivacyAccountant` (``None`` without
            ``sample_rate``).
        reducer: how the sums reach ``p.grad`` (:mod:`persample.dp.reduce`), picked
            here: one process, several, or FSDP2.

    Source: Abadi et al. 2016 (DP-SGD, lots); Bu et al. 2023 (book-keeping); Opacus's
    virtual steps; Zhao et al. 2023 (PyTorch FSDP).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], *,
                 max_grad_norm: Any = None, clipping: Clipping | None = None,
                 noise_multiplier: float, expected_batch_size: float,
                 generator: torch.Generator | None = None, per_layer: bool = False,
                 timeout: float = 300.0,
                 sample_rate: float | None = None,
                 accountant: str | PrivacyAccountant | None = None,
                 secure_mode: bool = False,
                 param_groups: list[list[str]] | None = None,
                 automatic_gamma: float = 0.01,
                 adaptive_clipping: AdaptiveClipping | None = None,
                 mechanism: Mechanism | None = None,
                 check: str | int | None = None) -> None:
        _check_options(noise_multiplier, expected_batch_size)
        check_option(check)
        self.check = check
        generator = noise_source(generator, secure_mode)
        self.sample_rate, self.accountant = _accounting(sample_rate, accountant)
        if expected_batch_size is None:
            raise ValueError("expected_batch_size is required: the divisor of the noised sum "
                             "(q * N with Poisson sampling)")
        checks.check_loss_fn(loss_fn, None)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # its own gradient all-reduce must not run: release reduces
        self.model, self.loss_fn = model, loss_fn
        self.clipping = Clipping.resolve(
            clipping, max_grad_norm, per_layer=per_layer, param_groups=param_groups,
            automatic_gamma=automatic_gamma, adaptive_clipping=adaptive_clipping)
        self.max_grad_norm = self.clipping.max_grad_norm
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.generator = generator
        self.timeout = timedelta(seconds=timeout)
        self.reducer: Reducer = self._reducer()
        self.params = self.reducer.trainable(model)  # name -> parameter (sharded: the DTensor)
        checks.real_parameters(self.params, "a DP step")
        self.bounds = self.clipping.bound(list(self.params))  # groups and their bounds
        self.adaptive = self.clipping.adaptive
        self.unclipped = 0  # adaptive clipping: the samples left unclipped in this step
        if self.adaptive is not None:
            self._check_adaptive()
        self.mechanism = check_mechanism(mechanism)
        self.noise = None if mechanism is None else CorrelatedNoise(mechanism)
        if self.noise is not None and self.adaptive is not None:
            raise ValueError("mechanism= with adaptive_clipping: the noised count of "
                             "adaptive clipping is accounted as DP-SGD's independent noise; "
                             "use a fixed clipping norm with a mechanism")
        check_sampling(self.mechanism, self.sample_rate)
        self._sums: Sums | None = None  # made by the first micro-batch of a step
        self.samples = 0  # accumulated since the last release
        self.versions: dict[str, int] = {}  # each parameter's _version at the first accumulate
        self.users: set[int] = set()  # the users accumulated since the last release

    def _reducer(self) -> Reducer:
        """The step's mode, picked once: FSDP2, several processes, or one."""
        return reducer_for(self.model, self.timeout)

    @property
    def sums(self) -> dict[str, Tensor] | None:
        """The clipped sums so far, ``{name: tensor}``, or ``None`` (nothing accumulated
        since the last release)."""
        return None if self._sums is None else self._sums.tensors

    @sums.setter
    def sums(self, tensors: dict[str, Tensor] | None) -> None:
        self._sums = None if tensors is None else Sums(tensors)

    def accumulate(self, inputs: Any, targets: Any, user_ids: Tensor | None = None
                   ) -> Accumulated:
        """Add one micro-batch's clipped per-sample gradients to the step's sums.

        Args:
            inputs, targets: as for ``per_sample_grads``; ``b`` samples (0 is fine).
            user_ids: ``(b,)`` integer tensor, each sample's user (user-level DP): the
                samples of a user are one contribution, the sum of their gradients,
                clipped once. Every record a user has in the logical batch must come in
                one micro-batch (on one process). ``None``: each sample its own.

        Returns:
            :class:`~persample.dp.Accumulated` ``(losses, norms)``: the ``(b,)``
            per-sample losses of the forward it ran (detached: ``losses.mean()`` is the
            training loss to log, with no second forward) and the ``(b,)`` per-sample
            gradient norms before clipping (over all parameters; with ``user_ids``, the
            norm of each sample's user's gradient), in at least float32 (the sums
            accumulate there too).

        Raises:
            ValueError: the model's trainable parameters are not those of the step
                (added, removed, replaced, reshaped), or one was modified (an
                optimizer step) since the first micro-batch of this step: the message
                names it; release first. ``user_ids`` that are not ``(b,)`` integers, or
                a user already accumulated in this step. And the errors of
                ``private_grad``; the sums are then left as they were.
            FloatingPointError: a sample's gradient is not finite (nothing is added).
            RuntimeError: called while a CUDA graph is captured (a DP step reads its
                per-sample norms on the host to refuse non-finite ones).
        """
        refuse_capture()
        self._check_parameters()
        batch, n, working = self.reducer.begin(self.model, inputs, targets, self.loss_fn)
        users = self._users_of(user_ids, n, working)
        into = self.reducer.micro_batch(self._sums, working, self._terms())
        try:
            with checks.kept_buffers(self.model):
                got = clipped_sums(MicroBatch(self.model, batch, targets, self.loss_fn,
                                              working, users, self.check),
                                   clipping=self.bounds, into=into)
        except FloatingPointError as err:
            return self.reducer.failed(err, n)
        self._sums = into.commit()  # only once the whole micro-batch succeeded
        if self.adaptive is not None:
            self.unclipped += unclipped_count(got.norms, self.max_grad_norm)
        if not self.versions:
            self.versions = {name: p._version for name, p in self.params.items()}
        self.samples += n
        if users is not None:
            self.users.update(users.tolist())
        return got

    def _users_of(self, user_ids: Any, n: int, params: dict[str, nn.Parameter]
                  ) -> Tensor | None:
        """``user_ids`` checked (``(n,)`` integers, none accumulated in this step yet), on
        the parameters' device."""
        if user_ids is None:
            return None
        if self.adaptive is not None:
            raise ValueError("adaptive_clipping counts unclipped samples, not users: "
                             "user_ids is not taken with it")
        if not isinstance(user_ids, Tensor) or user_ids.shape != (n,) or (
                user_ids.is_floating_point() or user_ids.is_complex()
                or user_ids.dtype == torch.bool):
            got = (f"{tuple(user_ids.shape)} {user_ids.dtype}" if isinstance(user_ids, Tensor)
                   else type(user_ids).__name__)
            raise ValueError(f"user_ids must be a ({n},) integer tensor, each sample's user, "
                             f"got {got}")
        again = sorted(self.users & set(user_ids.tolist()))
        if again:
            raise ValueError(
                f"user {again[0]} was already accumulated in this step: a user's records of "
                "one logical batch must come in one micro-batch, so that its gradient is "
                "clipped as a whole (make_private's user-level batches keep them together)")
        device = next(iter(params.values())).device
        return user_ids.to(device=device, dtype=torch.int64)

    def release(self) -> None:
        """Set ``p.grad = (sums + N(0, sigma^2 C^2 I)) / expected_batch_size`` for every
        trainable parameter of the step (overwriting it), then reset the sums.

        With nothing accumulated (Poisson sampling can draw an empty logical batch)
        ``p.grad`` is the noise alone, divided alike. Then step any optimizer. The sums'
        memory becomes ``p.grad`` (one process: the noise is added to it in place).

        Raises:
            FloatingPointError: several processes: a rank's micro-batch had a non-finite
                gradient (on every rank; the step's sums are dropped).
            ValueError: several processes: the ranks hold different parameters or
                ``expected_batch_size`` (FSDP2: or generators); ``p.grad`` unchanged.
            RuntimeError: a rank did not arrive within ``timeout`` (gloo); a release past
                the ``steps`` a ``mechanism`` was made for (``p.grad`` unchanged).
        """
        if self.noise is not None:  # (before the ranks meet: every rank raises alike)
            self.noise.check()
        terms = self._terms()
        self.reducer.agree(terms, self._drop)
        self.reducer.release(self._sums, terms)
        if self.noise is not None:
            self.noise.advance()
        unclipped = self.unclipped
        self._drop()
        self._account()
        if self.adaptive is not None:  # the next step's C, from the noised count
            like = next(iter(self.params.values()))
            count = self.adaptive.noised_count(unclipped, self.generator, like)
            self.max_grad_norm = self.adaptive.updated(self.max_grad_norm, count,
                                                       self.expected_batch_size)
            self.bounds = Clipping.flat(self.max_grad_norm).bound(list(self.params))

    def set_noise_multiplier(self, noise_multiplier: float) -> None:
        """Run the next releases with ``sigma = noise_multiplier`` (a noise schedule, as
        Opacus's ``opacus.schedulers``); each release is accounted with the sigma it
        ran with.

        Raises:
            ValueError: ``noise_multiplier < 0`` or not finite; a step with a
                ``mechanism`` (its correlated noise is analysed for one sigma), or with
                adaptive clipping whose count would get all the noise.

        Examples:
            >>> step = PrivateStep(nn.Linear(2, 1), nn.MSELoss(), max_grad_norm=1.0,
            ...                    noise_multiplier=1.0, expected_batch_size=8)
            >>> step.set_noise_multiplier(0.5); step.noise_multiplier
            0.5
        """
        _check_options(noise_multiplier, self.expected_batch_size)
        if self.mechanism is not None:
            raise ValueError("a step with a mechanism (correlated noise) keeps its sigma: "
                             "the mechanism's privacy is analysed for one noise multiplier")
        if self.adaptive is not None:
            self.adaptive.gradient_noise_multiplier(noise_multiplier)  # raises if too large
        self.noise_multiplier = float(noise_multiplier)

    def set_max_grad_norm(self, max_grad_norm: Any) -> None:
        """Clip the next steps' samples to ``max_grad_norm`` (the clipping norm ``C``, or
        one per group of grouped clipping), the kind of clipping kept (a clipping-norm
        schedule, as Opacus's ``opacus.schedulers``). Between steps only.

        Raises:
            ValueError: samples accumulated in this step and not released yet; adaptive or
                automatic clipping (their ``C`` is not set by hand); a step with a
                ``mechanism``; and what :class:`Clipping` raises for the value.

        Examples:
            >>> step = PrivateStep(nn.Linear(2, 1), nn.MSELoss(), max_grad_norm=1.0,
            ...                    noise_multiplier=1.0, expected_batch_size=8)
            >>> step.set_max_grad_norm(0.5); step.max_grad_norm, step.bounds.sensitivity
            (0.5, 0.5)
        """
        if self._sums is not None or self.samples:
            raise ValueError("the clipping norm changes between steps: this step has "
                             "accumulated samples; call it after release()")
        if self.adaptive is not None or isinstance(self.clipping.max_grad_norm, str):
            raise ValueError("adaptive and automatic clipping set their own clipping norm")
        if self.mechanism is not None:
            raise ValueError("a step with a mechanism (correlated noise) keeps its clipping "
                             "norm: the noise of every release is correlated at one scale")
        clipping = dataclasses.replace(self.clipping, max_grad_norm=max_grad_norm)
        self.bounds = clipping.bound(list(self.params))
        self.clipping, self.max_grad_norm = clipping, clipping.max_grad_norm

    def _terms(self) -> Terms:
        """What the reducer needs of the step: its parameters, the noise, the divisor, the
        users accumulated."""
        sigma = self.noise_multiplier if self.adaptive is None else \
            self.adaptive.gradient_noise_multiplier(self.noise_multiplier)
        return Terms(self.params, sigma * self.bounds.sensitivity,
                     self.generator, self.expected_batch_size, frozenset(self.users),
                     self.noise)

    def _drop(self) -> None:
        """The step's sums released or lost: the next micro-batch starts a new step."""
        self._sums, self.samples, self.versions, self.users = None, 0, {}, set()
        self.unclipped = 0

    def _account(self) -> None:
        """One release done: one step of ``(sigma, q)`` for the accountant, if any; with
        a mechanism, its share (:func:`~persample.dp.mechanisms.release_runs`: BandMF one
        step of ``(sigma, s q)`` every ``s`` releases, its first, as the amplified
        analysis composes them; a BLT the Gaussian of the sensitivity it adds)."""
        if self.accountant is None:
            return
        release = 0 if self.noise is None else self.noise.t - 1
        for sigma, rate in release_runs(self.mechanism, self.noise_multiplier,
                                        self.sample_rate, release):
            self.accountant.step(sigma, rate)

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

    def state_dict(self) -> dict[str, Any]:
        """The step's state for a checkpoint: the sums (``{name: tensor}`` or ``None``),
        the samples accumulated and the noise generator's state (``None`` without a
        generator). Tensors are the step's own (clone them to keep a copy that later
        calls do not change: ``accumulate`` adds to them, ``release`` makes them
        ``p.grad``).

        Examples:
            >>> net = nn.Linear(2, 1)
            >>> step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
            ...                    expected_batch_size=8)
            >>> sorted(step.state_dict())
            ['generator', 'samples', 'sums']
        """
        seeded = isinstance(self.generator, torch.Generator)
        state = {"sums": self.sums, "samples": self.samples,
                 "generator": self.generator.get_state() if seeded else None}
        if self.accountant is not None:  # the steps released so far
            state["accountant"] = self.accountant.state_dict()
        if self.adaptive is not None:  # the clipping norm reached and this step's count
            state["adaptive"] = {"max_grad_norm": self.max_grad_norm,
                                 "unclipped": self.unclipped}
        if self.noise is not None:  # the releases made and the draws the next ones need
            state["mechanism"] = self.noise.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (the same model's parameter names and shapes).

        Raises:
            ValueError: the sums' names or shapes are not the step's parameters', or the
                state is of a step with a mechanism and this one has none (or the
                reverse); the step unchanged.
        """
        if (self.noise is None) != (state.get("mechanism") is None):  # (before any change)
            raise ValueError("the saved state is of a step " + (
                "without a mechanism: this one correlates its noise" if self.noise is not None
                else "with a mechanism (correlated noise): pass the same mechanism="))
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
        if state.get("generator") is not None and isinstance(self.generator, torch.Generator):
            self.generator.set_state(state["generator"])
        if self.accountant is not None and state.get("accountant") is not None:
            self.accountant.load_state_dict(state["accountant"])
        if self.noise is not None:
            self.noise.load_state_dict(state["mechanism"])
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.max_grad_norm = float(state["adaptive"]["max_grad_norm"])
            self.unclipped = int(state["adaptive"]["unclipped"])
            self.bounds = Clipping.flat(self.max_grad_norm).bound(list(self.params))

    def _check_adaptive(self) -> None:
        """Adaptive clipping (flat: :class:`Clipping` checks) runs in one process; its
        noise must leave the count its share (``sigma < 2 sigma_b``)."""
        if not isinstance(self.adaptive, AdaptiveClipping):
            raise ValueError("adaptive_clipping must be a persample.dp.AdaptiveClipping, got "
                             f"{type(self.adaptive).__name__}")
        if type(self.reducer) is not Local:
            raise ValueError("adaptive_clipping runs in one process: the count of unclipped "
                             "samples is not summed across ranks")
        self.adaptive.gradient_noise_multiplier(self.noise_multiplier)  # raises if too large

    def _check_parameters(self) -> None:
        """The model's trainable parameters are still the step's, and unchanged since the
        first micro-batch of this step."""
        now = self.reducer.trainable(self.model)
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


def private_grad(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    max_grad_norm: Any = None,
    clipping: Clipping | None = None,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    per_layer: bool = False,
    expected_batch_size: float | None = None,
    secure_mode: bool = False,
    param_groups: list[list[str]] | None = None,
    automatic_gamma: float = 0.01,
    user_ids: Tensor | None = None,
    check: str | int | None = None,
) -> Accumulated:
    """Set every trainable ``p.grad`` to a differentially private gradient of the batch.

    ``p.grad = (sum_i c_i g_i + N(0, sigma^2 C^2 I)) / B'`` with ``g_i`` sample
    ``i``'s own gradient, ``c_i = min(1, C / (||g_i|| + 1e-6))``, ``C =
    max_grad_norm``, ``sigma = noise_multiplier`` and ``B' = expected_batch_size``
    (default: the batch size). Then step any ``torch.optim`` optimizer as usual.

    Args:
        model, inputs, targets, loss_fn: as for
            :func:`persample.per_sample_grads`. ``p.grad`` of every trainable
            parameter is overwritten (not accumulated); nothing else changes.
        clipping: a :class:`~persample.dp.Clipping`, or ``max_grad_norm``: the
            clipping norm ``C > 0`` in loss units per parameter unit (with the shorthand
            keywords, a list of norms, one per group of ``param_groups``, or
            ``"automatic"``), as for :class:`PrivateStep`.
        noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * S``, ``S`` the
            sensitivity of the clipping (``C`` flat or per layer).
        generator: ``torch.Generator`` (on the parameters' device) for the noise.
        per_layer: clip each parameter's per-sample gradient to
            ``C / sqrt(K)`` (``K`` trainable parameter tensors) instead of the whole
            gradient to ``C``; the sensitivity is ``C`` either way.
        param_groups, automatic_gamma: as for :class:`PrivateStep`.
        user_ids: ``(B,)`` integers, each sample's user (user-level DP, as for
            :meth:`PrivateStep.accumulate`): each user's gradient, the sum of its
            samples', is clipped once; ``expected_batch_size`` then counts users
            (default: the users in the batch).
        expected_batch_size: the divisor ``B'``. With Poisson sampling (which the
            privacy analysis assumes) pass ``q * N`` so that the divisor does not
            depend on the data.
        secure_mode: the noise from the operating system's cryptographically secure
            generator, as for :class:`PrivateStep`; not with ``generator``.
        check: when the step is certified, as for :class:`PrivateStep`.

    A model sharded with FSDP2 (``fully_shard``): one :class:`PrivateStep` step over
    every rank's batch (each rank calls it with its own samples; the default divisor is
    the number of samples of all ranks); ``p.grad`` is a sharded ``DTensor``. Otherwise
    the call holds one buffer of the parameters' size: the noise is drawn into it once
    the backward is done, the clipped sums are added to it, and it becomes ``p.grad``.

    Returns:
        :class:`~persample.dp.Accumulated` ``(losses, norms)``, for logging: the ``(B,)``
        per-sample losses of the forward it ran (detached) and the ``(B,)`` per-sample
        gradient norms before clipping (over all parameters), the norms in the
        parameters' dtype or float32 if that is lower (bfloat16,
        float16: norms, clip factors and sums accumulate in float32; ``p.grad`` comes
        in the parameter's dtype). Under ``torch.autocast`` the gradients are those of
        the model as autocast runs it.

    Raises:
        ValueError: a bad clipping (naming the parameter or the number; ``clipping``
            and ``max_grad_norm`` both or neither), ``noise_multiplier < 0``, a bad
            ``expected_batch_size``, an empty batch without ``expected_batch_size``,
            and the errors of ``per_sample_grads`` (TypeError too: also for a complex
            trainable parameter, named). Where the rules
            cannot split the model by sample, or persample's own code fails on it, or
            the certificate rejects its result, the clipped sums come from the per-sample
            gradients of ``torch.func`` or the loop, with a warning.
        CertificateError: even the loop's result fails the certificate (a model that
            mixes samples: its per-sample gradients, their clipping and the guarantee
            are not defined).
        FloatingPointError: a sample's gradient is not finite (NaN or Inf); the
            message lists the samples and every ``p.grad`` is left as it was, so no
            NaN reaches the weights. Drop those samples and call again.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.dp import private_grad
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> losses, norms = private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
        ...                              noise_multiplier=1.1,
        ...                              generator=torch.Generator().manual_seed(0))
        >>> opt.step()
        >>> losses.shape, norms.shape
        (torch.Size([16]), torch.Size([16]))

    Source: Abadi et al. 2016 (DP-SGD); Bu et al. 2023 (book-keeping).
    """
    if isinstance(model, nn.Module):
        fsdp_units(model)  # refuses FSDP1 before anything else
    _check_options(noise_multiplier, expected_batch_size)
    _, n, _ = checks.validate_call(model, inputs, targets, loss_fn, "auto", None)
    if n == 0 and expected_batch_size is None:
        raise ValueError(
            "the batch is empty (Poisson sampling can draw one): pass expected_batch_size "
            "(q * N) so that the noise is scaled as for every other step"
        )
    if expected_batch_size is None:  # (with users: the users of the batch)
        count = len(torch.unique(user_ids)) if isinstance(user_ids, Tensor) else n
        expected_batch_size = total_samples(model, count)
    step = _OneCall(model, loss_fn, max_grad_norm=max_grad_norm, clipping=clipping,
                    noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                    generator=generator, per_layer=per_layer, secure_mode=secure_mode,
                    param_groups=param_groups, automatic_gamma=automatic_gamma, check=check)
    got = step.accumulate(inputs, targets, user_ids)
    step.release()
    return got


class _OneCall(PrivateStep):
    """The step of one :func:`private_grad` call: one micro-batch, released at once. Its
    sums are this process's own (an unsharded model is not reduced, whatever
    ``torch.distributed``), and the noise is drawn into their buffer as it is made, so
    that the call holds one buffer of the parameters' size, which becomes ``p.grad``."""

    def _reducer(self) -> Reducer:
        return reducer_for(self.model, self.timeout, one_call=True)


def _check_options(noise_multiplier, expected_batch_size) -> None:
    """The options of a step: ``sigma >= 0`` finite, ``B'`` positive or ``None``; raises
    ``ValueError`` naming the one that is not (the clipping: :class:`Clipping`)."""
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier (sigma) must be >= 0, got {noise_multiplier}")
    if expected_batch_size is not None and not (
            isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
        raise ValueError(
            f"expected_batch_size must be a positive number or None, got {expected_batch_size}")


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
