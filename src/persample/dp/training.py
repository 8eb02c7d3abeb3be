"""Private training set up in one call: :func:`make_private`.

From a model, an optimizer, a dataset, a privacy target and the batch sizes it gives
what a DP-SGD loop needs, as Opacus's ``PrivacyEngine.make_private_with_epsilon``
does, without wrapping or changing the model or the optimizer: Poisson-sampled
logical batches (Abadi et al. 2016) split into physical ones that fit in memory, a
:class:`~persample.dp.PrivateStep` with the noise multiplier that reaches the target
epsilon after the planned steps (:func:`~persample.dp.noise_multiplier_for`), and
its accountant, stepped once per release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from .accounting import noise_multiplier_for
from .clip import Accumulated
from .sampling import PoissonBatchSampler
from .step import PrivateStep


@dataclass
class PrivateTraining:
    """What :func:`make_private` sets up. ``step``: the :class:`PrivateStep` (its
    ``accountant`` counts the releases); ``noise_multiplier``, ``sample_rate`` (``q``),
    ``steps_per_epoch`` and ``epochs`` as planned.

    Example:
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
    dataset: Dataset
    sampler: PoissonBatchSampler
    collate: Callable[[list], Any]
    physical_batch_size: int
    noise_multiplier: float
    sample_rate: float
    steps_per_epoch: int
    epochs: int

    def batches(self) -> Iterator[Iterator[Any]]:
        """One epoch: ``steps_per_epoch`` logical batches, each drawn by Poisson
        sampling (possibly empty) and yielded as an iterator of its physical batches
        (collated, at most ``physical_batch_size`` samples each; an empty logical batch
        yields none)."""
        for indices in self.sampler:
            yield self._physical(indices)

    def _physical(self, indices: list[int]) -> Iterator[Any]:
        for start in range(0, len(indices), self.physical_batch_size):
            part = indices[start : start + self.physical_batch_size]
            yield self.collate([self.dataset[i] for i in part])

    def accumulate(self, inputs: Any, targets: Any) -> Accumulated:
        """``step.accumulate``: one physical batch's clipped sums; its ``(b,)`` losses and
        norms."""
        return self.step.accumulate(inputs, targets)

    def release(self) -> None:
        """The end of a logical batch: ``step.release()`` (noise, ``p.grad``, one
        accounted step), then ``optimizer.step()`` and ``optimizer.zero_grad()``."""
        self.step.release()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def epsilon(self, delta: float) -> float:
        """The privacy spent by the releases so far, at ``delta``."""
        return self.step.epsilon(delta)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset,
                 loss_fn: Callable[[Any, Any], Tensor], *, target_epsilon: float,
                 target_delta: float, epochs: int, max_grad_norm: float,
                 expected_batch_size: int, physical_batch_size: int,
                 accountant: str = "rdp", generator: torch.Generator | None = None,
                 collate_fn: Callable[[list], Any] | None = None, per_layer: bool = False
                 ) -> PrivateTraining:
    """Set up DP-SGD to spend at most ``(target_epsilon, target_delta)`` in ``epochs``.

    The sample rate is ``q = expected_batch_size / len(dataset)``; an epoch is
    ``round(1 / q)`` logical batches, so training takes ``epochs * round(1 / q)``
    steps, and the noise multiplier is the smallest that keeps them within the target
    (``noise_multiplier_for``). Neither the model nor the optimizer is wrapped or
    changed: the loop calls ``accumulate`` per physical batch and ``release`` per
    logical one. One process: with several, give each rank its share of every logical
    batch (``PoissonBatchSampler(..., rank=r, world_size=W)``) and a :class:`PrivateStep`.

    Args:
        model: the ``nn.Module`` (plain, or wrapped in ``DistributedDataParallel``).
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        dataset: a map-style dataset with ``len()``; ``dataset[i]`` one sample.
        loss_fn: ``loss_fn(output, targets)``, as for :class:`PrivateStep`.
        target_epsilon: the epsilon budget, ``> 0``.
        target_delta: ``delta`` in ``(0, 1)`` (below ``1 / len(dataset)`` as a rule).
        epochs: passes over the data planned, ``>= 1``.
        max_grad_norm: the clipping norm ``C > 0``.
        expected_batch_size: the logical batch size expected, ``q * N``, ``>= 1``.
        physical_batch_size: the most samples one forward and backward takes, ``>= 1``.
        accountant: ``"rdp"``, ``"pld"`` or ``"prv"``: how epsilon is computed, for the
            calibration and during training.
        generator: a CPU ``torch.Generator`` for the batches (seed it to reproduce a
            run); the noise's generator, on the parameters' device, is seeded from it.
        collate_fn: how samples become a batch (default ``default_collate``); an empty
            logical batch has no physical batch to collate (its release is noise only).
        per_layer: clip each parameter's gradient to ``C / sqrt(K)``.

    Returns:
        a :class:`PrivateTraining`: ``batches()`` per epoch, ``accumulate`` and
        ``release``, ``epsilon(delta)``, and the plan (``noise_multiplier``,
        ``sample_rate``, ``steps_per_epoch``).

    Raises:
        ValueError: an argument outside its range, an empty dataset, or an expected
            batch larger than the dataset.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import TensorDataset
        >>> from persample.dp import make_private
        >>> net = nn.Linear(4, 3)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> data = TensorDataset(torch.randn(200, 4), torch.randint(0, 3, (200,)))
        >>> private = make_private(net, opt, data, nn.CrossEntropyLoss(), target_epsilon=2.0,
        ...                        target_delta=1e-5, epochs=1, max_grad_norm=1.0,
        ...                        expected_batch_size=50, physical_batch_size=20,
        ...                        generator=torch.Generator().manual_seed(0))
        >>> for logical in private.batches():
        ...     for x, y in logical:
        ...         _ = private.accumulate(x, y)
        ...     private.release()
        >>> private.step.accountant.steps, private.epsilon(1e-5) <= 2.0
        (4, True)

    Source: Abadi et al. 2016 (DP-SGD with Poisson-sampled lots); Opacus's
    ``make_private_with_epsilon`` and virtual steps.
    """
    n = len(dataset)
    for name, value in (("epochs", epochs), ("expected_batch_size", expected_batch_size),
                        ("physical_batch_size", physical_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if n == 0 or expected_batch_size > n:
        raise ValueError(f"expected_batch_size ({expected_batch_size}) must be at most the "
                         f"number of samples ({n})")
    q = expected_batch_size / n
    steps_per_epoch = max(1, round(1 / q))
    sigma = noise_multiplier_for(target_epsilon, target_delta, q, epochs * steps_per_epoch,
                                 accountant)
    noise = None
    if generator is not None:
        device = next(model.parameters()).device
        seed = int(torch.randint(2**62, (1,), generator=generator))
        noise = torch.Generator(device=device).manual_seed(seed)
    step = PrivateStep(model, loss_fn, max_grad_norm=max_grad_norm, noise_multiplier=sigma,
                       expected_batch_size=expected_batch_size, generator=noise,
                       per_layer=per_layer, sample_rate=q, accountant=accountant)
    sampler = PoissonBatchSampler(n, q, steps_per_epoch, generator)
    return PrivateTraining(step, optimizer, dataset, sampler,
                           collate_fn or default_collate, physical_batch_size,
                           sigma, q, steps_per_epoch, epochs)
