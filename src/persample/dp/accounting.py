"""Privacy accounting for DP-SGD, through Google's ``dp-accounting`` library.

DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy") takes
``steps`` steps; each samples every example independently with probability
``q`` (Poisson sampling, :mod:`persample.dp.sampling`), clips each sample's
gradient to norm ``C`` and adds Gaussian noise of std ``sigma * C`` to the sum.
One step is the event ``PoissonSampled(q, Gaussian(sigma))``, and training is
that event composed ``steps`` times. Nothing here computes a bound itself:
``dp_accounting`` does, with either

- ``"rdp"``: Renyi DP (Mironov 2017; Mironov, Talwar & Zhang 2019, "Renyi
  Differential Privacy of the Sampled Gaussian Mechanism"), fast (~50 ms per
  call), a slightly loose upper bound; or
- ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al.
  2022, "Connect the Dots"), tighter (epsilon 5-15 % smaller), slower (0.5-3 s
  per call for epsilon up to ~20; its cost grows with epsilon: a minute at
  sigma 0.05, out of memory at sigma 1e-4, so use ``"rdp"`` for tiny sigma);
- ``"prv"`` (optional, where Opacus is installed: ``pip install opacus``): privacy
  random variables composed by FFT (Gopi, Lee & Wutschitz 2021, "Numerical
  composition of differential privacy"), through Opacus's ``PRVAccountant``: the
  upper bound of its estimate, about as tight as PLD.

The neighbouring relation is add-or-remove-one example, the one Poisson
sampling is analysed under. ``epsilon`` is in nats (the ``e^epsilon`` of
(epsilon, delta)-DP); ``delta`` is a probability, usually well below ``1/N``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from numbers import Integral, Real

import dp_accounting
from dp_accounting import pld, rdp

ACCOUNTANTS = ("rdp", "pld", "prv")


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon of DP-SGD with Poisson sampling after ``steps`` steps, at ``delta``.

    Args:
        noise_multiplier: ``sigma >= 0``, the noise std divided by the clipping norm
            ``C`` (``persample.dp.private_grad``'s ``noise_multiplier``). 0 means no
            privacy (epsilon is infinite).
        sample_rate: ``q`` in ``(0, 1]``, the probability that a step includes a given
            example; ``expected_batch_size / N``.
        steps: how many steps, ``>= 0`` (0 gives epsilon 0).
        delta: the ``delta`` of (epsilon, delta)-DP, in ``(0, 1)``.
        accountant: ``"rdp"`` (Renyi DP, fast), ``"pld"`` (privacy loss
            distributions, tighter, slower) or ``"prv"`` (Opacus's PRV accountant,
            where Opacus is installed).

    Returns:
        epsilon as a Python float, ``>= 0``; ``math.inf`` when ``sigma`` is 0.

    Raises:
        ValueError: an argument outside its range, an unknown ``accountant``, or
            ``"prv"`` without Opacus.

    Examples:
        >>> round(epsilon(1.1, 256 / 60000, 14063, 1e-5), 2)  # MNIST, 60 epochs of 256
        2.6
        >>> round(epsilon(1.1, 256 / 60000, 14063, 1e-5, accountant="pld"), 2)
        2.38
    """
    _check(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps,
           delta=delta, accountant=accountant)
    if steps == 0:
        return 0.0
    return _epsilon_of([(float(noise_multiplier), float(sample_rate), int(steps))], delta,
                       accountant)


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier ``sigma`` that keeps DP-SGD within ``target_epsilon``.

    A search over ``sigma`` (Brent's method, ``dp_accounting.calibrate_dp_mechanism``)
    with a fresh accountant per trial, for ``steps`` Poisson-sampled Gaussian steps.

    Args:
        target_epsilon: the epsilon budget, ``> 0``.
        delta: the ``delta`` of (epsilon, delta)-DP, in ``(0, 1)``.
        sample_rate: ``q`` in ``(0, 1]``, ``expected_batch_size / N``.
        steps: how many steps training will take, ``>= 1``.
        accountant: ``"rdp"`` (fast), ``"pld"`` or ``"prv"`` (tighter, so a smaller sigma,
            but each trial takes seconds).
        tol: precision of the returned ``sigma`` (absolute), ``> 0``.

    Returns:
        ``sigma`` (a float ``> 0``) with ``epsilon(sigma, sample_rate, steps, delta,
        accountant) <= target_epsilon``, within ``tol`` of the smallest such value.

    Raises:
        ValueError: an argument outside its range, or an unknown ``accountant``.

    Examples:
        >>> sigma = noise_multiplier_for(3.0, 1e-5, sample_rate=0.04, steps=1000)
        >>> round(sigma, 3), epsilon(sigma, 0.04, 1000, 1e-5) <= 3.0
        (2.068, True)
    """
    _check(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps,
           accountant=accountant)
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to calibrate the noise, got {steps}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    q, n = float(sample_rate), int(steps)
    with _quiet():
        return float(dp_accounting.calibrate_dp_mechanism(
            lambda: _fresh(accountant),
            lambda sigma: _event([(sigma, q, n)]),
            target_epsilon=float(target_epsilon),
            target_delta=float(delta),
            tol=tol,
        ))


class PrivacyAccountant:
    """Counts DP-SGD steps during training and reports epsilon so far.

    State lives here, never on the model: a list of ``[sigma, q, count]`` runs of
    identical steps (a changing ``sigma`` or ``q`` starts a new run). ``epsilon``
    composes them with a fresh ``dp_accounting`` accountant each call (RDP: about
    50 ms; PLD: seconds), so ask for it every few steps, not every step.

    Args:
        accountant: ``"rdp"``, ``"pld"`` or ``"prv"`` (Opacus installed): see the module.

    Raises:
        ValueError: an unknown ``accountant``.

    Examples:
        >>> acct = PrivacyAccountant()
        >>> for _ in range(100):
        ...     acct.step(noise_multiplier=1.0, sample_rate=0.01)
        >>> acct.steps, round(acct.epsilon(1e-5), 3) == round(epsilon(1.0, 0.01, 100, 1e-5), 3)
        (100, True)
    """

    def __init__(self, accountant: str = "rdp"):
        _check(accountant=accountant)
        self.accountant = accountant
        self.history: list[list] = []  # [[sigma, q, count], ...] in order

    @property
    def steps(self) -> int:
        """How many steps have been recorded."""
        return sum(count for _, _, count in self.history)

    def step(self, noise_multiplier: float, sample_rate: float, count: int = 1) -> None:
        """Record ``count`` steps with noise multiplier ``sigma`` and sample rate ``q``.

        Args:
            noise_multiplier: ``sigma >= 0`` of these steps.
            sample_rate: ``q`` in ``(0, 1]`` of these steps.
            count: how many identical steps, ``>= 1``.

        Raises:
            ValueError: an argument outside its range.
        """
        _check(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        sigma, q = float(noise_multiplier), float(sample_rate)
        if self.history and self.history[-1][:2] == [sigma, q]:
            self.history[-1][2] += int(count)
        else:
            self.history.append([sigma, q, int(count)])

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Epsilon of all steps recorded so far, at ``delta``; 0 before any step.

        Args:
            delta: in ``(0, 1)``.
            accountant: ``"rdp"``, ``"pld"`` or ``"prv"`` for this call only; default the
                accountant given at construction.

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``, or an unknown ``accountant``.
        """
        accountant = accountant or self.accountant
        _check(delta=delta, accountant=accountant)
        if not self.history:
            return 0.0
        return _epsilon_of([tuple(run) for run in self.history], delta, accountant)

    def __len__(self) -> int:
        """The runs of identical steps in :attr:`history` (what ``len()`` of an Opacus
        accountant counts; :attr:`steps` is the steps).

        Examples:
            >>> acct = PrivacyAccountant()
            >>> acct.step(1.0, 0.01, count=100)
            >>> acct.step(2.0, 0.01)
            >>> len(acct), acct.steps
            (2, 101)
        """
        return len(self.history)

    def mechanism(self) -> str:
        """The accounting's name, as an Opacus accountant's ``mechanism()`` gives it:
        ``"rdp"``, ``"pld"`` or ``"prv"``.

        Examples:
            >>> PrivacyAccountant("pld").mechanism()
            'pld'
        """
        return self.accountant

    def get_epsilon(self, delta: float) -> float:
        """Opacus's accountants' name for :meth:`epsilon` (``get_epsilon(delta=...)``), so
        that a script reading ``privacy_engine.accountant`` runs as it is.

        Examples:
            >>> acct = PrivacyAccountant()
            >>> acct.step(1.0, 0.01, count=100)
            >>> acct.get_epsilon(delta=1e-5) == acct.epsilon(1e-5)
            True
        """
        return self.epsilon(delta)

    def state_dict(self) -> dict:
        """The accountant's state for a checkpoint: ``{"accountant", "history"}`` (plain
        Python values, copied).

        Examples:
            >>> acct = PrivacyAccountant()
            >>> acct.step(1.0, 0.01, count=5)
            >>> again = PrivacyAccountant()
            >>> again.load_state_dict(acct.state_dict())
            >>> again.steps, again.history == acct.history
            (5, True)
        """
        return {"accountant": self.accountant, "history": [list(run) for run in self.history]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state (the steps recorded and the accountant).

        Raises:
            ValueError: an unknown accountant or a malformed run in ``history``.
        """
        _check(accountant=state["accountant"])
        history = []
        for run in state["history"]:
            sigma, q, count = run
            _check(noise_multiplier=sigma, sample_rate=q)
            if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
                raise ValueError(f"a run's count must be an int >= 1, got {count!r}")
            history.append([float(sigma), float(q), int(count)])
        self.accountant, self.history = state["accountant"], history

    def __repr__(self) -> str:
        return f"PrivacyAccountant(accountant={self.accountant!r}, steps={self.steps})"


def _fresh(accountant: str) -> dp_accounting.PrivacyAccountant:
    if accountant == "prv":
        return _PrvAccountant()
    return rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()


class _PrvAccountant(dp_accounting.PrivacyAccountant):
    """``dp_accounting``'s accountant interface over Opacus's PRV accountant (Gopi et al.
    2021), for Poisson-sampled Gaussian events: what ``compose`` gets becomes Opacus's
    history of ``(sigma, q, steps)`` runs."""

    def __init__(self):
        try:
            from opacus.accountants import PRVAccountant
        except ImportError as err:
            raise ValueError("accountant='prv' uses Opacus's PRV accountant, and Opacus is "
                             "not installed: pip install opacus (or use 'pld')") from err
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        self._prv = PRVAccountant()

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, dp_accounting.NoOpDpEvent):
            return None
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            return self._maybe_compose(event.event, count * event.count, do_compose)
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for part in event.events:
                failed = self._maybe_compose(part, count, do_compose)
                if failed is not None:
                    return failed
            return None
        if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
                event.event, dp_accounting.GaussianDpEvent):
            if do_compose and count:
                sigma, q = event.event.noise_multiplier, event.sampling_probability
                self._prv.history.append((sigma, q, count))
            return None
        return self.CompositionErrorDetails(event, "the PRV accountant takes Poisson-sampled "
                                                   "Gaussian events only")

    def get_epsilon(self, target_delta: float) -> float:
        if not self._prv.history:
            return 0.0
        try:
            with warnings.catch_warnings():  # Opacus's RDP bound of the domain: about orders
                warnings.simplefilter("ignore", UserWarning)
                return float(self._prv.get_epsilon(target_delta))
        except OverflowError:  # its domain is unbounded: sigma far too small to account
            return math.inf


def _event(runs: list[tuple[float, float, int]]) -> dp_accounting.DpEvent:
    """``[(sigma, q, count)]`` -> the composed DP-SGD event. The unsampled (``q = 1``)
    Gaussians compose exactly into one, of ``sigma = (sum count / sigma_i^2)^(-1/2)``
    (a correlated mechanism's releases, spent one by one)."""
    whole = [(sigma, count) for sigma, q, count in runs if q == 1.0]
    if len(whole) > 1:
        sigma = sum(count / s ** 2 for s, count in whole) ** -0.5
        runs = [run for run in runs if run[1] != 1.0] + [(sigma, 1.0, 1)]
    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
        for sigma, q, count in runs
    ]
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


def _epsilon_of(runs: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    if any(sigma == 0 for sigma, _, _ in runs):
        return math.inf  # no noise: no privacy (both accountants agree; skip their work)
    with _quiet():
        return float(_fresh(accountant).compose(_event(runs)).get_epsilon(float(delta)))


@contextlib.contextmanager
def _quiet():
    """Silence ``dp_accounting``'s absl warnings for the duration.

    For ``q`` above ~0.1 its RDP series fails to converge at a few fractional
    orders below 2 and it logs one warning per order per call; it then leaves
    those orders out, so the bound stays valid (just taken over fewer orders).
    """
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check(**values) -> None:
    """Validate the named arguments; errors say which one, its range, and what was given."""
    for name, v in values.items():
        if name == "accountant":
            if v not in ACCOUNTANTS:
                raise ValueError(f"accountant={v!r} is not one of {ACCOUNTANTS}")
            continue
        if name == "steps":
            if isinstance(v, bool) or not isinstance(v, Integral) or v < 0:
                raise ValueError(f"steps must be an int >= 0, got {v!r}")
            continue
        if not isinstance(v, Real) or isinstance(v, bool) or math.isnan(v):
            raise ValueError(f"{name} must be a number, got {v!r}")
        if name == "noise_multiplier" and not (0 <= v < math.inf):
            raise ValueError(f"noise_multiplier (sigma) must be finite and >= 0, got {v}")
        if name == "sample_rate" and not 0 < v <= 1:
            raise ValueError(
                f"sample_rate (q) must be in (0, 1], got {v}: q = expected batch size / "
                "number of training examples")
        if name == "delta" and not 0 < v < 1:
            raise ValueError(
                f"delta must be in (0, 1), got {v}: usually well below 1 / (number of "
                "training examples), e.g. 1e-5")
        if name == "target_epsilon" and not 0 < v < math.inf:
            raise ValueError(f"target_epsilon must be finite and > 0, got {v}")
