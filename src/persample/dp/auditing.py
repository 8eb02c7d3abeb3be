"""An audit of the privacy itself, in one training run (Steinke, Nasr & Jagielski 2023,
"Privacy Auditing with One (1) Training Run").

``m`` canary records are each added to the training set with probability 1/2, the model
is trained once with the DP step, and an auditor who does not know which canaries were
added guesses it from a score per canary: for the ``k+`` highest scores "added", for the
``k-`` lowest "not added", no guess for the rest. If the training is (epsilon,
delta)-DP in the canaries, the number of right guesses cannot beat randomized response
with ``e^eps / (1 + e^eps)`` accuracy by much: :func:`epsilon_lower_bound` turns the
count into a lower bound on epsilon that holds with the stated confidence. A bound
above the accountant's epsilon proves the step leaks more than its accounting says (a
bug: noise too small, clipping skipped, samples mixed); a bound below it proves
nothing wrong (audits are loose).

Two kinds of canaries, in the same run:

- **gradient canaries** (white box: the auditor sees every release). Canary ``k``'s
  gradient is ``s e_k`` on a table of ``m`` weights the audit adds beside the model
  (``s`` well above the clipping norm, so that a step that does not clip shows), and
  zero on the model; it goes through the step like any record (the same capture,
  rules, clipping, noise). Its score is the ``k``-th entry of the table's releases,
  summed over the steps: ``C`` each time it was sampled, plus the noise (Steinke et
  al.'s "Dirac canaries").
- **input canaries** (black box: the final model only): mislabelled copies of training
  inputs (a random input, a random other class), scored by minus their loss.

With a correlated mechanism (``mechanism=``: BandMF, BLT) the records are drawn by its
cyclic sampling and the accountant's epsilon is the mechanism's; the white-box score
stays the sum of the releases, which correlated noise makes less noisy than DP-SGD's
(the prefix sums are what the strategy is optimised for): a valid score for any
mechanism, and the one a recursion that cancels its own noise in those sums cannot hide
from (``BROKEN["correlation"]``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import Tensor, nn

from ..loss import stock_per_sample
from .accounting import PrivacyAccountant
from .mechanisms import CorrelatedNoise, Mechanism, accounted_runs, resolve_mechanism
from .sampling import CyclicPoissonSampler, PoissonBatchSampler
from .step import PrivateStep

GUESSES = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""The numbers of guesses tried (each once as the top scores only, once split between
the top and the bottom), the confidence shared among them (Bonferroni)."""


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability that an (epsilon, delta)-DP training lets an auditor get at least
    ``correct`` of ``guesses`` guesses right about ``canaries`` canaries, each added
    with probability 1/2 (Steinke et al. 2023, Theorem 5.2 and its computation in their
    appendix: a binomial tail at ``e^eps / (1 + e^eps)``, plus ``delta``'s share).

    Args:
        canaries: ``m``, the canaries drawn.
        guesses: ``r <= m``, the guesses made (the rest abstained).
        correct: ``v <= r``, the right ones.
        epsilon: ``>= 0``; delta: in ``[0, 1]``.

    Returns:
        The p-value, in ``[0, 1]``.

    Examples:
        >>> p_value(1000, 100, 100, 0.0, 0.0) == 0.5 ** 100  # 100 coin flips all right
        True
        >>> p_value(1000, 100, 50, 1.0, 1e-5) > 0.5
        True
    """
    if correct <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = stats.binom.sf(correct - 1, guesses, q)  # P[Binomial(r, q) >= v]
    below = stats.binom.pmf(correct - 1 - np.arange(correct), guesses, q)  # v-1, ..., 0
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return float(min(1.0, tail + alpha * delta * 2 * canaries))


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float,
                        confidence: float = 0.95) -> float:
    """The largest epsilon that ``correct`` right guesses of ``guesses`` rule out at
    ``confidence``: the training is not (epsilon, delta)-DP for any smaller epsilon,
    with probability ``confidence`` (Steinke et al. 2023; bisection on
    :func:`p_value`).

    Args:
        canaries, guesses, correct, delta: as for :func:`p_value`.
        confidence: in ``(0, 1)``, e.g. 0.95.

    Returns:
        epsilon ``>= 0`` (0: nothing ruled out).

    Raises:
        ValueError: counts out of order (``0 <= correct <= guesses <= canaries``) or a
            confidence outside ``(0, 1)``.

    Examples:
        >>> round(epsilon_lower_bound(1000, 100, 100, 0.0), 2)  # every guess right
        3.49
        >>> epsilon_lower_bound(1000, 100, 55, 1e-5)  # about chance: nothing ruled out
        0.0
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries "
                         f"({canaries})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    level = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if p_value(canaries, guesses, correct, mid, delta) < level \
            else (low, mid)
    return low


@dataclass(frozen=True)
class Bound:
    """The best guesses of one score: ``epsilon`` ruled out, from ``correct`` of
    ``guesses`` (``top`` guessed added, ``bottom`` guessed not)."""

    epsilon: float
    guesses: int
    correct: int
    top: int
    bottom: int


def best_bound(scores: Tensor, added: Tensor, delta: float, confidence: float = 0.95,
               counts: tuple[int, ...] = GUESSES) -> Bound:
    """The highest :func:`epsilon_lower_bound` over the guess counts ``counts`` (each as
    the top scores only, and split between the top and the bottom), the confidence
    shared among the tries (Bonferroni), so that the best one still holds.

    Args:
        scores: ``(m,)`` a score per canary, high for "added".
        added: ``(m,)`` bool, which canaries were added.
        delta, confidence: as for :func:`epsilon_lower_bound`.
        counts: the numbers of guesses to try (those above ``m`` are skipped).

    Returns:
        The :class:`Bound`.

    Examples:
        >>> added = torch.arange(1000) % 2 == 0
        >>> best_bound(added.double(), added, 1e-5).epsilon > 3  # perfect scores
        True
        >>> best_bound(torch.randn(1000), added, 1e-5).epsilon
        0.0
    """
    m = len(scores)
    order = torch.argsort(scores, descending=True)
    ranked = added[order]  # True where the canary at that rank was added
    tries = [(k, 0) for k in counts if k <= m] + [(k - k // 2, k // 2) for k in counts
                                                 if k <= m]
    shared = 1.0 - (1.0 - confidence) / max(1, len(tries))
    best = Bound(0.0, 0, 0, 0, 0)
    for top, bottom in tries:
        correct = int(ranked[:top].sum()) + int((~ranked[m - bottom:]).sum() if bottom else 0)
        eps = epsilon_lower_bound(m, top + bottom, correct, delta, shared)
        if eps > best.epsilon:
            best = Bound(eps, top + bottom, correct, top, bottom)
    return best


@dataclass
class Audit:
    """The result of :func:`audit`.

    Attributes:
        epsilon: the accountant's epsilon of the run, at ``delta``.
        gradient: the white-box :class:`Bound` (the gradient canaries, every release).
        input: the black-box :class:`Bound` (the input canaries, the final model).
        delta, confidence: of the bounds.
        canaries: ``m`` of each kind; added: ``{"gradient": count, "input": count}``.
        noise_multiplier, sample_rate, steps: the run.
        scores: ``{"gradient": (m,), "input": (m,)}``; added_mask: ``{kind: (m,) bool}``.
        mechanism: the correlated mechanism audited (``None``: DP-SGD).
    """

    epsilon: float
    gradient: Bound
    input: Bound
    delta: float
    confidence: float
    canaries: int
    added: dict[str, int]
    noise_multiplier: float
    sample_rate: float
    steps: int
    scores: dict[str, Tensor] = field(repr=False)
    added_mask: dict[str, Tensor] = field(repr=False)
    mechanism: Mechanism | None = None

    @property
    def leaks(self) -> bool:
        """Whether a bound is above the accountant's epsilon: the step leaks more than it
        claims (with the bounds' confidence)."""
        return max(self.gradient.epsilon, self.input.epsilon) > self.epsilon


def audit(model: nn.Module, data: tuple[Tensor, Tensor], loss_fn: Callable[[Any, Any], Tensor],
          *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: int,
          steps: int, canaries: int = 1000, lr: float = 0.1, delta: float = 1e-5,
          confidence: float = 0.95, accountant: str = "rdp",
          physical_batch_size: int | None = None, generator: torch.Generator | None = None,
          step_type: Callable[..., Any] = PrivateStep,
          mechanism: Mechanism | str | None = None, bands: int | None = None,
          buffers: int | None = None, **step_options: Any) -> Audit:
    """Audit persample's DP step in one training run (Steinke et al. 2023): train a copy
    of ``model`` with DP-SGD on ``data`` plus ``canaries`` gradient canaries and as many
    input canaries, each added with probability 1/2, and bound epsilon from below by
    guessing which were added, from every release (white box) and from the final model
    (black box).

    Poisson sampling at ``q = expected_batch_size / (records)`` for ``steps`` steps,
    :class:`PrivateStep` (or ``step_type``) with ``noise_multiplier``,
    ``max_grad_norm`` and ``step_options``, SGD at ``lr``; the accountant's epsilon is
    that of ``(noise_multiplier, q, steps)`` at ``delta``. ``model`` is left as it is.

    Args:
        model: a classifier ``(N, ...) -> (N, classes)``.
        data: ``(x (N, ...), y (N,))``, integer class labels.
        loss_fn: a ``torch.nn`` loss (``reduction`` mean or sum) or a function returning
            per-sample losses ``(b,)``.
        noise_multiplier, max_grad_norm, expected_batch_size: the step's.
        steps: DP-SGD steps, ``>= 1``.
        canaries: ``m >= 10`` of each kind.
        lr: the SGD learning rate.
        delta: of the accountant's epsilon and of the bounds.
        confidence: of the bounds, in ``(0, 1)``.
        accountant: ``"rdp"``, ``"pld"`` or ``"prv"``.
        physical_batch_size: the most samples one forward takes (default all).
        generator: a CPU ``torch.Generator`` for the canaries, the sampling and the
            noise (seed it to repeat an audit).
        step_type: makes the step, called as :class:`PrivateStep` is (a test passes a
            broken one, :data:`BROKEN`, to see the audit catch it).
        mechanism, bands, buffers: correlated noise (as
            :func:`~persample.dp.make_private` takes it: ``"bandmf"`` with ``bands``,
            ``"blt"`` with ``buffers``, or one made for ``steps``): the records drawn by
            its cyclic sampling, the epsilon its accounting's.
        **step_options: more arguments of the step (``per_layer``, ``param_groups``
            with the canary table named ``"canaries"``...).

    Returns:
        The :class:`Audit`: ``epsilon`` (the accountant's) beside the ``gradient`` and
        ``input`` bounds; ``leaks`` when a bound is above it.

    Raises:
        ValueError: ``data`` not ``(x, y)`` with integer labels of at least two
            classes, fewer than 10 canaries, steps below 1, a ``loss_fn`` that gives
            no per-sample losses; the errors of the step.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.dp.auditing import BROKEN, audit
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(300, 5, generator=g), torch.randint(0, 3, (300,), generator=g)
        >>> options = dict(noise_multiplier=2.0, max_grad_norm=1.0, expected_batch_size=60,
        ...                steps=10, canaries=500)
        >>> audit(nn.Linear(5, 3), (x, y), nn.CrossEntropyLoss(), generator=g,
        ...       **options).leaks  # a correct step
        False
        >>> audit(nn.Linear(5, 3), (x, y), nn.CrossEntropyLoss(), generator=g,
        ...       step_type=BROKEN["noise"], **options).leaks  # no noise
        True

    Source: Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"
    (input and gradient canaries, the one-run bound).
    """
    x, y = _checked(data, canaries, steps)
    if step_type is _WrongCorrelation and mechanism is None:
        raise ValueError("BROKEN['correlation'] breaks a mechanism's noise: pass mechanism=")
    gen = generator if generator is not None else torch.Generator().manual_seed(
        int(torch.randint(2**62, (1,))))
    ix, iy = _mislabelled(x, y, canaries, gen)
    added = {"input": torch.rand(canaries, generator=gen) < 0.5,
             "gradient": torch.rand(canaries, generator=gen) < 0.5}  # (m,) each
    dirac = torch.nonzero(added["gradient"])[:, 0]
    records = _Records(torch.cat([x, ix[added["input"]], x[:1].expand(len(dirac), *x.shape[1:])]),
                       torch.cat([y, iy[added["input"]], y[:1].expand(len(dirac))]),
                       torch.cat([torch.full((len(y) + int(added["input"].sum()),), -1), dirac]))
    q = expected_batch_size / len(records.y)
    mech = resolve_mechanism(mechanism, steps, q, bands=bands, buffers=buffers)
    if mech is not None:
        step_options["mechanism"] = mech
    bound = max_grad_norm if isinstance(max_grad_norm, (int, float)) else 1.0
    audited = _Audited(copy.deepcopy(model), canaries, scale=GRADIENT_SCALE * bound)
    step = step_type(audited, _AuditLoss(loss_fn), max_grad_norm=max_grad_norm,
                     noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                     generator=torch.Generator().manual_seed(int(torch.randint(
                         2**62, (1,), generator=gen))), **step_options)
    optimizer = torch.optim.SGD(audited.model.parameters(), lr=lr)
    white = torch.zeros(canaries, dtype=torch.float64)
    size = physical_batch_size or len(records.y)
    draws = PoissonBatchSampler(len(records.y), q, steps, gen) if mech is None else \
        CyclicPoissonSampler(len(records.y), q, mech.cycle_length, steps, gen)
    for picked in draws:
        for part in torch.tensor(picked, dtype=torch.int64).split(size):
            step.accumulate(*records.batch(part))
        step.release()
        white += audited.table.grad.detach()[:, 0].double() * expected_batch_size
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        audited.table.grad = None
    black = -_losses(audited.model, ix, iy, loss_fn, size)
    spent = PrivacyAccountant(accountant)
    for sigma, rate, count in accounted_runs(mech, noise_multiplier, q, steps):
        spent.step(sigma, rate, count)
    return Audit(
        epsilon=spent.epsilon(delta),
        gradient=best_bound(white, added["gradient"], delta, confidence),
        input=best_bound(black, added["input"], delta, confidence), delta=delta,
        confidence=confidence, canaries=canaries,
        added={kind: int(mask.sum()) for kind, mask in added.items()},
        noise_multiplier=noise_multiplier, sample_rate=q, steps=steps,
        scores={"gradient": white, "input": black}, added_mask=added, mechanism=mech)


GRADIENT_SCALE = 100.0
"""A gradient canary's gradient norm, in clipping norms: a step that clips scales it to
``C``, one that does not lets all of it through."""


@dataclass
class _Records:
    """The audit's training records: inputs, labels, and which gradient canary each is
    (``-1``: a data record or an input canary)."""

    x: Tensor
    y: Tensor
    which: Tensor

    def batch(self, index: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``(inputs, targets)`` of the records ``index`` for :class:`_Audited` and
        :class:`_AuditLoss`."""
        return (self.x[index], self.which[index]), (self.y[index], self.which[index])


class _Audited(nn.Module):
    """The model, and beside it a table of one weight per gradient canary: canary ``k``'s
    loss is ``scale * table[k]``, so its gradient is ``scale e_k`` on the table alone."""

    def __init__(self, model: nn.Module, canaries: int, scale: float):
        super().__init__()
        self.model, self.scale = model, scale
        dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
        self.table = nn.Parameter(torch.zeros(canaries, 1, dtype=dtype))

    def forward(self, x: Tensor, which: Tensor) -> tuple[Tensor, Tensor]:
        picked = nn.functional.embedding(which.clamp(min=0), self.table)[:, 0]  # (b,)
        return self.model(x), self.scale * picked


class _AuditLoss:
    """The model's per-sample loss for the records, the table's for the gradient canaries
    (each record's own term alone)."""

    def __init__(self, loss_fn: Callable[[Any, Any], Tensor]):
        self.loss_fn = loss_fn

    def __call__(self, outputs: tuple[Tensor, Tensor], targets: tuple[Tensor, Tensor]
                 ) -> Tensor:
        (logits, canary), (y, which) = outputs, targets
        return torch.where(which < 0, _per_sample(self.loss_fn, logits, y), canary)  # (b,)


def _per_sample(loss_fn: Callable, output: Tensor, y: Tensor) -> Tensor:
    """``(b,)`` each record's loss: a ``torch.nn`` loss per sample, or ``loss_fn``'s own."""
    stock = stock_per_sample(loss_fn, output, y, len(y))
    if stock is not None:
        return stock
    losses = loss_fn(output, y)
    if losses.shape != (len(y),):
        raise ValueError(f"the audit needs per-sample losses: loss_fn returned shape "
                         f"{tuple(losses.shape)} for {len(y)} records; pass a torch.nn loss "
                         "or one that returns (b,)")
    return losses


def _checked(data: Any, canaries: int, steps: int) -> tuple[Tensor, Tensor]:
    ok = (isinstance(data, (tuple, list)) and len(data) == 2
          and all(isinstance(t, Tensor) for t in data) and data[1].dim() == 1
          and len(data[0]) == len(data[1]) and not data[1].is_floating_point())
    if not ok:
        raise ValueError("data must be (x (N, ...), y (N,)) with integer class labels")
    if len(data[1].unique()) < 2:
        raise ValueError("the labels must have at least two classes: a canary is an input "
                         "with another label than its own")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 10:
        raise ValueError(f"canaries must be an int >= 10, got {canaries!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return data[0], data[1]


def _mislabelled(x: Tensor, y: Tensor, m: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``m`` mislabelled copies of random training inputs: each with a random class other
    than its own."""
    classes = int(y.max()) + 1
    pick = torch.randint(len(y), (m,), generator=gen)
    shift = torch.randint(1, classes, (m,), generator=gen)
    return x[pick].clone(), (y[pick] + shift) % classes


def _losses(model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable, size: int) -> Tensor:
    """``(m,)`` each input canary's own loss (float64), in batches of ``size``."""
    with torch.no_grad():
        return torch.cat([_per_sample(loss_fn, model(x[k:k + size]), y[k:k + size]).double()
                          for k in range(0, len(y), size)])


class _WithoutNoise(PrivateStep):
    """A deliberately broken step: it claims ``noise_multiplier`` but adds no noise."""

    def _terms(self) -> Any:
        return dataclasses.replace(super()._terms(), std=0.0)


class _WithoutClipping(PrivateStep):
    """A deliberately broken step: it noises for the clipping norm but sums the
    gradients unclipped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.claimed = self.bounds.sensitivity
        self.bounds = dataclasses.replace(self.bounds, bounds=tuple(
            math.inf for _ in self.bounds.bounds))

    def _terms(self) -> Any:
        terms = super()._terms()
        return dataclasses.replace(terms, std=self.noise_multiplier * self.claimed)


class _Differences:
    """A wrong noise recursion: release ``t``'s noise ``Z_t - Z_{t-1}``, the inverse of
    the prefix sums rather than of the mechanism's strategy (the mechanism's other
    attributes as they are)."""

    def __init__(self, mechanism: Mechanism) -> None:
        self.mechanism, self.steps, self.rows = mechanism, mechanism.steps, 2

    def slot_row(self, t: int) -> int:
        return t % 2

    def settle(self, ring: Tensor, t: int) -> Tensor:
        return ring[t % 2] - ring[(t - 1) % 2] if t else ring[0].clone()

    def noise_scale(self, t: int) -> float:
        return self.mechanism.noise_scale(t)

    def __repr__(self) -> str:
        return repr(self.mechanism)


class _WrongCorrelation(PrivateStep):
    """A deliberately broken step: its noise recursion is not its mechanism's (each
    release's noise cancels the last one's draw, so the sums of the releases carry one
    draw), while the accountant counts the mechanism."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise = CorrelatedNoise(_Differences(self.mechanism))


BROKEN = {"noise": _WithoutNoise, "clipping": _WithoutClipping,
          "correlation": _WrongCorrelation}
"""Steps broken on purpose (no noise; no clipping; with a mechanism, a noise recursion
that is not its strategy's), for ``audit(step_type=...)``: an audit must flag them
(``persample audit --broken``)."""
