"""Opacus's ``PrivacyEngine``, on persample's DP step: an Opacus user's training script
runs unchanged but for the import.

``PrivacyEngine().make_private(module=, optimizer=, data_loader=, noise_multiplier=,
max_grad_norm=)`` returns a model, an optimizer and a Poisson-sampling data loader
that behave like Opacus's: the loop stays ``loss = criterion(model(x), y);
loss.backward(); optimizer.step()``. Underneath:

- the model (:class:`PrivateModule`) runs the forward as it is and keeps its inputs
  and the random-number state it started from;
- ``loss.backward()`` runs as usual; the model's output keeps its gradient
  ``dL/d output`` (``grad_sample_mode="hooks"``); with ``"ghost"`` Opacus returns a
  wrapped criterion, and so does this: its ``backward()`` is persample's, on the
  criterion itself;
- ``optimizer.step()`` (:class:`PrivateOptimizer`) runs persample's
  :class:`~persample.dp.PrivateStep` on the kept inputs, the forward replayed from
  the same random-number state (the same dropout masks): with the criterion
  (``"ghost"``), each sample's own loss; else the linear loss ``<out_i, c_i>`` whose
  gradient is sample ``i``'s own (``c_i = B dL/d out_i`` for a mean, as Opacus's
  ``loss_reduction`` says), then the noise, ``p.grad``, one accounted step, and the
  optimizer's own step.

As with Opacus's hooks, the loss the user backpropagates must be a mean (or, with
``loss_reduction="sum"``, a sum) of per-sample terms: ``"hooks"`` only sees its
gradient; ``"ghost"`` evaluates the criterion per sample and refuses one that mixes
samples (:class:`~persample.errors.LossNotPerSampleError`).

With several processes (the model wrapped in ``DistributedDataParallel`` or Opacus's
``DPDDP``, or sharded with FSDP2's ``fully_shard``) each rank takes its share of every
Poisson batch and the step sums the ranks' clipped gradients, the noise added once;
:class:`BatchMemoryManager` splits each logical batch into physical ones, as Opacus's
does (with several processes, as many on every rank).

That costs one forward and one backward more than persample's own loop
(:class:`~persample.dp.PrivateStep`, :func:`~persample.dp.make_private`), which has
no second pass; it is for moving a script over first.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import BatchSampler, DataLoader

from ..checks import mixing_reason_of
from ..errors import MixesSamplesError
from .accounting import noise_multiplier_for
from .adaptive import AdaptiveClipping
from .clipping import Clipping
from .mechanisms import Mechanism, accounted_runs, check_mechanism, resolve_mechanism
from .reduce import world
from .sampling import (
    CyclicPoissonSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    dataset_size,
    loader_options,
)
from .setup import PhysicalBatches, Seeds, even_parts, physical_batches, shared_seeds
from .step import PrivateStep
from .validator import ModuleValidator


@dataclass
class _Forward:
    """One forward of the model: its inputs, the random-number states it started from,
    its output, and (``"hooks"``) the gradient of the loss at each output tensor."""

    args: tuple
    kwargs: dict
    states: tuple
    output: Any
    grads: dict[int, Tensor]
    backward_done: bool = False


class _Forwards:
    """The forwards of the model since the optimizer's last step or ``zero_grad``, kept
    by the wrapped module's ``forward`` or (``wrap_model=False``) by hooks on the user's
    module; none while the step replays one (``replaying``) or without grad."""

    def __init__(self) -> None:
        self.kept: list[_Forward] = []
        self.replaying = False

    def keep(self, args: tuple, kwargs: dict, states: tuple, output: Any) -> None:
        """Keep one forward; each output tensor keeps ``dL/d out`` once backpropagated."""
        if self.replaying or not torch.is_grad_enabled():
            return
        record = _Forward(args, kwargs, states, output, {})
        leaves, _ = tree_flatten(output)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                leaf.register_hook(_keeper(record, k))
        self.kept.append(record)

    def clear(self) -> None:
        self.kept.clear()

    @contextmanager
    def replay(self, states: tuple) -> Iterator[None]:
        """Inside: the generators as ``states`` had them, and no forward kept."""
        self.replaying = True
        try:
            with _replayed(states):
                yield
        finally:
            self.replaying = False


class PrivateModule(nn.Module):
    """The model as :class:`PrivacyEngine` returns it: the forward as it is, its inputs
    and random-number state kept for the optimizer's step (the module itself under
    ``_module``, as Opacus's ``GradSampleModule`` has it).

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> wrapped = PrivateModule(net)
        >>> torch.equal(wrapped(torch.ones(1, 3)), net(torch.ones(1, 3)))
        True
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self._module = module
        self.__dict__["inner"] = unwrapped(module)  # not a submodule: no second state_dict
        self.__dict__["forwards"] = _Forwards()

    def __getattr__(self, name: str) -> Any:
        """The module's own attributes (``model.fc``), as Opacus's ``GradSampleModule``
        passes them through."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:
        """As ``nn.Module``'s (``state_dict()`` names each entry ``_module.<name>``, as
        Opacus's ``GradSampleModule`` does); a checkpoint of the user's module, without
        the ``_module.`` in front, loads into it too."""
        prefix = "_module."
        if not state_dict or any(k.startswith(prefix) for k in state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return self.inner.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        states = _rng_states()
        output = self.inner(*args, **kwargs)
        self.forwards.keep(args, kwargs, states, output)
        return output


class PrivateHooks:
    """What :meth:`PrivacyEngine.make_private` returns first with ``wrap_model=False``
    (Opacus's ``GradSampleHooks``): the user's module is used as it is, and a forward
    pre-hook and hook on it keep each forward's inputs, random-number state and output
    for the optimizer's step, until :meth:`cleanup` (or the end of a ``with`` block).

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> hooks = PrivateHooks(net)
        >>> _ = net(torch.ones(4, 3)); len(hooks.forwards.kept)
        1
        >>> hooks.cleanup(); _ = net(torch.ones(4, 3)); len(hooks.forwards.kept)
        1
        >>> with PrivateHooks(net) as hooks:
        ...     _ = net(torch.ones(4, 3))
        >>> len(hooks.forwards.kept), len(net._forward_hooks)
        (1, 0)
    """

    def __init__(self, module: nn.Module):
        self._module = module
        self.forwards = _Forwards()
        begun: list[tuple] = []  # the states of the forwards begun and not ended

        def begin(_: nn.Module, args: tuple, kwargs: dict) -> None:
            begun.append(_rng_states())

        def end(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.forwards.keep(args, kwargs, begun.pop(), output)

        target = unwrapped(module)
        self.handles = [target.register_forward_pre_hook(begin, with_kwargs=True),
                        target.register_forward_hook(end, with_kwargs=True)]

    def cleanup(self) -> None:
        """Remove the hooks: the module is as it was before ``make_private``."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    remove_hooks = cleanup

    def __enter__(self) -> PrivateHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside torch's ``DistributedDataParallel`` or Opacus's
    ``DifferentiallyPrivateDistributedDataParallel``, else ``module``: the DP step sums
    the ranks' clipped gradients itself, so their gradient all-reduce must not run.

    Examples:
        >>> net = nn.Linear(2, 2)
        >>> unwrapped(net) is net
        True
    """
    if isinstance(module, nn.parallel.DistributedDataParallel) or \
            type(module).__name__ == "DifferentiallyPrivateDistributedDataParallel":
        return module.module
    return module


def _keeper(record: _Forward, k: int) -> Callable[[Tensor], None]:
    def keep(grad: Tensor) -> None:
        record.grads[k] = grad.detach()
        record.backward_done = True
    return keep


def _rng_states() -> tuple:
    """The CPU generator's state and each CUDA device's (as ``torch.utils.checkpoint``
    keeps them to replay a forward)."""
    cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


@contextmanager
def _replayed(states: tuple) -> Iterator[None]:
    """Inside: the generators as ``states`` had them; outside: as they were."""
    cpu, cuda = states
    devices = list(range(len(cuda)))
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        for d, state in zip(devices, cuda):
            torch.cuda.set_rng_state(state, d)
        yield


class _LinearLoss:
    """``loss_i = sum over output tensors of <out_i, c_i>`` for cotangents ``c`` (one per
    output tensor, ``None`` where the loss did not read it): its per-sample gradient is
    ``J_i^T c_i``, sample ``i``'s own gradient when ``c_i`` is its loss's gradient at its
    output (rows of ``dL/d out``, times the batch size for a mean)."""

    def __call__(self, output: Any, cotangents: list[Tensor | None]) -> Tensor:
        leaves, _ = tree_flatten(output)
        total = None
        for leaf, c in zip(leaves, cotangents):
            if c is not None:
                term = (leaf * c).reshape(len(c), -1).sum(1)  # (b,)
                total = term if total is None else total + term
        return total


class PrivateLoss:
    """The loss a ``"ghost"`` criterion returns: ``backward()`` adds the batch's clipped
    per-sample gradients to the step (persample's, on the criterion itself); ``item()``
    and ``detach()`` give the mean of the per-sample losses."""

    def __init__(self, optimizer: PrivateOptimizer, record: _Forward, targets: Any,
                 value: Tensor):
        self.optimizer, self.record, self.targets, self.value = optimizer, record, targets, value

    def backward(self) -> None:
        self.optimizer.accumulate(self.record, self.targets)
        self.record.backward_done = True

    def item(self) -> float:
        return self.value.item()

    def detach(self) -> Tensor:
        return self.value.detach()

    def __float__(self) -> float:
        return float(self.value)

    def __repr__(self) -> str:
        return f"PrivateLoss({self.value.item():.4f})"


class PrivateCriterion:
    """The criterion :class:`PrivacyEngine` returns with ``grad_sample_mode="ghost"``:
    called on the wrapped model's last output, a :class:`PrivateLoss`."""

    def __init__(self, criterion: Callable, forwards: _Forwards, optimizer: PrivateOptimizer):
        self.criterion, self.forwards, self.optimizer = criterion, forwards, optimizer

    def __call__(self, output: Any, targets: Any) -> PrivateLoss:
        record = next((r for r in reversed(self.forwards.kept) if r.output is output), None)
        if record is None:
            raise ValueError("the criterion must be called on the output of the model "
                             "make_private returned (its last forward)")
        with torch.no_grad():
            value = self.criterion(output, targets)
        return PrivateLoss(self.optimizer, record, targets, value)


class PrivateOptimizer:
    """The optimizer :class:`PrivacyEngine` returns: ``step()`` runs persample's DP step
    on the batch of the last forward and backward (clipped per-sample gradients,
    noise, ``p.grad``, one accounted step), then the optimizer's own step;
    ``zero_grad()`` also forgets the forwards. Everything else is the optimizer's.

    After ``step()`` each trainable parameter's ``p.summed_grad`` holds the sum of the
    batch's clipped per-sample gradients (before the noise, as Opacus's
    ``DPOptimizer`` keeps it) until ``zero_grad()``. Unlike Opacus's hooks,
    persample never makes the ``(B, *p.shape)`` per-sample gradients: there is no
    ``p.grad_sample`` (:func:`persample.per_sample_grads` gives them).

    Attributes:
        original_optimizer: the optimizer given.
        private_step: the :class:`~persample.dp.PrivateStep`.
        noise_multiplier, max_grad_norm: as Opacus's ``DPOptimizer`` (settable between
            steps: a schedule, :mod:`persample.dp.schedulers`).
        expected_batch_size: as Opacus's ``DPOptimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, forwards: _Forwards,
                 step: PrivateStep, loss_reduction: str, batch_first: bool = True):
        self.original_optimizer, self.forwards, self.private_step = optimizer, forwards, step
        self.loss_reduction, self.batch_first = loss_reduction, batch_first
        self.criterion: Callable | None = None  # "ghost": the user's criterion
        self.skips: deque[bool] = deque()  # steps that only accumulate (signal_skip_step)
        self.last_skipped = False

    @property
    def noise_multiplier(self) -> float:
        return self.private_step.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.private_step.set_noise_multiplier(value)

    @property
    def max_grad_norm(self) -> Any:
        return self.private_step.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Any) -> None:
        self.private_step.set_max_grad_norm(value)

    @property
    def expected_batch_size(self) -> float:
        return self.private_step.expected_batch_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["original_optimizer"], name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; the forwards kept are forgotten, and so is
        ``p.summed_grad`` unless the last step was skipped (its sums go on)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.forwards.clear()
        if not self.last_skipped:
            for p in self.private_step.params.values():
                p.summed_grad = None

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next ``step()`` only add its batch's clipped per-sample gradients to
        the step's sums (no noise, no ``p.grad``, no optimizer step), as Opacus's
        ``DPOptimizer.signal_skip_step`` (what :class:`BatchMemoryManager` calls)."""
        self.skips.append(do_skip)

    def accumulate(self, record: _Forward, targets: Any) -> None:
        """One forward's clipped per-sample gradients into the step, replayed from its
        random-number state (the same dropout masks): ``targets`` for the step's loss,
        the criterion (``"ghost"``) or the linear loss's cotangents (``"hooks"``)."""
        inputs = (record.args, record.kwargs)
        if not self.batch_first:
            inputs = _batch_first(inputs)
        with self.forwards.replay(record.states):
            self.private_step.accumulate(inputs, targets)

    def step(self, closure: Callable | None = None) -> Any:
        """The DP step of the batch since ``zero_grad()``, then the optimizer's step.
        After :meth:`signal_skip_step` (:class:`BatchMemoryManager`: a physical batch
        that does not end its logical batch), only the batch's clipped per-sample
        gradients are added to the step (no noise, no ``p.grad``, no optimizer step;
        returns ``None``).

        Raises:
            ValueError: more than one forward and backward since the last step (Poisson
                sampling takes one per step, as Opacus).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        done = [r for r in self.forwards.kept if r.backward_done]
        if len(done) > 1:
            raise ValueError(
                f"{len(done)} forwards and backwards since the last step: with Poisson "
                "sampling each optimizer step takes one batch (as Opacus's). Call "
                "optimizer.zero_grad() before each forward; for logical batches larger than "
                "memory use persample.dp.BatchMemoryManager, as with Opacus")
        if done and self.criterion is None:
            self.accumulate(done[0], self._cotangents(done[0]))
        self.forwards.clear()
        self._keep_sums()
        self.last_skipped = bool(self.skips and self.skips.popleft())
        if self.last_skipped:
            return None
        self.private_step.release()
        return self.original_optimizer.step()

    def _keep_sums(self) -> None:
        """``p.summed_grad``: the step's clipped sums so far (a copy: the release adds
        the noise to the sums' memory)."""
        sums = self.private_step.sums or {}
        for name, p in self.private_step.params.items():
            if name in sums:
                p.summed_grad = sums[name].detach().clone()

    def _cotangents(self, record: _Forward) -> list[Tensor | None]:
        """Each output tensor's rows of ``dL/d out`` as each sample's own loss has them
        (times the batch size where the loss was a mean)."""
        leaves, _ = tree_flatten(record.output)
        rows = _rows(leaves)
        first = record.args[0] if record.args else None
        if isinstance(first, Tensor) and first.dim() > (0 if self.batch_first else 1):
            samples = first.shape[0 if self.batch_first else 1]
            if rows != samples:
                where = "dim 0" if self.batch_first else "dim 1 (batch_first=False)"
                raise ValueError(
                    f"the model's output has {rows} rows but its input has {samples} "
                    f"samples in {where}: the loss's rows must be the samples'. " + (
                        "If the inputs are sequence-first (the batch in dim 1), pass "
                        "batch_first=False to make_private" if self.batch_first else
                        "Return the output with the batch in dim 0"))
        scale = rows if self.loss_reduction == "mean" else 1
        return [record.grads[k] * scale if k in record.grads else None
                for k in range(len(leaves))]


class _BatchSecond(nn.Module):
    """The model of a ``batch_first=False`` script as the DP step calls it: its tensor
    inputs come with the batch in dim 0 (:func:`_batch_first`) and are given to the
    model with it in dim 1 again, as the model was called."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _batch_first((args, kwargs))  # (the swap is its own inverse)
        return self.module(*args, **kwargs)


def _batch_first(inputs: Any) -> Any:
    """``inputs`` with dims 0 and 1 of every tensor swapped (``batch_first=False``: the
    batch in dim 1 of each input, as Opacus's option says).

    Raises:
        ValueError: a tensor input with fewer than 2 dims (no dim 1 to hold the batch).
    """
    def swap(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t.dim() < 2:
            raise ValueError(f"batch_first=False: an input of shape {tuple(t.shape)} has "
                             "no dim 1 to hold the batch: every tensor input must have the "
                             "batch in dim 1 (or use batch_first=True)")
        return t.transpose(0, 1)
    return tree_map(swap, inputs)


def _rows(leaves: list) -> int:
    return next((len(t) for t in leaves if isinstance(t, Tensor) and t.dim()), 0)


class PrivacyEngine:
    """Opacus's ``PrivacyEngine`` on persample's DP step (see the module's docstring).

    Args:
        accountant: ``"prv"`` (Opacus's default: its PRV accountant, Opacus installed;
            without Opacus ``"pld"``, as tight, with a warning), ``"rdp"`` or ``"pld"``.
        secure_mode: the noise and the Poisson sampling from the operating system's
            secure generator (:class:`persample.dp.noise.SecureSource`).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from persample.dp import PrivacyEngine
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
        >>> engine = PrivacyEngine()
        >>> model, optimizer, loader = engine.make_private(
        ...     module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=16),
        ...     noise_multiplier=1.0, max_grad_norm=1.0)
        >>> for x, y in loader:  # the Opacus loop, as it is
        ...     optimizer.zero_grad()
        ...     loss = nn.CrossEntropyLoss()(model(x), y)
        ...     loss.backward()
        ...     optimizer.step()
        >>> 0 < engine.get_epsilon(1e-5) < 100
        True

    Source: Opacus (Yousefpour et al. 2021), its ``PrivacyEngine`` interface; Abadi et
    al. 2016 (DP-SGD).
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        if accountant == "prv" and importlib.util.find_spec("opacus") is None:
            warnings.warn("accountant='prv' is Opacus's PRV accountant and Opacus is not "
                          "installed: the privacy loss distribution accountant ('pld') "
                          "accounts instead, as tight (pass accountant='pld' to say so, or "
                          "pip install opacus)", stacklevel=2)
            accountant = "pld"
        self.accountant_kind, self.secure_mode = accountant, secure_mode
        self.steps: list[PrivateStep] = []

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """Opacus's ``get_compatible_module``: :meth:`ModuleValidator.fix
        <persample.dp.ModuleValidator.fix>` (a copy, BatchNorm to GroupNorm), validated.

        Examples:
            >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
            >>> type(PrivacyEngine.get_compatible_module(net)[1]).__name__
            'GroupNorm'
        """
        return ModuleValidator.fix_and_validate(module)

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                     data_loader: DataLoader, noise_multiplier: float,
                     max_grad_norm: float | list[float] | None = None,
                     criterion: Callable | None = None,
                     loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str | Clipping = "flat",
                     noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = "hooks", batch_first: bool = True,
                     **kwargs: Any) -> tuple:
        """Opacus's ``make_private``: the model, the optimizer and a Poisson-sampling
        data loader (with ``grad_sample_mode="ghost"`` the criterion too, before the
        loader, as Opacus returns them).

        Args:
            module, optimizer, data_loader, noise_multiplier: as Opacus's. Several
                processes (``torch.distributed`` initialised, the module wrapped in
                ``DistributedDataParallel`` or Opacus's ``DPDDP``, sharded with FSDP2's
                ``fully_shard``, or as it is): each rank gets its share of every Poisson
                batch of the whole dataset (the same ``len(loader)`` batches on every
                rank) and ``optimizer.step()`` sums the ranks' clipped gradients, the
                noise added once (:class:`PrivateStep`); DDP's own gradient all-reduce
                never runs. The batches' and the noise's seeds are one draw from torch's
                generator, rank 0's on every rank
                (:func:`~persample.dp.setup.shared_seeds`).
            max_grad_norm: ``C``; with ``clipping="per_layer"`` one number per trainable
                parameter (or one, split as ``C / sqrt(K)``).
            criterion: the loss (``"ghost"``: evaluated per sample by persample).
            loss_reduction: ``"mean"`` or ``"sum"``: how the loss the user backpropagates
                reduces the batch (``"hooks"``).
            poisson_sampling: ``True``: the loader's batches Poisson samples at rate
                ``1 / len(data_loader)``, as the accounting assumes. ``False`` (one
                process): the loader returned as it is, with a warning: each step is
                still accounted as a Poisson sample, as Opacus accounts it.
            clipping: ``"flat"``, ``"per_layer"`` or ``"adaptive"`` (Andrew et al. 2021:
                :class:`~persample.dp.AdaptiveClipping`, from Opacus's options
                ``target_unclipped_quantile``, ``unclipped_num_std``,
                ``clipbound_learning_rate``, ``max_clipbound``, ``min_clipbound``;
                ``max_grad_norm`` is the first ``C``; one process); or persample's
                :class:`~persample.dp.Clipping` (any kind, automatic and by groups
                too), without ``max_grad_norm``.
            noise_generator: a ``torch.Generator`` for the noise (not in secure mode;
                with FSDP2 seeded alike on every rank); default one seeded from the
                shared seed.
            grad_sample_mode: ``"hooks"`` (and Opacus's other names: ``"functorch"``,
                ``"ew"``) or ``"ghost"`` (and ``"ghost_fsdp"``).
            batch_first: ``False`` (one process): every tensor input has the batch in
                dim 1, as Opacus's option says (a sequence-first model); the outputs
                are read by the loss as they come.
            **kwargs: ``wrap_model=False`` (Opacus's): the user's module is used as it
                is, with hooks that keep its forwards, and a :class:`PrivateHooks`
                (``cleanup()`` removes them) is returned in place of the wrapped model;
                ``check=`` (persample's own: when a physical batch's result is
                certified, as for :class:`PrivateStep`); ``mechanism=``, a
                :class:`~persample.dp.BandMF` or :class:`~persample.dp.BLT` made for the
                run's steps (``epochs * len(data_loader)``): correlated noise, the
                loader's batches then drawn by cyclic Poisson sampling over its
                ``cycle_length`` groups and accounted as :class:`PrivateStep` does (with
                :meth:`make_private_with_epsilon`, ``mechanism="bandmf", bands=b`` or
                ``mechanism="blt", buffers=d`` too); Opacus's other options are
                refused by name, and so is user-level DP (``user_ids=``,
                ``records_per_user=``: the loader's batches reach the optimizer's step
                without their users; :func:`~persample.dp.make_private` and
                ``PrivateTrainer`` take it).

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion,
            data_loader)`` with ``"ghost"``; ``module`` a :class:`PrivateModule`, or with
            ``wrap_model=False`` a :class:`PrivateHooks`.

        Raises:
            ValueError: an option persample does not take (named), user-level DP,
                optimizer parameters that are not the module's, ``secure_mode``,
                ``poisson_sampling=False`` or ``batch_first=False`` with several
                processes, or a data loader whose dataset has no length.
            MixesSamplesError: a module that mixes samples (BatchNorm in training mode:
                named, with the fix, :class:`~persample.dp.ModuleValidator`), a
                ``ValueError`` and persample's (and Opacus's) ``UnsupportedModuleError``.
        """
        adaptive = {k: kwargs.pop(k) for k in ADAPTIVE_OPTIONS if k in kwargs}
        check = kwargs.pop("check", None)
        mechanism = check_mechanism(kwargs.pop("mechanism", None))
        wrap_model = kwargs.pop("wrap_model", True)
        self._refuse(optimizer, module, poisson_sampling, clipping, batch_first, loss_reduction,
                     grad_sample_mode, kwargs)
        n = dataset_size(data_loader.dataset, "DataLoader's dataset")
        q = 1 / len(data_loader)  # as Opacus: one epoch of len(loader) Poisson batches
        expected = max(1, int(n * q))
        inner = unwrapped(module)
        mixing = mixing_reason_of(inner)
        if mixing is not None:  # (refused now, not at the first optimizer.step())
            raise MixesSamplesError(
                f"{mixing} In a DP training script: model = "
                "persample.dp.ModuleValidator.fix(model) before make_private (BatchNorm to "
                "GroupNorm, as Opacus's ModuleValidator does).")
        if not poisson_sampling:
            warnings.warn("poisson_sampling=False: the loader's batches are used as they "
                          "are, and the accountant still accounts each step as a Poisson "
                          f"sample of rate {q:.4g} (as Opacus does): the epsilon reported "
                          "is not a guarantee for these batches", stacklevel=2)
        stepped = inner if batch_first else _BatchSecond(inner)
        params = [name for name, p in stepped.named_parameters() if p.requires_grad]
        chosen = _clipping(clipping, max_grad_norm, params, adaptive)
        seeds = None if self.secure_mode else shared_seeds()  # rank 0's, on every rank
        if noise_generator is None and seeds is not None:
            noise_generator = seeds.noise_generator(next(inner.parameters()).device)
        step = PrivateStep(stepped, criterion if "ghost" in grad_sample_mode else _LinearLoss(),
                           noise_multiplier=noise_multiplier, expected_batch_size=expected,
                           generator=noise_generator, sample_rate=q,
                           accountant=self.accountant_kind, secure_mode=self.secure_mode,
                           check=check, clipping=chosen, mechanism=mechanism)
        self.steps.append(step)
        wrapped = PrivateModule(module) if wrap_model else PrivateHooks(module)
        private = PrivateOptimizer(optimizer, wrapped.forwards, step, loss_reduction,
                                   batch_first)
        loader = data_loader if not poisson_sampling else \
            _poisson_loader(data_loader, q, step, seeds, mechanism)
        if "ghost" in grad_sample_mode:
            private.criterion = criterion
            return wrapped, private, PrivateCriterion(criterion, wrapped.forwards, private), \
                loader
        return wrapped, private, loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float,
                                  target_delta: float, epochs: int,
                                  max_grad_norm: float | list[float] | None = None,
                                  **kwargs: Any) -> tuple:
        """Opacus's ``make_private_with_epsilon``: the noise multiplier that spends
        ``(target_epsilon, target_delta)`` in ``epochs`` epochs of ``len(data_loader)``
        steps (:func:`~persample.dp.noise_multiplier_for`), then :meth:`make_private`."""
        steps = epochs * len(data_loader)
        mechanism = resolve_mechanism(  # (a name: made for the epochs planned)
            kwargs.pop("mechanism", None), steps, 1 / len(data_loader),
            bands=kwargs.pop("bands", None), buffers=kwargs.pop("buffers", None))
        if mechanism is not None:
            kwargs["mechanism"] = mechanism
        (_, rate, count), = accounted_runs(mechanism, 0.0, 1 / len(data_loader), steps)
        sigma = noise_multiplier_for(target_epsilon, target_delta, rate, count,
                                     self.accountant_kind)
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs)

    @property
    def accountant(self) -> Any:
        """The accountant of the last :meth:`make_private`'s steps."""
        return self.steps[-1].accountant if self.steps else None

    def get_epsilon(self, delta: float) -> float:
        """The privacy spent by the optimizer steps so far, at ``delta``."""
        return self.steps[-1].epsilon(delta) if self.steps else 0.0

    def save_checkpoint(self, *, path: Any, module: nn.Module,
                        optimizer: Any = None, noise_scheduler: Any = None,
                        grad_clip_scheduler: Any = None,
                        checkpoint_dict: dict[str, Any] | None = None,
                        module_state_dict_kwargs: dict[str, Any] | None = None,
                        torch_save_kwargs: dict[str, Any] | None = None) -> None:
        """Opacus's ``save_checkpoint``: the module's, the accountant's and the optimizer's
        (and the schedulers') state in one ``torch.save`` at ``path``, under Opacus's keys;
        and the DP step's own (its noise generator, a mechanism's draws) under
        ``"persample_step_state_dict"``.

        Args:
            path: a file name or a binary file object, as ``torch.save`` takes.
            module: the model :meth:`make_private` returned (its state under Opacus's
                ``_module.`` names) or the module itself.
            optimizer, noise_scheduler, grad_clip_scheduler: saved where given.
            checkpoint_dict: entries to save beside them.
            module_state_dict_kwargs, torch_save_kwargs: passed on.

        Raises:
            ValueError: before :meth:`make_private` (no accountant yet).

        Examples:
            >>> import io
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> net = nn.Linear(4, 2)
            >>> engine = PrivacyEngine()
            >>> model, opt, loader = engine.make_private(
            ...     module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            ...     data_loader=DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4),
            ...     noise_multiplier=1.0, max_grad_norm=1.0)
            >>> buf = io.BytesIO()
            >>> engine.save_checkpoint(path=buf, module=model, optimizer=opt)
            >>> _ = buf.seek(0)
            >>> sorted(engine.load_checkpoint(path=buf, module=model, optimizer=opt))[:2]
            ['module_state_dict', 'optimizer_state_dict']
        """
        step = self._last_step("save_checkpoint")
        checkpoint = dict(checkpoint_dict or {})
        checkpoint["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
        checkpoint["privacy_accountant_state_dict"] = self.accountant.state_dict()
        checkpoint["persample_step_state_dict"] = step.state_dict()
        for key, value in (("optimizer_state_dict", optimizer),
                           ("noise_scheduler_state_dict", noise_scheduler),
                           ("grad_clip_scheduler_state_dict", grad_clip_scheduler)):
            if value is not None:
                checkpoint[key] = value.state_dict()
        torch.save(checkpoint, path, **(torch_save_kwargs or {}))

    def load_checkpoint(self, *, path: Any, module: nn.Module, optimizer: Any = None,
                        noise_scheduler: Any = None, grad_clip_scheduler: Any = None,
                        module_load_dict_kwargs: dict[str, Any] | None = None,
                        torch_load_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Opacus's ``load_checkpoint``: :meth:`save_checkpoint`'s states back into the
        module, the accountant (an Opacus checkpoint's too: its ``history`` and
        ``mechanism``), the DP step, and the optimizer and schedulers given; returns the
        checkpoint (a dict).

        Raises:
            ValueError: before :meth:`make_private`; and the errors of each
                ``load_state_dict``.
        """
        step = self._last_step("load_checkpoint")
        checkpoint = torch.load(path, **{"weights_only": False, **(torch_load_kwargs or {})})
        module.load_state_dict(checkpoint["module_state_dict"],
                               **(module_load_dict_kwargs or {}))
        if "persample_step_state_dict" in checkpoint:
            step.load_state_dict(checkpoint["persample_step_state_dict"])
        else:  # an Opacus checkpoint: {"history": [(sigma, q, steps)], "mechanism"}
            saved = checkpoint["privacy_accountant_state_dict"]
            self.accountant.load_state_dict({
                "accountant": saved.get("accountant", saved.get("mechanism")),
                "history": [list(run) for run in saved["history"]]})
        for key, value in (("optimizer_state_dict", optimizer),
                           ("noise_scheduler_state_dict", noise_scheduler),
                           ("grad_clip_scheduler_state_dict", grad_clip_scheduler)):
            if value is not None and checkpoint.get(key):
                value.load_state_dict(checkpoint[key])
        return checkpoint

    def _last_step(self, what: str) -> PrivateStep:
        if not self.steps or self.accountant is None:
            raise ValueError(f"{what} needs the accountant that make_private makes: call "
                             "make_private first")
        return self.steps[-1]

    def _refuse(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                poisson_sampling: bool, clipping: str | Clipping, batch_first: bool,
                loss_reduction: str,
                grad_sample_mode: str, kwargs: dict) -> None:
        ours = {id(p) for p in module.parameters()}
        if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("Module parameters are different than optimizer Parameters (as "
                             "Opacus says): make the optimizer from the parameters of the "
                             "module passed to make_private, after ModuleValidator.fix")
        reasons = {
            "poisson_sampling=False with several processes": not poisson_sampling and (
                world() or (1, 0))[0] > 1,
            f"clipping={clipping!r} (flat, per_layer, adaptive or a persample.dp.Clipping)":
                not isinstance(clipping, Clipping)
                and clipping not in ("flat", "per_layer", "adaptive"),
            "batch_first=False with several processes": not batch_first and (
                world() or (1, 0))[0] > 1,
            f"loss_reduction={loss_reduction!r} (mean or sum)":
                loss_reduction not in ("mean", "sum"),
            f"grad_sample_mode={grad_sample_mode!r}":
                grad_sample_mode not in ("hooks", "functorch", "ew", "ghost", "ghost_fsdp"),
            "secure_mode with several processes (the ranks split one Poisson sample, drawn "
            "alike from one seed)": self.secure_mode and (world() or (1, 0))[0] > 1,
            "user-level DP (user_ids=, records_per_user=): the loader's batches reach the "
            "optimizer's step without their users; use persample.dp.make_private(..., "
            "user_ids=) or PrivateTrainer": bool({"user_ids", "records_per_user"} & set(kwargs)),
        }
        reasons.update({f"the option {name}={value!r}": True for name, value in kwargs.items()
                        if name != "rand_on_empty" or value not in (True, False)})
        for reason, present in reasons.items():
            if present:
                raise ValueError(f"persample's PrivacyEngine does not take {reason}")


ADAPTIVE_OPTIONS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound",
                    "min_clipbound", "unclipped_num_std")  # Opacus's, for clipping="adaptive"


def _clipping(clipping: str | Clipping, max_grad_norm: Any, names: list[str],
              adaptive: dict[str, Any]) -> Clipping:
    """The :class:`Clipping` of Opacus's ``clipping``, ``max_grad_norm`` and
    (``"adaptive"``) its options of adaptive clipping, or persample's own value."""
    if isinstance(clipping, Clipping):
        if max_grad_norm is not None or adaptive:
            raise ValueError("with clipping=persample.dp.Clipping(...), pass no "
                             "max_grad_norm or adaptive options: the Clipping holds them")
        return clipping
    if max_grad_norm is None:
        raise ValueError(f"clipping={clipping!r} needs max_grad_norm (the clipping norm C)")
    if adaptive and clipping != "adaptive":
        raise ValueError(f"persample's PrivacyEngine takes {', '.join(sorted(adaptive))} "
                         "with clipping='adaptive' only")
    if clipping == "adaptive":
        missing = [k for k in ("target_unclipped_quantile", "unclipped_num_std")
                   if k not in adaptive]
        if missing:
            raise ValueError(f"clipping='adaptive' needs {' and '.join(missing)}")
        return Clipping.flat(max_grad_norm, adaptive=AdaptiveClipping(**adaptive))
    if clipping == "flat":
        return Clipping.flat(max_grad_norm)
    if isinstance(max_grad_norm, (list, tuple)):
        if len(max_grad_norm) != len(names):
            raise ValueError(f"clipping='per_layer' takes one max_grad_norm per trainable "
                             f"parameter ({len(names)}), got {len(max_grad_norm)}")
        return Clipping.grouped(list(max_grad_norm), [[n] for n in names])
    return Clipping.layerwise(max_grad_norm)


class DPDataLoader(DataLoader):
    """Opacus's ``DPDataLoader``: a ``DataLoader`` whose batches are Poisson samples of
    its dataset (each sample in with probability ``sample_rate``, so batch sizes vary and
    may be 0), collated safely when empty. :meth:`PrivacyEngine.make_private` returns one.

    Args:
        dataset: a map-style dataset (with a length).
        sample_rate: ``q`` in ``(0, 1]``; ``round(1 / q)`` batches an iteration.
        collate_fn: as ``DataLoader``'s (default ``default_collate``); an empty batch
            comes as the dataset's first sample's tensors with 0 rows.
        drop_last: ignored (as Opacus's: no batch is dropped).
        generator: the ``torch.Generator`` that draws the batches; with
            ``distributed=True`` seeded alike on every rank (default: one seed, rank 0's,
            :func:`~persample.dp.setup.shared_seeds`).
        distributed: every rank draws the same Poisson sample and keeps its share.
        batch_first: must be ``True``.
        rand_on_empty: must be ``False`` (an empty batch is empty).
        **kwargs: ``DataLoader``'s other arguments (workers, pinned memory).

    Raises:
        ValueError: ``batch_first=False``, ``rand_on_empty=True``, a batch size or a
            sampler given (the Poisson sampler is the loader's), ``q`` outside ``(0, 1]``.

    Examples:
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(100, 3), torch.arange(100))
        >>> loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=10))
        >>> loader.sample_rate, len(loader), isinstance(loader, DataLoader)
        (0.1, 10, True)

    Source: Opacus (Yousefpour et al. 2021), ``opacus.data_loader.DPDataLoader``; Poisson
    sampling as DP-SGD's accounting assumes (Abadi et al. 2016).
    """

    def __init__(self, dataset: Any, *, sample_rate: float, collate_fn: Any = None,
                 drop_last: bool = False, generator: torch.Generator | None = None,
                 distributed: bool = False, batch_first: bool = True,
                 rand_on_empty: bool = False, **kwargs: Any):
        sampler = kwargs.pop("_batch_sampler", None)  # (make_private's own)
        taken = [k for k in ("batch_size", "sampler", "batch_sampler", "shuffle") if k in kwargs]
        if not batch_first or rand_on_empty or taken:
            raise ValueError("persample's DPDataLoader does not take " + (
                "batch_first=False" if not batch_first else "rand_on_empty=True"
                if rand_on_empty else f"{taken[0]}= (its batches are Poisson samples)"))
        if sampler is None:
            size, rank = (world() or (1, 0)) if distributed else (1, 0)
            if size > 1 and generator is None:
                generator = shared_seeds().sampling_generator()
            sampler = PoissonBatchSampler(dataset_size(dataset, "dataset"), sample_rate,
                                          None, generator, rank, size)
        self.sample_rate, self.distributed = float(sample_rate), distributed
        super().__init__(dataset, batch_sampler=sampler,
                         collate_fn=EmptySafeCollate(dataset, collate_fn), **kwargs)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, distributed: bool = False,
                         generator: torch.Generator | None = None, batch_first: bool = True,
                         rand_on_empty: bool = False) -> DPDataLoader:
        """``data_loader``'s dataset, collate function and workers, with Poisson batches
        at rate ``1 / len(data_loader)`` (the same expected batch size), as Opacus's."""
        options = loader_options(data_loader)
        collate = options.pop("collate_fn")
        return cls(data_loader.dataset, sample_rate=1 / len(data_loader), collate_fn=collate,
                   generator=generator, distributed=distributed, batch_first=batch_first,
                   rand_on_empty=rand_on_empty, **options)


def _poisson_loader(loader: DataLoader, q: float, step: PrivateStep, seeds: Seeds | None,
                    mechanism: Mechanism | None = None) -> DataLoader:
    """The loader's dataset, collate function and workers, with Poisson-sampled batches:
    ``len(loader)`` an epoch at rate ``q`` (Opacus's ``DPDataLoader``), drawn from the
    shared ``seeds`` (``None``, secure mode: from the OS's secure generator). With
    several processes every rank draws the same sample of the whole dataset and keeps
    its share (:func:`~persample.dp.setup.share`): the ranks' batches make one Poisson
    sample. With a ``mechanism``, cyclic Poisson sampling over its ``cycle_length``
    groups."""
    source = step.generator if seeds is None else seeds.sampling_generator()
    size, rank = world() or (1, 0)
    n = len(loader.dataset)
    sampler = PoissonBatchSampler(n, q, len(loader), source, rank, size) if mechanism is None \
        else CyclicPoissonSampler(n, q, mechanism.cycle_length, len(loader), source, rank,
                                  size)
    return DPDataLoader(loader.dataset, sample_rate=q, _batch_sampler=sampler,
                        **loader_options(loader))


class BatchMemoryManager:
    """Opacus's ``BatchMemoryManager``: each Poisson batch of the data loader
    :meth:`PrivacyEngine.make_private` returned, given in physical batches of at most
    ``max_physical_batch_size`` samples, so that a logical batch larger than memory
    takes several forwards and backwards. ``optimizer.step()`` after a physical batch
    that does not end its logical batch only adds its clipped per-sample gradients to
    the step; after the last one it adds the noise, writes ``p.grad``, accounts one
    step and runs the optimizer's own step. An empty logical batch is one empty
    physical batch (its step: the noise alone).

    Args:
        data_loader: the loader ``make_private`` returned (its Poisson batch sampler).
        max_physical_batch_size: the most samples a forward takes, ``>= 1``. A logical
            batch of ``b`` samples is cut in ``ceil(b / max)`` physical batches of
            sizes differing by at most one (as Opacus cuts it); with ``W`` processes
            each rank cuts its share in ``ceil(b / (max * W))``, as many on every rank.
        optimizer: the optimizer ``make_private`` returned.

    Raises:
        ValueError: ``optimizer`` or ``data_loader`` not ``make_private``'s, or
            ``max_physical_batch_size`` below 1.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
        >>> engine = PrivacyEngine()
        >>> model, optimizer, loader = engine.make_private(
        ...     module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...     data_loader=DataLoader(data, batch_size=32), noise_multiplier=1.0,
        ...     max_grad_norm=1.0)
        >>> with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8,
        ...                         optimizer=optimizer) as physical:
        ...     for x, y in physical:  # the Opacus loop, as it is
        ...         optimizer.zero_grad()
        ...         nn.CrossEntropyLoss()(model(x), y).backward()
        ...         optimizer.step()
        ...         assert len(x) <= 8
        >>> engine.accountant.steps  # one step per logical batch
        2

    Source: Opacus (Yousefpour et al. 2021), ``opacus.utils.batch_memory_manager``;
    Abadi et al. 2016 (lots split into smaller groups).
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int,
                 optimizer: PrivateOptimizer):
        if not isinstance(optimizer, PrivateOptimizer):
            raise ValueError("BatchMemoryManager takes the optimizer PrivacyEngine."
                             f"make_private returned, got {type(optimizer).__name__}")
        if not isinstance(data_loader.batch_sampler, (PoissonBatchSampler, BatchSampler)):
            raise ValueError("BatchMemoryManager takes the data loader PrivacyEngine."
                             "make_private returned (Poisson-sampled batches, or with "
                             "poisson_sampling=False the loader's own batches)")
        if (isinstance(max_physical_batch_size, bool)
                or not isinstance(max_physical_batch_size, int) or max_physical_batch_size < 1):
            raise ValueError(f"max_physical_batch_size must be an int >= 1, got "
                             f"{max_physical_batch_size!r}")
        self.data_loader, self.optimizer = data_loader, optimizer
        self.max_physical_batch_size = max_physical_batch_size

    def __enter__(self) -> DataLoader:
        loader = self.data_loader
        sampler = _Splitting(loader.batch_sampler, self.max_physical_batch_size,
                             self.optimizer.skips)
        return DataLoader(loader.dataset, batch_sampler=sampler, **loader_options(loader))

    def __exit__(self, *exc: Any) -> None:
        self.optimizer.skips.clear()


class _Splitting(PhysicalBatches):
    """Each logical batch of the loader's sampler ``logical`` (drawn whole, alike on
    every rank) as this rank's physical batches, Opacus's count of them (at least one):
    ``ceil(b / (size * world_size))`` of near-equal size for the whole sample's ``b``,
    as many on every rank (FSDP2's collectives), a rank's share possibly in empty ones.
    Tells the optimizer, in order, which of them end their logical batch (a data
    loader's workers draw ahead of the steps, so the marks queue)."""

    def __init__(self, logical: PoissonBatchSampler | BatchSampler, size: int,
                 skips: deque[bool]):
        if isinstance(logical, PoissonBatchSampler):
            super().__init__(logical.whole(), size, rank=logical.rank,  # every rank's sample
                             world_size=logical.world_size)
        else:  # poisson_sampling=False: the loader's own batches, one process
            super().__init__(_Fixed(logical), size)
        self.skips = skips

    def cut(self, drawn: list[int]) -> list[list[int]]:
        count = even_parts(len(drawn), self.size, self.world_size)  # Opacus's
        return physical_batches(drawn, parts=count, rank=self.rank, world_size=self.world_size)

    def __iter__(self) -> Iterator[list[int]]:
        for drawn in self.logical:  # the whole sample: (b,) indices
            parts = self.cut(drawn)
            for k, part in enumerate(parts):
                self.skips.append(k < len(parts) - 1)
                yield part


class _Fixed:
    """A ``DataLoader``'s own ``BatchSampler`` as :class:`_Splitting` reads a logical
    sampler: its batches, and their size as the expected one."""

    def __init__(self, sampler: BatchSampler):
        self.sampler, self.expected_batch_size = sampler, sampler.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
