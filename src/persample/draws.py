"""The random numbers a forward drew, recorded once and reused by every later evaluation.

A per-sample gradient is the gradient of sample ``i``'s loss in the forward that
actually ran, with the random numbers that forward drew (dropout masks, stochastic
depth, Gumbel noise): summed over the samples it is that forward's batch gradient.
Whatever persample evaluates again (an op's vector-Jacobian product, a module's
fallback, the loop or ``torch.func`` replaying sample ``i``) must draw the same numbers,
and sample ``i`` only its own part of them.

Each random op of a forward is recorded as a :class:`Draw` when it runs: the state of
the generator it draws from, just before it, and what is needed to read its numbers
back:

- the dropout family (``F.dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``,
  ``feature_alpha_dropout``, ``torch.native_dropout``): the output is ``x * scale +
  shift`` entry by entry, ``scale`` and ``shift`` read back (only when needed) by
  running the op again at the recorded state on ones and zeros of ``x``'s shape;
- random fills (``bernoulli_``, ``uniform_``, ``normal_``, ``exponential_``...) and
  factories (``rand``, ``randn``, ``randint``, ``bernoulli``, ``multinomial``,
  ``normal``...): the numbers, kept;
- ``F.scaled_dot_product_attention`` with ``dropout_p > 0``: on the CPU its mask is
  ``F.dropout`` of the attention weights, read back the same way; sample ``i`` is then
  replayed as the attention's equations with its part of that mask.

``F.gumbel_softmax`` runs as the ops it is made of (``persample.rules.random_ops``), as does
multi-head attention under the capture, so that their draws are the ops above.

Reuse: :func:`at` runs an op again on the whole batch at its recorded state (same
shapes, same numbers); :class:`Replay` answers each random op of a later forward with
a sample's part of the recorded draws, in order (the loop: sample ``i`` as a batch of
one; ``torch.func``: the sample index as a batched tensor); :class:`Recorder` records
the draws of a plain forward. Where a sample's part cannot be told (a draw whose
shape does not show where the batch is, a fused kernel's mask on a GPU), the replay
refuses: :class:`DrawNotReplayable`, naming the op.

Source: dropout (Srivastava et al. 2014) and stochastic depth (Huang et al. 2016) as
the forward that ran draws them: ``torch.func``'s ``randomness="different"`` draws new
numbers for each sample instead, a loop of forwards draws new numbers for each call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .batch.layouts import Batched, front
from .errors import DrawNotReplayable
from .rng import at_state, device_of, generator_of, restore, snapshot


class DrawsNeeded(Exception):
    """A sample's forward drew random numbers where nothing was recorded (record a batch
    forward's draws, then replay them)."""


# -- which ops draw ---------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


@dataclass(frozen=True)
class _Kind:
    """How an op draws: ``kind`` ("mask", "fill", "make", "attention", "whole"), and
    for the dropout family where ``p`` and the training flag are and whether the
    output has a shift (alpha dropout)."""

    kind: str
    p: tuple[int, str, Any] | None = None
    train: tuple[int, str, Any] | None = None
    shift: bool = False

    def draws(self, args: tuple, kwargs: dict) -> bool:
        """Does this call draw random numbers?"""
        if self.kind in ("fill", "make"):
            return True
        if self.kind == "attention":
            return float(_arg(args, kwargs, 4, "dropout_p", 0.0)) > 0
        p = float(_arg(args, kwargs, *self.p)) if self.p else 1.0
        train = _arg(args, kwargs, *self.train) if self.train else True
        return bool(train is None or train) and 0 < p < 1 if self.p else bool(train)


def _table() -> dict[Any, _Kind]:
    found: dict[Any, _Kind] = {}

    def add(kind: _Kind, *funcs: Any) -> None:
        for f in funcs:
            if f is not None:
                found[f] = kind

    T = torch.Tensor
    add(_Kind("mask", (1, "p", 0.5), (2, "training", True)),
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)
    add(_Kind("mask", (1, "p", 0.5), (2, "training", False), shift=True),
        F.alpha_dropout, F.feature_alpha_dropout)
    add(_Kind("mask", (1, "p", None), (2, "train", None)), torch.dropout,
        getattr(torch, "dropout_", None), torch.feature_dropout,
        getattr(torch, "feature_dropout_", None), torch.native_dropout)
    add(_Kind("mask", (1, "p", None), (2, "train", None), shift=True), torch.alpha_dropout,
        getattr(torch, "alpha_dropout_", None), torch.feature_alpha_dropout,
        getattr(torch, "feature_alpha_dropout_", None))
    add(_Kind("fill"), T.bernoulli_, T.normal_, T.uniform_, T.exponential_, T.random_,
        T.cauchy_, T.log_normal_, T.geometric_)
    add(_Kind("make"), torch.rand, torch.randn, torch.randint, torch.rand_like,
        torch.randn_like, torch.randint_like, torch.randperm, torch.bernoulli, T.bernoulli,
        torch.normal, torch.multinomial, T.multinomial, torch.poisson)
    add(_Kind("attention"), F.scaled_dot_product_attention)
    add(_Kind("whole", train=(3, "training", False)), F.rrelu, torch.rrelu,
        getattr(F, "rrelu_", None), getattr(torch, "rrelu_", None))
    add(_Kind("whole"), F.gumbel_softmax)
    add(_Kind("whole", (10, "dropout_p", 0.0), (13, "training", True)),
        F.multi_head_attention_forward)
    return found


RANDOM: dict[Any, _Kind] = _table()


def random_kind(func: Any, args: tuple, kwargs: dict) -> _Kind | None:
    """How ``func(*args, **kwargs)`` draws random numbers, or ``None`` if it does not.

    Examples:
        >>> import torch.nn.functional as F
        >>> random_kind(F.dropout, (torch.ones(2),), {"training": False}) is None
        True
        >>> random_kind(F.dropout, (torch.ones(2), 0.1), {}).kind
        'mask'
    """
    kind = RANDOM.get(func)
    return kind if kind is not None and kind.draws(args, kwargs) else None


# -- the record of one draw -------------------------------------------------------------

def at(draw: Draw | None) -> AbstractContextManager:
    """Inside: ``draw``'s generator at the state it had just before the op drew (the
    op run again on the same shapes draws the same numbers); restored on exit.
    ``None``: nothing."""
    if draw is None:
        return nullcontext()
    return at_state(draw.generator, draw.state)


class Draw:
    """One random op of a recorded forward (see the module docstring).

    Attributes:
        func: the op; ``kind``: its :class:`_Kind`; ``generator``, ``state``: where it
        drew from and that generator's state just before; ``shape``, ``dtype``,
        ``device``: of the numbers drawn (the dropout's input, the filled tensor, the
        attention weights); ``where``: the module under way (for messages);
        ``layout``: where the samples are in the numbers drawn (a
        :class:`~persample.batch.Batched`), or ``None`` (told by shapes).
    """

    def __init__(self, func: Any, kind: _Kind, args: tuple, kwargs: dict, where: str = ""):
        self.func, self.kind, self.where = func, kind, where
        self.generator = generator_of(args, kwargs)
        self.state = self.generator.get_state() if self.generator is not None else None
        self.layout: Batched | None = None
        self.value: Tensor | None = None
        self._noise: tuple[Tensor, Tensor | None] | None = None
        first = args[0] if args and isinstance(args[0], Tensor) else None
        self.shape = tuple(first.shape) if first is not None else ()
        self.stride = tuple(first.stride()) if first is not None else None
        self.dtype = first.dtype if first is not None else None
        self.device = first.device if first is not None else device_of(args, kwargs)
        # what a mask op is called with beside its input (p, training): scalars
        self.rest = args[1:] if kind.kind == "mask" else ()
        self.kwargs = {k: v for k, v in kwargs.items() if k != "inplace"} \
            if kind.kind == "mask" else {}
        self.p = float(_arg(args, kwargs, 4, "dropout_p", 0.0)) if kind.kind == "attention" \
            else None
        if kind.kind == "attention":
            self.shape, self.stride = _attention_shape(args[0], args[1]), None

    def describe(self) -> str:
        name = getattr(self.func, "__name__", str(self.func))
        return f"{name}" + (f" in module {self.where}" if self.where else "")

    def finish(self, out: Any) -> None:
        """Keep the numbers of a fill or a factory (``out``, the op's output)."""
        if self.kind.kind in ("fill", "make") and isinstance(out, Tensor):
            with torch._C.DisableTorchFunction(), torch.no_grad():
                self.value = out.detach().clone()
            self.shape, self.dtype, self.device = tuple(out.shape), out.dtype, out.device

    # -- reading the numbers back --

    def noise(self) -> tuple[Tensor, Tensor | None]:
        """A mask op's ``(scale, shift)`` (``shift`` ``None`` for plain dropout), or the
        attention's dropout ``scale`` of its weights; read back once, at the state."""
        if self._noise is None:
            self._noise = self._read_noise()
        return self._noise

    def _read_noise(self) -> tuple[Tensor, Tensor | None]:
        kind = self.kind.kind
        if kind == "attention":
            if self.device.type != "cpu" or torch.is_autocast_enabled():
                raise DrawNotReplayable(
                    f"{self.describe()}: the dropout mask of scaled_dot_product_attention "
                    f"on {self.device.type} (or under autocast) is drawn inside a fused "
                    "kernel and cannot be read back for one sample")
            return self._probe(lambda x: F.dropout(x, self.p), 1.0), None
        if kind != "mask":
            raise DrawNotReplayable(f"{self.describe()}: its random numbers cannot be cut "
                                    "by sample")
        out = lambda x: self.func(x, *self.rest, **self.kwargs)  # noqa: E731
        one = self._probe(out, 1.0)
        if not self.kind.shift:
            return one, None
        zero = self._probe(out, 0.0)
        return one - zero, zero

    def _probe(self, fn: Callable[[Tensor], Any], fill: float) -> Tensor:
        """``fn`` at the state on a tensor of ``fill`` laid out as the op's input was (a
        mask is drawn in memory order: other strides would draw another)."""
        stride = self.stride or torch.empty(self.shape, device="meta").stride()
        x = torch.empty_strided(self.shape, stride, dtype=self.dtype, device=self.device)
        x.fill_(fill)
        with torch._C.DisableTorchFunction(), torch.no_grad(), at(self):
            out = fn(x)
        return out[0] if isinstance(out, tuple) else out

    # -- replaying one sample --

    def replay(self, args: tuple, kwargs: dict, sample: int | Tensor, n: int) -> Any:
        """The op's output for a later forward of sample ``sample``, from its part of
        the numbers drawn."""
        kind = self.kind.kind
        if kind == "mask":
            x = args[0]
            scale, shift = self.noise()
            s = self._cut(scale, sample, n, x.shape)
            # (F.dropout passes ``inplace`` to the mode as a keyword)
            inplace = bool(kwargs.get("inplace")) or self.func in _IN_PLACE
            out = x.mul_(s) if inplace else x * s
            if shift is not None:
                b = self._cut(shift, sample, n, x.shape)
                out = out.add_(b) if inplace else out + b
            return (out, s != 0) if self.func is torch.native_dropout else out
        if kind == "fill":
            x = args[0]
            try:
                with torch.no_grad():
                    return x.copy_(self._cut(self.value, sample, n, x.shape))
            except RuntimeError as err:  # torch.func: one sample's numbers into a tensor
                raise DrawNotReplayable(  # made for every sample
                    f"{self.describe()}: under torch.func, a tensor made alike for every "
                    "sample cannot be filled with one sample's numbers; method='rules' or "
                    f"'loop' replays it ({err})") from err
        if kind == "make":
            shape = _made_shape(self, args, kwargs)
            got = self._cut(self.value, sample, n, shape)
            return got.clone() if got is self.value else got
        if kind == "attention":
            q, k = args[0], args[1]
            (scale, _) = self.noise()
            return _attention(*args, **kwargs,
                              noise=self._cut(scale, sample, n, _attention_shape(q, k)))
        raise DrawNotReplayable(
            f"{self.describe()} draws random numbers inside one op whose sample-by-sample "
            "part cannot be read back; per-sample gradients of the forward that ran need "
            "method='rules' for it (or the op without randomness: eval mode)")

    def _cut(self, value: Tensor, sample: int | Tensor, n: int, shape: Any) -> Tensor:
        """Sample ``sample``'s part of ``value`` (recorded for the batch), of shape
        ``shape``: by the draw's layout, else by where the shape shows the batch (the
        one dim of size ``n`` that the sample has as 1, or has not)."""
        shape = tuple(shape)
        if tuple(value.shape) == shape:  # its shape does not depend on the batch: the
            return value  # same numbers for every sample
        index = sample if isinstance(sample, Tensor) else torch.tensor(sample)
        index = index.reshape(1).to(value.device)
        if self.layout is not None:
            row = front(value, self.layout, n).index_select(0, index)  # (1, *per_sample)
            if row.numel() == math.prod(shape):
                return row.reshape(shape)
        elif value.dim() == len(shape):
            diff = [d for d in range(value.dim()) if value.shape[d] != shape[d]]
            if len(diff) == 1 and value.shape[diff[0]] == n and shape[diff[0]] == 1:
                return value.index_select(diff[0], index)
        elif value.dim() == len(shape) + 1:
            dims = [d for d in range(value.dim()) if value.shape[d] == n
                    and tuple(value.shape[:d] + value.shape[d + 1:]) == shape]
            if len(dims) == 1:
                return value.index_select(dims[0], index).squeeze(dims[0])
        raise DrawNotReplayable(
            f"{self.describe()}: the random numbers it drew for the batch "
            f"{tuple(value.shape)} cannot be cut to one sample's {shape} (the shape does "
            "not show where the samples are)")


_IN_PLACE = frozenset(f for f in (getattr(torch, "dropout_", None),
                                  getattr(torch, "feature_dropout_", None),
                                  getattr(torch, "alpha_dropout_", None),
                                  getattr(torch, "feature_alpha_dropout_", None)) if f)


def _made_shape(draw: Draw, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The shape a factory call makes (read from its arguments: a random op cannot run
    under ``torch.func``, not even on the meta device)."""
    func, first = draw.func, args[0] if args else None
    if isinstance(first, Tensor):
        if func in (torch.multinomial, torch.Tensor.multinomial):
            return (*first.shape[:-1], int(_arg(args, kwargs, 1, "num_samples", 1)))
        if func is torch.normal:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            return tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        return tuple(first.shape)  # rand_like, bernoulli(p), poisson
    if func is torch.randperm:
        return (int(first),)
    size = kwargs.get("size")
    if size is None:
        sizes = [a for a in args if isinstance(a, (tuple, list, torch.Size))]
        if sizes:
            size = sizes[-1]
        elif func in (torch.rand, torch.randn):
            size = args
    if size is None:
        raise DrawNotReplayable(f"{draw.describe()}: the shape of its numbers for one "
                                "sample is unknown")
    return tuple(int(d) for d in size)


# -- the equations of ops that draw inside ------------------------------------------------

def _attention_shape(q: Tensor, k: Tensor) -> tuple[int, ...]:
    """The shape of the attention weights of ``q (..., L, E)`` and ``k (..., S, E)``."""
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    return (*lead, q.shape[-2], k.shape[-2])


def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, *, noise: Tensor) -> Tensor:
    """``F.scaled_dot_product_attention`` as its equations, the dropout of the weights
    being ``* noise`` (the scale the op's ``F.dropout`` drew)."""
    if enable_gqa:
        raise DrawNotReplayable("scaled_dot_product_attention with enable_gqa=True and "
                                "dropout: its mask cannot be read back for one sample")
    length, keys = q.shape[-2], k.shape[-2]
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * factor  # (..., L, S)
    if is_causal:
        allowed = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return (scores.softmax(-1) * noise) @ v


# -- modes ----------------------------------------------------------------------------------

def _expanded(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A random op that draws inside (multi-head attention) run as its equations under
    ``mode`` (as under the capture), or ``NotImplemented``."""
    expansion = mode.expansions.get(func)
    if expansion is None:
        return NotImplemented
    with mode:
        return expansion(*args, **kwargs)


class _RandomOps(TorchFunctionMode):
    """A mode that hands each random op to :meth:`drawn` (after running an op that draws
    inside as its equations, where ``expansions`` has them); other ops run as they are."""

    expansions: dict[Any, Callable]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = random_kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        out = _expanded(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        return self.drawn(func, kind, args, kwargs)

    def drawn(self, func: Any, kind: _Kind, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


class Recorder(_RandomOps):
    """Inside: every random op's :class:`Draw` appended to ``draws``, in order.
    ``expansions`` (``{func: fn}``): random ops that draw inside run as their equations
    (as under the capture), so that the draws are the same ops a :class:`Replay` sees."""

    def __init__(self, expansions: dict[Any, Callable] | None = None):
        super().__init__()
        self.draws: list[Draw] = []
        self.expansions = expansions or {}
        self.stack: list[str] = []  # the modules under way, for messages (kept by the caller)

    def drawn(self, func: Any, kind: _Kind, args: tuple, kwargs: dict) -> Any:
        draw = Draw(func, kind, args, kwargs, self.stack[-1] if self.stack else "")
        out = func(*args, **kwargs)
        draw.finish(out)
        self.draws.append(draw)
        return out


class Replay(_RandomOps):
    """Inside (:meth:`of`): each random op answered by sample ``sample``'s part of the
    recorded ``draws``, in order (see the module docstring).

    Args:
        draws: the batch forward's draws (:class:`Recorder`, or a capture's).
        n: the batch size they were drawn for.
        expansions: as for :class:`Recorder`.

    Raises (inside): :class:`DrawNotReplayable` where a sample's part cannot be told,
    or its forward draws in another order than the batch's.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> x = torch.ones(3, 4)
        >>> with Recorder() as recorder:
        ...     y = F.dropout(x, 0.5)
        >>> with Replay(recorder.draws, 3).of(1):  # sample 1 alone
        ...     y1 = F.dropout(x[1:2], 0.5)
        >>> torch.equal(y1, y[1:2])
        True
    """

    def __init__(self, draws: list[Draw], n: int,
                 expansions: dict[Any, Callable] | None = None):
        super().__init__()
        self.draws, self.n, self.expansions = draws, n, expansions or {}
        self.sample: int | Tensor = 0
        self.k = 0
        for d in draws:  # (read back here: a random op cannot run under vmap)
            if d.kind.kind in ("mask", "attention"):
                try:
                    d.noise()
                except DrawNotReplayable:
                    pass  # raised where the sample needs it

    @contextmanager
    def of(self, sample: int | Tensor) -> Iterator[None]:
        """Inside: sample ``sample`` (an index, or a batched index under ``vmap``)."""
        self.sample, self.k = sample, 0
        with self:
            yield
        if self.k != len(self.draws):
            raise DrawNotReplayable(
                f"a sample alone drew {self.k} random ops where the batch drew "
                f"{len(self.draws)}: its forward takes another path, so its part of the "
                "batch's random numbers is unknown")

    def drawn(self, func: Any, kind: _Kind, args: tuple, kwargs: dict) -> Any:
        if self.k >= len(self.draws) or self.draws[self.k].func is not func:
            raise DrawNotReplayable(
                f"{getattr(func, '__name__', func)}: a sample alone draws random numbers "
                "in another order than the batch's forward, so its part of them is unknown")
        draw = self.draws[self.k]
        self.k += 1
        return draw.replay(args, kwargs, self.sample, self.n)


def replayed(run: Callable[[Callable[[Any], Any]], Any], record: Callable[[], list[Draw]],
             n: int, expansions: dict[Any, Callable] | None = None) -> Any:
    """``run(of)``, where ``of(sample)`` is the context a sample's forward runs in: first
    a plain one (no mode, so that the model takes its own paths) that stops a sample
    whose forward moved a generator, or ``torch.func``'s refusal of a random op; if the
    forward draws, ``record()`` (a batch forward's draws) and ``run`` again with them
    replayed (:class:`Replay`)."""
    states = snapshot()
    try:
        return run(_unmoved)
    except DrawsNeeded:
        pass
    except RuntimeError as err:  # torch.func: "called random operation while in
        if "random operation" not in str(err):  # randomness error mode"
            raise
    restore(states)
    return run(Replay(record(), n, expansions).of)


@contextmanager
def _unmoved(sample: Any) -> Iterator[None]:
    """Inside: a sample's forward; raise :class:`DrawsNeeded` if it drew from a default
    generator."""
    before = snapshot()
    yield
    if any(not torch.equal(g.get_state(), state) for g, state in before):
        raise DrawsNeeded("the forward draws random numbers")
