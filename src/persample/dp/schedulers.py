"""Schedules of the noise multiplier and the clipping norm over a run, as Opacus's
``opacus.schedulers`` has them: the interface of torch's learning-rate schedulers, on
the optimizer's ``noise_multiplier`` (sigma) or ``max_grad_norm`` (the clipping norm
``C``) instead of its learning rate.

Each ``step()`` (after an epoch, or a step, as the user calls it) sets the attribute on
the optimizer :class:`~persample.dp.PrivacyEngine` returned; the accountant records each
DP step with the sigma it ran with, so a schedule is accounted as it ran.

- noise: :class:`ExponentialNoise`, :class:`StepNoise`, :class:`LambdaNoise`;
- clipping norm: :class:`ExponentialGradClip`, :class:`StepGradClip`,
  :class:`LambdaGradClip`.

Source: Opacus (Yousefpour et al. 2021), ``opacus.schedulers``; decaying noise
schedules: Yu et al. 2019, "Differentially private model publishing for deep learning".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _Schedule:
    """What every schedule shares: the optimizer, the epoch count (``last_epoch``), a
    ``state_dict`` of everything but the optimizer, and ``step()`` setting
    ``optimizer.<attribute>`` to :meth:`value`."""

    attribute = ""

    def __init__(self, optimizer: Any, *, last_epoch: int = -1) -> None:
        if not hasattr(optimizer, self.attribute):
            raise ValueError(
                f"{type(self).__name__} schedules optimizer.{self.attribute}, which "
                f"{type(optimizer).__name__} does not have: pass the optimizer that "
                "PrivacyEngine.make_private returned")
        self.optimizer = optimizer
        self.last_epoch = last_epoch
        self.step()

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state: every attribute but the optimizer."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state."""
        self.__dict__.update(state_dict)

    def value(self) -> float:
        """The attribute's value for epoch ``last_epoch``."""
        raise NotImplementedError

    def step(self) -> None:
        """One epoch on: set the optimizer's attribute to the schedule's value."""
        self.last_epoch += 1
        setattr(self.optimizer, self.attribute, self.value())

    def _current(self) -> float:
        return getattr(self.optimizer, self.attribute)


class _Exponential(_Schedule):
    def __init__(self, optimizer: Any, *, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self) -> float:
        """The current value times ``gamma``, each epoch after the first."""
        return self._current() if self.last_epoch == 0 else self._current() * self.gamma


class _Step(_Schedule):
    def __init__(self, optimizer: Any, *, step_size: int, gamma: float,
                 last_epoch: int = -1) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self) -> float:
        """The current value times ``gamma`` every ``step_size`` epochs."""
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current()
        return self.gamma * self._current()


class _Lambda(_Schedule):
    def __init__(self, optimizer: Any, *, scale: Callable[[int], float],
                 last_epoch: int = -1) -> None:
        self.scale = scale
        self.base = getattr(optimizer, self.attribute, None)
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self) -> float:
        """The value at the start times ``scale(epoch)`` (the factors do not compound)."""
        return self.base * self.scale(self.last_epoch)


class ExponentialNoise(_Exponential):
    """Multiplies ``optimizer.noise_multiplier`` by ``gamma`` every epoch.

    Args:
        optimizer: the optimizer :class:`~persample.dp.PrivacyEngine` returned.
        gamma: the factor per epoch (``< 1`` less noise, ``> 1`` more).
        last_epoch: the epoch of the last ``step()``; ``-1`` to start.

    Raises:
        ValueError: an optimizer without ``noise_multiplier``.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(noise_multiplier=2.0)
        >>> schedule = ExponentialNoise(opt, gamma=0.5)
        >>> schedule.step(); schedule.step(); opt.noise_multiplier
        0.5
    """

    attribute = "noise_multiplier"


class StepNoise(_Step):
    """Multiplies ``optimizer.noise_multiplier`` by ``gamma`` every ``step_size`` epochs.

    Args:
        optimizer: the optimizer :class:`~persample.dp.PrivacyEngine` returned.
        step_size: epochs between changes.
        gamma: the factor at each change.
        last_epoch: the epoch of the last ``step()``; ``-1`` to start.

    Raises:
        ValueError: an optimizer without ``noise_multiplier``.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(noise_multiplier=1.0)
        >>> schedule = StepNoise(opt, step_size=2, gamma=2.0)
        >>> for _ in range(4): schedule.step()
        >>> opt.noise_multiplier
        4.0
    """

    attribute = "noise_multiplier"


class LambdaNoise(_Lambda):
    """Sets ``optimizer.noise_multiplier`` to its first value times
    ``noise_lambda(epoch)``.

    Args:
        optimizer: the optimizer :class:`~persample.dp.PrivacyEngine` returned.
        noise_lambda: epoch (int) -> factor.
        last_epoch: the epoch of the last ``step()``; ``-1`` to start.

    Raises:
        ValueError: an optimizer without ``noise_multiplier``.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(noise_multiplier=1.0)
        >>> schedule = LambdaNoise(opt, noise_lambda=lambda epoch: 1 + epoch)
        >>> schedule.step(); schedule.step(); opt.noise_multiplier
        3.0
    """

    attribute = "noise_multiplier"

    def __init__(self, optimizer: Any, *, noise_lambda: Callable[[int], float],
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, scale=noise_lambda, last_epoch=last_epoch)


class ExponentialGradClip(_Exponential):
    """Multiplies ``optimizer.max_grad_norm`` (the clipping norm ``C``) by ``gamma`` every
    epoch. Arguments and errors as :class:`ExponentialNoise`'s.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(max_grad_norm=1.0)
        >>> schedule = ExponentialGradClip(opt, gamma=0.5)
        >>> schedule.step(); opt.max_grad_norm
        0.5
    """

    attribute = "max_grad_norm"


class StepGradClip(_Step):
    """Multiplies ``optimizer.max_grad_norm`` by ``gamma`` every ``step_size`` epochs.
    Arguments and errors as :class:`StepNoise`'s.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(max_grad_norm=1.0)
        >>> schedule = StepGradClip(opt, step_size=1, gamma=0.5)
        >>> schedule.step(); opt.max_grad_norm
        0.5
    """

    attribute = "max_grad_norm"


class LambdaGradClip(_Lambda):
    """Sets ``optimizer.max_grad_norm`` to its first value times
    ``scheduler_function(epoch)``. Arguments and errors as :class:`LambdaNoise`'s.

    Examples:
        >>> from types import SimpleNamespace
        >>> opt = SimpleNamespace(max_grad_norm=2.0)
        >>> schedule = LambdaGradClip(opt, scheduler_function=lambda epoch: 1 / (1 + epoch))
        >>> schedule.step(); opt.max_grad_norm
        1.0
    """

    attribute = "max_grad_norm"

    def __init__(self, optimizer: Any, *, scheduler_function: Callable[[int], float],
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, scale=scheduler_function, last_epoch=last_epoch)
