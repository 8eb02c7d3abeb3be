"""Certificates: every result checked by an identity that persample does not compute
itself.

The fast path is exact on every model the tests build; on a model nobody has tried, a
path nobody thought of may not be. A certificate catches that whatever its cause,
using only PyTorch's autograd on one batch forward with the random numbers the call
drew (torch's generators, numpy's and Python's global ones put back where the call
found them), never persample's data flow, rules or fallbacks:

- per-sample gradients ``g_i`` (and the per-sample gradients behind the norms and a
  DP step): for Gaussian weights ``u`` ``(B,)``, ``sum_i u_i g_i`` equals the gradient
  of ``sum_i u_i L_i`` (one backward of the batch). A wrong row changes the left side
  and not the right one, so it is caught with probability 1 in exact arithmetic,
  whatever went wrong. For the norms, ``sum_i u_i g_i`` comes from the factors the
  norms came from (each op's backprops scaled by ``u`` and pulled back through that op
  alone), and the norms of module norm rules are compared with their rows;
- a DP step's clipped sum ``sum_i c_i g_i`` equals the gradient of ``sum_i c_i L_i``
  with the step's clip factors ``c_i`` held constant. Both at once: the step's own
  machinery with the weights ``u + lam c`` against the gradient of ``sum_i (u_i + lam
  c_i) L_i`` (one backward per clipping group);
- the parameter Jacobian ``J_i`` ``(Y, P)``: for Gaussian output weights ``w``
  ``(B, Y)``, ``sum_i w_i^T J_i`` equals the gradient of ``<w, f(x)>`` (one backward);
- the input Jacobian: samples are independent, so for Gaussian ``w`` ``(B, Y)`` sample
  ``i``'s ``w_i^T J_i`` is row ``i`` of the gradient of ``<w, f(x)>`` w.r.t. the input;
- gradient inner products ``D`` ``(B, B')``: ``u^T D v`` is the inner product of the
  gradients of ``sum_i u_i L_i`` and ``sum_j v_j L'_j``; projections ``R`` ``(B, k)``:
  ``u^T R`` is the projection of the gradient of ``sum_i u_i L_i``.

Each parameter's two sides are compared (in float64 for float64, else float32) as
``||got - want|| <= tol * max(||got||, ||want||) + floor``, with ``tol`` by the
computation's precision (:data:`TOLERANCES`; under autocast, its dtype's) and
``floor = max(64 eps, tol / 1000)`` times the norm of the whole right side, plus
``64 eps``: a parameter whose true gradient is zero (a key bias before a softmax, the
weight of a normalisation summed out) holds rounding noise on both sides. Below float64
a model can be ill-conditioned enough that float32 autograd itself is off by more than
``tol`` (an attention whose keys are all alike: its softmax backward cancels). Where
every parameter beyond ``tol`` is off by less than :data:`GRAY` times it (per-sample
gradients and norms, a DP step, both Jacobians, projections; inner products are
compared against the size of their terms already), the identity's right side is
computed again in float64 (the parameters, buffers and floating inputs
cast, through ``torch.func.functional_call``: the model untouched), and such a
parameter passes if the result is within ``tol`` of that, or within
:data:`AS_AUTOGRAD` times float32 autograd's own distance to it: as exact as the
precision allows on this batch. A wrong row is off by far more than autograd's
rounding.

The policy, ``check=``, of every function that takes it: ``"first"`` (default)
certifies the first call of each new plan (a model, its mode, the inputs' shapes
beyond the batch size and their dtypes, the parameters and the method not seen
together before: a Poisson-sampled batch of another size is no new plan); ``"always"``
every call;
``"never"`` none; an ``int`` ``N`` the first call of each plan and every ``N``-th
after it. A certified call costs one more forward and backward of the batch (and for
the norms and a DP step one more weighted sum of their factors): about twice an
uncertified call that forms per-sample gradients, more for a call much cheaper than a
training step (the norms of an MLP); the other calls nothing.

Source: the identities are linearity of the gradient, ``sum_i u_i dL_i/dtheta =
d(sum_i u_i L_i)/dtheta``, the randomised check of a product by a random vector
(Freivalds 1977, "Probabilistic machines can use less running time").
"""

from __future__ import annotations

import math
import random
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from .batch import SHARED, Batched
from .checks import kept_buffers
from .errors import REFUSALS, InternalError, NeedsWholeModel
from .inputs import Batch, samples_of
from .loss import per_sample_losses
from .methods import AMBIGUOUS
from .patches import plain_checkpoints
from .precision import autocast_state
from .rng import (
    Draws,
    host_moved,
    host_states,
    restore,
    rewind_buffers,
    set_host_states,
    snapshot,
)
from .sharded import fsdp_units

CHECKS = ("first", "always", "never")

TOLERANCES = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 1e-1,
              torch.float16: 5e-2}
"""The relative tolerance of a certificate by the precision the model computes in
(under autocast, its dtype; float32 with TF32 matrix products allowed: 1e-2). float64
models often compute parts in float32 (transformers' rotary embeddings): 1e-5 leaves
them room, and a wrong row is off by far more."""
GRAY = 100
"""How far beyond ``tol`` (a factor) a parameter's error may be and still be judged
against a float64 reference (see the module docstring), up to a relative error of 0.1
(bfloat16's tolerance: a float64 copy of a model trained in it is not made)."""
AS_AUTOGRAD = 8
"""How many times float32 autograd's own error against the float64 reference the
result's may be (an association of sums other than autograd's rounds otherwise)."""


@dataclass
class Certificate:
    """The outcome of one certificate.

    Attributes:
        what: the quantity checked (``"per-sample gradients"``, ``"clipped sum"``, ...).
        method: the method whose result was checked (``"rules"``, ``"vmap"``, ``"loop"``).
        identity: the identity checked, in words.
        ok: whether every parameter's two sides agree within ``tol``.
        errors: ``{parameter name: relative error}`` (``||got - want||`` over
            ``max(||got||, ||want||)``, float).
        tol: the relative tolerance applied.
        reason: why not ok: the parameters whose rows disagree and the likely causes;
            ``""`` when ok; why not decided.
        decided: ``False`` where the identity cannot be formed without persample's own
            reading of the output (its samples not in dim 0 under a scalar loss, or
            possibly in another dim of the batch's size); ``ok`` is then ``True``.
        rounded: ``{parameter name: relative error of float32 autograd against float64}``
            for the parameters beyond ``tol`` that passed because the float64 reference
            showed the precision itself off by as much (see the module docstring).
    """

    what: str
    method: str
    identity: str
    ok: bool = True
    errors: dict[str, float] = field(default_factory=dict)
    tol: float = 0.0
    reason: str = ""
    decided: bool = True
    rounded: dict[str, float] = field(default_factory=dict)

    def undecided(self, why: str) -> Certificate:
        """This certificate, not decided: the identity cannot be formed (``why``)."""
        self.decided, self.reason = False, why
        return self

    def describe(self) -> str:
        """One line: what was checked, by which identity, and the verdict."""
        if not self.decided:
            return f"not certified: {self.what} of method {self.method!r}: {self.reason}"
        worst = max(self.errors.values(), default=0.0)
        verdict = "certified" if self.ok else "MISMATCH"
        line = (f"{verdict}: {self.what} of method {self.method!r} ({self.identity}), "
                f"largest relative error {worst:.2g} (tol {self.tol:g})")
        if self.rounded:
            line += "; " + ", ".join(self.rounded) + " within the precision's own rounding " \
                f"(autograd off by up to {max(self.rounded.values()):.2g} against float64)"
        return line if self.ok else f"{line}: {self.reason}"


# -- the policy --------------------------------------------------------------------

_POLICY: ContextVar = ContextVar("persample_check", default="first")


@contextmanager
def checking(check: str | int) -> Iterator[None]:
    """Inside, every call that does not pass ``check=`` itself (``check=None``, the
    default of every function that takes it) certifies under the policy ``check``;
    outside any, the policy is ``"first"``.

    Args:
        check: ``"first"`` (the first call of each plan), ``"always"``, ``"never"``, or
            a positive ``int`` ``N`` (the first call of each plan and every ``N``-th).

    Raises:
        ValueError: ``check`` is none of these.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> model = nn.Linear(3, 2)
        >>> x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
        >>> with persample.checking("always"):  # a test suite: certify every call
        ...     grads = persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss())
        >>> grads["weight"].shape
        torch.Size([4, 2, 3])
    """
    check_option(check)
    token = _POLICY.set(check)
    try:
        yield
    finally:
        _POLICY.reset(token)


def policy(check: str | int | None) -> str | int:
    """The policy a call runs under: its own ``check``, or ``None``: the enclosing
    :func:`checking`'s (``"first"`` outside one)."""
    return _POLICY.get() if check is None else check


def check_option(check: Any) -> None:
    """Raise ``ValueError`` unless ``check`` is ``"first"``, ``"always"``, ``"never"``, a
    positive ``int``, or ``None`` (the policy of the enclosing :func:`checking`).

    Examples:
        >>> check_option("first")
        >>> check_option(0)
        Traceback (most recent call last):
        ...
        ValueError: check=0 is not one of ('first', 'always', 'never') or a positive int ...
    """
    if check is None or (check in CHECKS and isinstance(check, str)):
        return
    if isinstance(check, int) and not isinstance(check, bool) and check >= 1:
        return
    raise ValueError(f"check={check!r} is not one of {CHECKS} or a positive int (certify "
                     "the first call of each plan and every N-th after it)")


_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: calls}
_REJECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {keys}


def signature(what: str, model: nn.Module, batch: Batch, targets: Any,
              params: Iterable[Tensor], extra: Any = ()) -> tuple:
    """The plan a call belongs to, for the policy: the quantity, the model's mode, the
    inputs' and targets' shapes beyond the batch size (a Poisson-sampled batch of
    another size is the same plan), dtypes and devices, the parameters, autocast, and
    ``extra``."""
    n = batch.n
    leaves = [*batch.leaves(), *tree_leaves(targets)]
    shapes = tuple((tuple(t.shape[1:]) if t.dim() and t.shape[0] == n else tuple(t.shape),
                    t.dtype, t.device.type) if isinstance(t, Tensor) else type(t).__name__
                   for t in leaves)
    return (what, model.training, shapes, tuple(id(p) for p in params), autocast_state(),
            extra)


def due(check: Any, model: nn.Module, key: tuple) -> bool:
    """Should this call (of the plan ``key``) be certified under ``check``?"""
    if check == "never":
        return False
    if check == "always":
        return True
    calls = _CALLS.setdefault(model, {}).get(key, 0)
    if calls == 0:
        return True
    return isinstance(check, int) and calls % check == 0


def called(model: nn.Module, key: tuple) -> None:
    """Count one answered call of the plan ``key`` (after its certificate, if any, passed)."""
    table = _CALLS.setdefault(model, {})
    table[key] = table.get(key, 0) + 1


def forget(model: nn.Module | None = None) -> None:
    """Forget which plans were certified (of ``model``, or of every model): their next
    calls are certified again under ``check="first"``."""
    if model is None:
        _CALLS.clear()
        _REJECTED.clear()
    else:
        _CALLS.pop(model, None)
        _REJECTED.pop(model, None)


@dataclass
class Checker:
    """The policy of one call: ``checker(how, run)`` runs the certificate ``run()`` of the
    result method ``how`` gave where ``check`` says it is due for the plan ``key`` (plus
    ``how``), and counts the call once its result stands."""

    check: Any
    model: nn.Module
    key: tuple

    def __post_init__(self) -> None:
        self.check = policy(self.check)

    def __call__(self, how: str, run: Callable[[], Certificate | None]
                 ) -> Certificate | None:
        key = (*self.key, how)
        cert = None
        if due(self.check, self.model, key) and uncertifiable(self.model) is None:
            cert = run()
        if cert is None or cert.ok:
            called(self.model, key)
        else:
            _REJECTED.setdefault(self.model, set()).add(key)
        return cert

    def rejected(self, how: str) -> bool:
        """Did a certificate reject method ``how``'s result for this plan in an earlier
        call (``auto`` then starts at the next method)?"""
        if self.check == "never":
            return False
        return (*self.key, how) in _REJECTED.get(self.model, ())


# -- the reference ------------------------------------------------------------------

def _plain_model(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def uncertifiable(model: nn.Module) -> str | None:
    """Why ``model``'s results cannot be certified here, or ``None``: an FSDP2-sharded
    model (its forward is a collective every rank would have to run alike); an embedding
    with ``scale_grad_by_freq`` (its backward scales by the counts of the whole batch, so
    the batch's autograd gradient is not the sum of the samples' own)."""
    plain = _plain_model(model)
    if not isinstance(plain, nn.Module):
        return None
    if fsdp_units(plain):
        return "an FSDP2-sharded model (its forward is a collective) is not certified"
    for name, m in plain.named_modules():
        if getattr(m, "scale_grad_by_freq", False):
            return (f"module '{name}' scales its gradient by the counts of the whole batch "
                    "(scale_grad_by_freq): the batch's gradient is not the samples' sum")
    return None


class _NoIdentity(Exception):
    """The batch's output cannot give each sample's loss without persample's data flow
    (it has no row per sample in dim 0, and the loss is a scalar). ``shapes``: the
    output's tensors' shapes, where the samples may be in another dim of the batch's
    size (:data:`~persample.methods.AMBIGUOUS`), or where a tensor may hold no sample
    at all though its dim 0 has the batch's size (``shared``: an output made from
    parameters alone, ``(C,)`` at ``B = C``)."""

    def __init__(self, why: str, shapes: list[torch.Size] | None = None,
                 shared: bool = False):
        super().__init__(why)
        self.shapes, self.shared = shapes, shared


def _reference(model: Any, batch: Batch | Callable[[], Any], draws: Draws,
               run: Callable[[Any], list[tuple[Tensor, Any]]], inputs: list[Tensor]
               ) -> tuple[list[tuple[Tensor, ...]], list[str], torch.dtype | None]:
    """One batch forward from ``draws`` (buffers kept; ``batch`` a :class:`Batch` of the
    model's inputs, or the forward itself), ``run(output)`` giving the ``(scalar,
    grad_outputs)`` pairs to differentiate, each differentiated w.r.t. ``inputs``; the
    generators are left where they were. Returns the gradients, the host generators
    the forward moved, and the lowest floating dtype of the forward's output (a forward
    under its own autocast computes below its parameters' precision)."""
    after, host_after = snapshot(), host_states()
    restore(draws.torch_states)
    set_host_states(draws.host)
    rewind_buffers(model)  # (and the buffers where the method's forward found them)
    try:
        with torch.enable_grad(), kept_buffers(model), plain_checkpoints(), \
                _autocast_seen(model) as seen:
            output = batch() if callable(batch) else batch.call(_plain_model(model))
            moved = host_moved(draws.host)
            low = min([*seen, *(t.dtype for t in tree_leaves(output) if isinstance(t, Tensor)
                                and t.is_floating_point())],
                      key=lambda d: torch.finfo(d).bits, default=None)
            roots = run(output)
            grads = []
            for k, (root, cot) in enumerate(roots):
                grads.append(torch.autograd.grad(root, inputs, cot, allow_unused=True,
                                                 retain_graph=k < len(roots) - 1))
    finally:
        restore(after)
        set_host_states(host_after)
    return grads, moved, low


@contextmanager
def _autocast_seen(model: Any) -> Iterator[set]:
    """Inside: a set that collects the dtype of any autocast enabled when a module is
    called (a forward that enters autocast itself, as accelerate's wrapped ``forward``
    does, computes below its parameters' precision). Not for a model holding a module
    compiled by ``torch.compile``, which a global module hook would disturb."""
    seen: set = set()
    dynamo = sys.modules.get("torch._dynamo")
    compiled = dynamo is not None and isinstance(model, nn.Module) and any(
        isinstance(m, dynamo.eval_frame.OptimizedModule) or getattr(
            m, "_compiled_call_impl", None) is not None for m in model.modules())
    if compiled:
        yield seen
        return

    def hook(module: nn.Module, args: Any) -> None:
        for _, enabled, dtype in autocast_state():
            if enabled:
                seen.add(dtype)

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _losses(output: Any, targets: Any, loss_fn: Callable, n: int,
            expected: Tensor | None = None, whole: frozenset | None = None) -> Tensor:
    """``(n,)`` each sample's loss from the batch's output, its rows in dim 0 (but the
    output tensors at the positions ``whole`` of its leaves, passed whole: they hold no
    sample, as a sample's forward alone showed; ``None``: not known yet).

    ``expected``: the method's own per-sample losses ``(n,)``. Where they differ and an
    output tensor has another dim of size ``n`` (its samples could be there: a
    sequence-first output with as many positions as samples), the identity cannot tell
    where the samples are without persample's data flow: not certified; so too where
    ``loss_fn`` fails on the rows of dim 0 of such an output (the samples' dim is
    another: a sequence-first output at ``B = T``). Elsewhere a difference is the
    forward's (it does not reproduce), and shows in the identity. Where there are several
    output tensors and ``whole`` is not known, one may hold no sample though its dim 0
    has the batch's size (a ``(C,)`` variance made from parameters, at ``B = C``): not
    formed either (``_NoIdentity.shared``), which a sample's forward alone resolves
    (:func:`_in_dim_0`)."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
    if n > 1 and any(t.dim() == 0 or t.shape[0] != n for t in leaves):
        loss = loss_fn(output, targets)
        if isinstance(loss, Tensor) and loss.shape == (n,):
            return loss
        raise _NoIdentity("the model's output has no row per sample in dim 0")
    elsewhere = n > 1 and any(n in t.shape[1:] for t in leaves)
    held = {id(t) for k, t in enumerate(leaves) if k in (whole or ())}
    try:
        loss = per_sample_losses(output, targets, loss_fn, n, layout_of=(
            lambda t: SHARED if id(t) in held else Batched(0)) if held else None)
    except NeedsWholeModel as err:  # an output no pytree opens (a distribution), a scalar
        raise _NoIdentity(str(err)) from err  # loss: no sample's part of it to give
    except Exception as err:
        if not elsewhere or isinstance(err, REFUSALS + (InternalError,)):
            raise
        raise _NoIdentity(AMBIGUOUS, [t.shape for t in leaves]) from err
    if (expected is not None and elsewhere
            and not _same_losses(loss.detach(), expected.to(loss.device))):
        raise _NoIdentity(AMBIGUOUS, [t.shape for t in leaves])
    if whole is None and n > 1 and len(leaves) > 1:
        raise _NoIdentity(SHARED_DOUBT, [t.shape for t in leaves], shared=True)
    return loss


SHARED_DOUBT = "an output tensor may hold no sample though its dim 0 has the batch's size"


def _same_losses(a: Tensor, b: Tensor) -> bool:
    """The same per-sample losses but for rounding: the same ops on the same output, cut
    by the same dim. (Losses of other cuts of the output can be close by chance: an L1
    loss's mean over 100 entries of one sample and of another agreed to 1e-3, at one seed
    in a hundred, and the identity then compared gradients of different losses.)"""
    tol = 1e3 * torch.finfo(torch.promote_types(a.dtype, b.dtype)).eps
    a, b = a.double(), b.double()
    finite = b.isfinite()  # (a sample's NaN loss is the same NaN on both sides)
    scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    return torch.allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=True)


def _precision(dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """The tolerance and machine epsilon of the precision the model computes in."""
    low = next((low for _, enabled, low in autocast_state() if enabled), dtype)
    eps = torch.finfo(low).eps if low.is_floating_point else torch.finfo(dtype).eps
    if low == torch.float32 and device.type == "cuda" and (
            torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        return 1e-2, eps
    return TOLERANCES.get(low, 1e-2), eps


def _dense(t: Tensor) -> Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def _working(a: Tensor, b: Tensor) -> torch.dtype:
    """The dtype two sides are compared in: the wider of theirs, at least float32 (a
    norm accumulated there is exact to about 1e-6, far below any tolerance but
    float64's, which is kept)."""
    return torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)


def _lowered(tol: float, eps: float, low: torch.dtype | None) -> tuple[float, float]:
    """The tolerance and epsilon, loosened to ``low``'s where the forward's output came in
    a lower precision than the call's parameters (autocast inside ``forward``)."""
    if low is None or low not in TOLERANCES:
        return tol, eps
    return max(tol, TOLERANCES[low]), max(eps, torch.finfo(low).eps)


def _compared(got: Mapping[str, Tensor], want: Mapping[str, Tensor], tol: float, eps: float
              ) -> tuple[dict[str, float], list[str], float]:
    """Per parameter the relative error of ``got`` against ``want``, the names beyond
    ``tol`` and the absolute floor (see the module docstring)."""
    stats = {}  # name -> (||want||, ||got||, ||got - want||), one host copy per device
    for name, w in want.items():
        g = _dense(got[name].to(w.device))
        w = _dense(w)  # a sparse embedding's gradient
        dtype = _working(g, w)
        stats[name] = torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in
                                   (w, g, g.to(dtype) - w.to(dtype))]).double()
    by_device: dict[torch.device, list[str]] = {}
    for name, t in stats.items():
        by_device.setdefault(t.device, []).append(name)
    sizes = {}
    for names in by_device.values():
        sizes.update(zip(names, torch.stack([stats[k] for k in names]).tolist()))
    floor = max(64 * eps, 1e-3 * tol) * sum(w * w for w, _, _ in sizes.values()) ** 0.5 \
        + 64 * eps
    errors, bad = {}, []
    for name, (w, g, err) in sizes.items():
        scale = max(g, w)
        errors[name] = err / max(scale, floor / tol, 1e-300)
        if err > tol * scale + floor:
            bad.append(name)
    return errors, bad, floor


def _gaussian(n: int, *rest: int) -> Tensor:
    """Gaussian weights ``(n, *rest)`` in float64 from a generator of the certificate's own
    (the user's generators do not move)."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**62))
    return torch.randn((n, *rest), generator=gen, dtype=torch.float64)


def _verdict(cert: Certificate, got: Mapping[str, Tensor], want: Mapping[str, Tensor],
             moved: list[str], eps: float,
             exact: Callable[[], Mapping[str, Tensor] | None] | None = None) -> Certificate:
    """``cert`` with the errors of ``got`` against ``want``, failed where a parameter is
    beyond ``tol``. ``exact()``: the right side in float64 (``None`` where it cannot be
    computed), asked for only where every such parameter is within :data:`GRAY` times
    ``tol`` (see the module docstring)."""
    cert.errors, bad, floor = _compared(got, want, cert.tol, eps)
    if bad and exact is not None and cert.tol > TOLERANCES[torch.float64] and all(
            cert.errors[name] <= min(GRAY * cert.tol, 0.1) for name in bad):
        bad = _beyond_rounding(cert, bad, got, want, exact(), floor)
    if bad:
        cert.ok = False
        cert.reason = _why(bad, cert, moved)
    return cert


def _beyond_rounding(cert: Certificate, bad: list[str], got: Mapping[str, Tensor],
                     want: Mapping[str, Tensor], exact: Mapping[str, Tensor] | None,
                     floor: float) -> list[str]:
    """The names of ``bad`` whose result is off the float64 reference ``exact`` by more
    than ``tol`` and more than :data:`AS_AUTOGRAD` times float32 autograd's own error
    (``want``'s); all of them without a reference, or where autograd is itself further
    than :data:`GRAY` times ``tol`` from it (a forward that did not reproduce in float64:
    not a reference). The others go into ``cert.rounded``."""
    if exact is None:
        return bad
    left = []
    for name in bad:
        x = _dense(exact[name]).double().cpu()
        size = float(x.norm())
        off = float((_dense(got[name]).double().cpu() - x).norm())
        own = float((_dense(want[name]).double().cpu() - x).norm())
        if own > GRAY * cert.tol * size or off > max(cert.tol * size, AS_AUTOGRAD * own) + floor:
            left.append(name)
        else:
            cert.rounded[name] = own / max(size, 1e-300)
    return left


def _why(bad: list[str], cert: Certificate, moved: list[str]) -> str:
    names = ", ".join(f"{name} (relative error {cert.errors[name]:.2g})" for name in bad[:6])
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    causes = (f"the forward draws random numbers from {' and '.join(moved)}, which "
              "persample cannot replay per sample (draw them with torch's generators)"
              if moved else
              "a rule that does not hold on this model (a user rule, or a path persample "
              "gets wrong), a forward that does not reproduce under torch's generators, "
              "or a model that mixes samples")
    return f"the rows of {names}{more} disagree with the batch's gradient; likely cause: " \
           f"{causes}"


def certify_grads(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                  params: Mapping[str, Tensor],
                  summed: Callable[[Tensor], Mapping[str, Tensor]], draws: Draws,
                  method: str, what: str = "per-sample gradients",
                  norms_off: Callable[[], list[str]] | None = None,
                  losses: Tensor | None = None, read: str | None = None
                  ) -> Certificate | None:
    """Certify per-sample gradients: ``sum_i u_i g_i`` against the gradient of ``sum_i
    u_i L_i`` (see the module docstring); where the forward read sample data into Python
    (``read``: the op), also the last sample's row against that sample's forward alone: a
    number read out of the batch and used in every sample's arithmetic (``h *
    x.sum().item()``) is a constant to the identity, and steers each sample by the
    others. Where the identity cannot be formed because the output's samples may be in
    another dim of the batch's size, that comparison alone decides a mismatch
    (:func:`_last_alone`); the certificate is otherwise undecided.

    Args:
        model, batch, targets, loss_fn: the call.
        params: ``{name: parameter}`` whose gradients are checked.
        summed: ``summed(u)`` gives ``{name: sum_i u_i g_i}`` for weights ``u`` ``(n,)``
            float64, from the result checked (its rows, or the factors it came from).
        draws: the generators where the method started.
        method: the method that gave the result.
        what: the quantity, for the report.
        norms_off: ``norms_off()`` gives the parameters whose norms disagree with their
            rows' (the norm path), or ``None``.
        losses: the method's own per-sample losses ``(n,)``, or ``None`` (see
            :func:`_losses`).
        read: the op that read sample data into Python in the method's forward (a
            forward that draws no random numbers), or ``None``.

    Returns:
        The :class:`Certificate`, or ``None`` where the output cannot give each
        sample's loss without persample's data flow.
    """
    n = batch.n
    first = next(iter(params.values()))
    tol, eps = _precision(first.dtype, first.device)
    cert = Certificate(what, method, "sum_i u_i g_i = d(sum_i u_i L_i)/dtheta", tol=tol)
    u = _gaussian(n)
    whole: frozenset | None = None  # (output tensors passed whole: see _in_dim_0)
    try:
        (want,), moved, low = _weighted_gradients(model, [(batch, targets, u)], loss_fn,
                                                  params, draws, [losses], whole=None)
    except _NoIdentity as why:
        whole = _in_dim_0(cert, why, model, batch, targets, loss_fn, params, summed, draws,
                          eps)
        if whole is None:
            return cert
        (want,), moved, low = _weighted_gradients(  # (cut by dim 0)
            model, [(batch, targets, u)], loss_fn, params, draws, whole=whole)
    cert.tol, eps = _lowered(cert.tol, eps, low)

    def exact() -> dict[str, Tensor] | None:
        found = _weighted_in_float64(model, [(batch, targets, u)], loss_fn, params,
                                     draws, whole or frozenset())
        return None if found is None else found[0]

    _verdict(cert, summed(u), want, moved, eps, exact)
    if read is not None and n > 1 and cert.ok:
        _last_alone(cert, model, batch, targets, loss_fn, params, summed, draws, eps,
                    _read_alone(read))
    return _with_norms(cert, norms_off)


def _in_dim_0(cert: Certificate, why: _NoIdentity, model: nn.Module, batch: Batch,
              targets: Any, loss_fn: Callable, params: Mapping[str, Tensor],
              summed: Callable[[Tensor], Mapping[str, Tensor]], draws: Draws,
              eps: float) -> frozenset | None:
    """After the identity could not be formed (``why``): are the output's samples in dim
    0 after all, as the last sample's forward alone shows (:func:`_last_alone`,
    :func:`_elsewhere`)? Then the identity is to be formed by it: returns the positions
    of the output tensors that hold no sample (the same shape alone as in the batch, dim
    0 of the batch's size: passed whole to each sample's loss). Else ``None``: ``cert``
    is failed (that sample's row is not its gradient alone) or undecided. Where only
    such a tensor was in doubt (``why.shared``) and the forward alone decides nothing,
    the identity is formed by dim 0, as before the doubt, and the sample's gradient
    alone is not compared (the identity formed checks the result).
    ``summed(u)``: ``{name: sum_i u_i g_i}`` for weights ``u`` ``(n,)`` of the result."""
    n = batch.n
    # (where only the shapes are in doubt, the identity formed with them checks the
    # result: the sample alone's gradient is not compared, which a model computing parts
    # in another precision than its parameters' rounds otherwise than the batch)
    probe = Certificate(cert.what, cert.method, cert.identity, tol=cert.tol) \
        if why.shared else cert
    shapes = None if why.shapes is None or n == 1 else _last_alone(
        probe, model, batch, targets, loss_fn, params, summed, draws, eps, (
            f" (the identity over the batch could not be formed: {why}); likely "
            "cause: a model whose output holds the samples in another dim only at this "
            "batch size (a view or reshape that happens to fit), a whole-model method "
            "torch gets wrong on an op, or a model that mixes samples"))
    if not cert.ok:
        return None
    if why.shared and (shapes is None or len(shapes) != len(why.shapes)):
        return frozenset()  # (undecided by it: dim 0, as the losses agreed with it)
    if not why.shared and (shapes is None or _elsewhere(why.shapes, shapes, n)):
        cert.undecided(str(why))
        return None
    return frozenset(k for k, (b, a) in enumerate(zip(why.shapes, shapes))
                     if len(b) and b[0] == n and a == b)


def _last_alone(cert: Certificate, model: nn.Module, batch: Batch, targets: Any,
                loss_fn: Callable, params: Mapping[str, Tensor],
                summed: Callable[[Tensor], Mapping[str, Tensor]], draws: Draws,
                eps: float, why: str) -> list[torch.Size] | None:
    """``cert`` failed where the last sample's row is not that sample's gradient alone
    (its forward as a batch of one; ``why``: the reason's rest, as for :func:`_alone`),
    which holds wherever the samples are: where the forward read sample data into Python
    (a number steering every sample, which the identity takes for a constant), and where
    the identity cannot be formed because the output's samples may be in another dim of
    the batch's size (:data:`~persample.methods.AMBIGUOUS`; a whole-model method torch
    gets wrong is caught so). Returns the shapes of that forward's output tensors (for
    :func:`_elsewhere`), or ``None`` where nothing was decided: the forward alone draws
    random numbers (they are not the batch's), or it or its loss cannot be run."""
    n = batch.n
    side = (batch.samples(n - 1, n), samples_of(targets, n - 1, n),
            torch.ones(1, dtype=torch.float64))
    batches, roots = _weighted_roots([side], loss_fn)
    call, after, shapes = _plain_model(model), [], []

    def forward() -> list:
        outs = [b.call(call) for b in batches]
        after.append(snapshot())
        shapes.extend(t.shape for t in tree_leaves(outs[0]) if isinstance(t, Tensor))
        return outs

    try:
        (alone,), moved, _ = _reference(model, forward, draws, roots, list(params.values()))
    except Exception:  # (its loss cannot be formed, or a forward that needs more than
        return None  # one sample: undecided, as without this comparison)
    if moved or any(not torch.equal(a, b) for (_, a), (_, b) in zip(after[0],
                                                                   draws.torch_states)):
        return None
    alone = {name: p.new_zeros(p.shape) if g is None else g
             for (name, p), g in zip(params.items(), alone)}
    last = torch.zeros(n, dtype=torch.float64)
    last[-1] = 1
    _alone(cert, summed(last), alone, eps, n - 1, why)
    return shapes


def _elsewhere(batch: list[torch.Size], alone: list[torch.Size], n: int) -> bool:
    """Could the samples of the batch's output (its tensors' shapes ``batch``) be in a
    dim other than 0, given the shapes ``alone`` a sample's forward alone gives? Only
    where, for some dim ``d >= 1`` of size ``n``, a tensor alone is the batch's with ``d``
    of size 1 (a sequence-first output: ``(T, B, C)`` and ``(T, 1, C)``), or where the
    shapes cannot be paired."""
    if len(batch) != len(alone):
        return True
    for b, a in zip(batch, alone):
        if len(b) != len(a):
            return True
        for d in range(1, len(b)):
            if b[d] == n and a == b[:d] + (1,) + b[d + 1:]:
                return True
    return False


def _alone(cert: Certificate, got: Mapping[str, Tensor], want: Mapping[str, Tensor],
           eps: float, k: int, why: str) -> None:
    """``cert`` failed where sample ``k``'s row ``got`` is not its gradient alone
    ``want`` (see :func:`certify_grads`); ``why``: the rest of the reason, after "are not
    its gradient alone"."""
    errors, bad, _ = _compared(got, want, cert.tol, eps)
    cert.errors.update({f"{name} (sample {k} alone)": e for name, e in errors.items()})
    if bad:
        cert.ok = False
        names = ", ".join(f"{name} (relative error {errors[name]:.2g})" for name in bad[:6])
        cert.reason = f"sample {k}'s rows of {names} are not its gradient alone{why}"


def _read_alone(read: str) -> str:
    return (f", where its forward read sample data into Python ({read}): a number read out "
            "of the batch and used in every sample's arithmetic (h * x.sum().item()) steers "
            "each sample by the others, which no tensor shows; likely cause: such a number, "
            "or a model that mixes samples (write the number as a tensor op, h * x.sum(), "
            "which persample sees mixing samples)")


def _with_norms(cert: Certificate, norms_off: Callable[[], list[str]] | None
                ) -> Certificate:
    """``cert``, failed where ``norms_off()`` names parameters whose norms disagree with
    their rows'."""
    off = norms_off() if norms_off is not None else []
    if off:
        cert.ok = False
        cert.reason = (f"{cert.reason}; " if cert.reason else "") + (
            "the norms of " + ", ".join(off[:6]) + " disagree with the norms of their "
            "per-sample gradients (a norm rule that does not hold on this model)")
    return cert


def summed_rows(rows: Callable[[str], Tensor], names: Iterable[str]
                ) -> Callable[[Tensor], dict[str, Tensor]]:
    """``summed(u)`` of per-sample gradients given as rows: ``rows(name)`` ``(n, *shape)``."""
    def summed(u: Tensor) -> dict[str, Tensor]:
        out = {}
        for name in names:
            r = rows(name)
            out[name] = torch.tensordot(u.to(r.device, r.dtype), r, dims=1)
        return out
    return summed


def norms_disagree(norms: Mapping[str, Tensor], rows: Callable[[str], Tensor],
                   groups: Tensor | None = None, tol: float = 1e-2) -> list[str]:
    """The names whose squared norms ``norms[name]`` ``(n,)`` (``(U,)`` with ``groups``,
    each sample's user) are off their rows' ``rows(name)`` ``(n, *shape)`` by more than
    ``tol`` relative to the largest."""
    off = []
    for name, sq in norms.items():
        r = rows(name)
        flat = r.reshape(r.shape[0], -1)
        if groups is not None:
            flat = flat.new_zeros(sq.shape[0], flat.shape[1]).index_add_(0, groups, flat)
        want = torch.linalg.vector_norm(flat, dim=1, dtype=sq.dtype).square()
        if not torch.allclose(sq, want, rtol=tol, atol=tol * float(want.max()) + 1e-30):
            off.append(name)
    return off


def certify_step(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                 params: Mapping[str, Tensor], factors: Mapping[str, Tensor],
                 summed: Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]],
                 draws: Draws, method: str, norms_off: Callable[[], list[str]] | None = None,
                 losses: Tensor | None = None) -> Certificate:
    """Certify a DP step's micro-batch: its per-sample gradients and its clipped sum
    ``sum_i c_i g_i`` at once. For Gaussian ``u`` ``(n,)`` and ``lam``, the step's own
    machinery with the weights ``w = u + lam c`` (``summed({name: (n,)})``: the clipped
    sum's code with other factors) must give the gradient of ``sum_i w_i L_i``: a wrong
    row shows in the ``u`` part, a wrong clipped sum in the ``c`` part (with probability
    1 over ``u`` and ``lam``). One backward per distinct factor vector (per clipping
    group: one for flat clipping).

    Args:
        model, batch, targets, loss_fn, params, draws, method, norms_off, losses: as
            for :func:`certify_grads`.
        factors: ``{name: (n,)}`` the step's clip factors.
        summed: the weighted sums ``{name: sum_i w_i g_i}`` of the step's machinery for
            the weights ``{name: (n,)}``.

    Returns:
        The :class:`Certificate` (undecided where the output cannot give each sample's
        loss without persample's data flow).
    """
    n = batch.n
    first = next(iter(params.values()))
    tol, eps = _precision(first.dtype, first.device)
    cert = Certificate("per-sample gradients and clipped sum of a DP step", method,
                       "sum_i w_i g_i = d(sum_i w_i L_i)/dtheta, w = u + lam c", tol=tol)
    u, lam = _gaussian(n), float(_gaussian(1))
    vectors: list[Tensor] = []
    group: dict[str, int] = {}
    for name in params:
        c = factors[name]
        k = next((j for j, v in enumerate(vectors) if v is c or torch.equal(v, c)), None)
        if k is None:
            k = len(vectors)
            vectors.append(c)
        group[name] = k
    weights = [u + lam * c.detach().double().cpu() for c in vectors]
    whole: frozenset | None = None  # (output tensors passed whole: see _in_dim_0)
    try:
        grads, moved, low = _weighted_gradients(
            model, [(batch, targets, w) for w in weights], loss_fn, params, draws,
            [losses] * len(weights), whole=None)
    except _NoIdentity as why:
        whole = _in_dim_0(cert, why, model, batch, targets, loss_fn, params,
                          lambda w: summed({name: w for name in params}), draws, eps)
        if whole is None:
            return cert
        grads, moved, low = _weighted_gradients(  # (cut by dim 0)
            model, [(batch, targets, w) for w in weights], loss_fn, params, draws,
            [None] * len(weights), whole=whole)
    cert.tol, eps = _lowered(cert.tol, eps, low)
    want = {name: grads[group[name]][name] for name in params}
    got = summed({name: weights[group[name]] for name in params})

    def exact() -> dict[str, Tensor] | None:
        found = _weighted_in_float64(model, [(batch, targets, w) for w in weights], loss_fn,
                                     params, draws, whole or frozenset())
        return None if found is None else {name: found[group[name]][name] for name in params}

    _verdict(cert, got, want, moved, eps, exact)
    return _with_norms(cert, norms_off)


def certify_jacobian(model: nn.Module, batch: Batch, params: Mapping[str, Tensor],
                     rows: Mapping[str, Tensor], draws: Draws, method: str
                     ) -> Certificate:
    """Certify per-sample parameter Jacobians ``{name: (n, Y, *shape)}``: for Gaussian
    ``w`` ``(n, Y)``, ``sum_i w_i^T J_i`` against the gradient of ``<w, f(x)>``."""
    n = batch.n
    first = next(iter(params.values()))
    tol, eps = _precision(first.dtype, first.device)
    cert = Certificate("per-sample parameter Jacobians", method,
                       "sum_i w_i^T J_i = d<w, f(x)>/dtheta", tol=tol)
    some = next(iter(rows.values()))
    w = _gaussian(n, some.shape[1])

    def roots(out: Tensor) -> list:
        return [(out, w.to(out.device, out.dtype).view(out.shape))]

    (want,), moved, low = _reference(model, batch, draws, roots, list(params.values()))
    cert.tol, eps = _lowered(cert.tol, eps, low)
    got = {name: torch.tensordot(w.to(r.device, r.dtype), r, dims=2)
           for name, r in rows.items()}
    want_d = {name: p.new_zeros(p.shape) if g is None else g
              for (name, p), g in zip(params.items(), want)}

    def exact() -> dict[str, Tensor] | None:
        found = _in_float64(model, [batch], lambda outs: roots(outs[0]), params, draws)
        return None if found is None else found[0]

    return _verdict(cert, got, want_d, moved, eps, exact)


def certify_input_jacobian(model: Callable[[Tensor], Tensor], inputs: Tensor, jac: Tensor,
                           draws: Draws, method: str) -> Certificate:
    """Certify per-sample input Jacobians ``jac`` ``(n, *out_shape, *in_shape)`` of
    ``model`` at ``inputs`` ``(n, *in_shape)``: samples are independent, so for Gaussian
    ``w`` ``(n, Y)`` sample ``i``'s ``w_i^T J_i`` is row ``i`` of the gradient of ``<w,
    f(x)>`` w.r.t. ``x``."""
    n, d = inputs.shape[0], math.prod(inputs.shape[1:])
    y = jac[0].numel() // max(d, 1) if n else 0
    tol, eps = _precision(jac.dtype, jac.device)
    cert = Certificate("per-sample input Jacobians", method,
                       "w_i^T J_i = (d<w, f(x)>/dx)_i", tol=tol)
    w = _gaussian(n, y)
    xg = inputs.detach().requires_grad_()

    def roots(out: Tensor) -> list:
        return [(out, w.to(out.device, out.dtype).view(out.shape))]

    ((want,),), moved, low = _reference(model, lambda: model(xg), draws, roots, [xg])
    cert.tol, eps = _lowered(cert.tol, eps, low)
    got = torch.einsum("ny,nyd->nd", w.to(jac.device, jac.dtype), jac.reshape(n, y, d))
    want = torch.zeros_like(got) if want is None else want.reshape(n, d)

    def exact() -> dict[str, Tensor] | None:
        made = _float64_call(model, {})
        if made is None:
            return None
        x64 = inputs.detach().double().requires_grad_()
        try:
            ((g,),), _, _ = _reference(model, lambda: made[0](x64), draws, roots, [x64])
        except Exception:  # (a best effort, as in _in_float64)
            return None
        return {"inputs": torch.zeros_like(x64).reshape(n, d) if g is None else g.reshape(n, d)}

    return _verdict(cert, {"inputs": got}, {"inputs": want}, moved, eps, exact)


def _weighted_gradients(model: nn.Module, sides: list[tuple[Batch, Any, Tensor]],
                        loss_fn: Callable, params: Mapping[str, Tensor], draws: Draws,
                        expected: list[Tensor | None] | None = None,
                        whole: frozenset | None = frozenset()
                        ) -> tuple[list[dict[str, Tensor]], list[str], torch.dtype | None]:
    """For each ``(batch, targets, u)`` of ``sides`` (forwards in that order, from
    ``draws``; a batch repeated is one forward), the gradient of ``sum_i u_i L_i``
    ``{name: (*shape)}`` (``expected``: each side's method's losses, or ``None``;
    ``whole``: as for :func:`_losses`; ``None`` where a sample's forward alone is to say
    which output tensors hold no sample)."""
    batches, roots = _weighted_roots(sides, loss_fn, expected, whole=whole)
    call = _plain_model(model)
    grads, moved, low = _reference(model, lambda: [b.call(call) for b in batches], draws,
                                   roots, list(params.values()))
    return [{name: p.new_zeros(p.shape) if g is None else g
             for (name, p), g in zip(params.items(), gs)} for gs in grads], moved, low


def _weighted_roots(sides: list[tuple[Batch, Any, Tensor]], loss_fn: Callable,
                    expected: list[Tensor | None] | None = None,
                    cast: Callable[[Any], Any] = lambda targets: targets,
                    whole: frozenset | None = frozenset()
                    ) -> tuple[list[Batch], Callable[[list], list[tuple[Tensor, None]]]]:
    """``(batches, roots)``: the distinct batches of ``sides`` in order, and
    ``roots(outputs)`` giving each side's ``sum_i u_i L_i`` from those batches' outputs
    (the targets through ``cast``; ``expected`` as for :func:`_weighted_gradients`)."""
    expected = expected or [None] * len(sides)
    known = {id(b): e for (b, _, _), e in zip(sides, expected)}
    by_id = {id(b): (b, t) for b, t, _ in sides}

    def roots(outs: list) -> list:
        losses = {k: _losses(out, cast(t), loss_fn, b.n, known[k], whole)
                  for (k, (b, t)), out in zip(by_id.items(), outs)}
        return [((u.to(losses[id(b)].device, losses[id(b)].dtype) * losses[id(b)]).sum(),
                 None) for b, _, u in sides]

    return [b for b, _ in by_id.values()], roots


def _in_float64(model: nn.Module, batches: list[Batch],
                roots: Callable[[list], list[tuple[Tensor, Any]]],
                params: Mapping[str, Tensor], draws: Draws) -> list[dict[str, Tensor]] | None:
    """The reference of an identity computed in float64: each of ``batches``' forwards
    (from ``draws``) by :func:`_float64_call`, ``roots(outputs)`` differentiated w.r.t.
    ``params``' float64 copies. ``None`` where it cannot be (a parameter not the model's,
    an op that refuses the mixed dtypes of a forward that casts by itself, an output that
    is not float64)."""
    made = _float64_call(model, params)
    if made is None:
        return None
    call, leaves = made
    try:
        grads, _, _ = _reference(model, lambda: [b.call(call) for b in batches], draws, roots,
                                 leaves)
    except Exception:  # (a best effort: without it the certificate stands as it was)
        return None
    return [{name: p.new_zeros(p.shape, dtype=torch.float64) if g is None else g
             for (name, p), g in zip(params.items(), gs)} for gs in grads]


def _float64_call(model: Any, params: Mapping[str, Tensor]
                  ) -> tuple[Callable[..., Any], list[Tensor]] | None:
    """``(call, leaves)``: ``call(*args, **kwargs)`` runs ``model``'s forward in float64
    (its parameters and floating buffers, as the forward finds them, cast into a
    ``torch.func.functional_call``; the floating inputs cast; the model itself
    untouched), with ``leaves`` (float64 copies of ``params``, in order) for its
    parameters of ``params``. ``None`` for a model that is not a module, or a parameter
    of ``params`` not the model's."""
    plain = _plain_model(model)
    if not isinstance(plain, nn.Module):
        return None
    names: dict[int, list[str]] = {}
    for name, p in plain.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    if any(id(p) not in names for p in params.values()):
        return None
    leaves = {id(p): p.detach().double().requires_grad_() for p in params.values()}
    cast = {name: leaves.get(i, p.detach().double() if p.is_floating_point() else p)
            for i, p in {id(p): p for p in plain.parameters()}.items() for name in names[i]}

    def call(*args: Any, **kwargs: Any) -> Any:  # (the buffers as the forward finds them)
        state = dict(cast)
        state.update({name: b.detach().double() for name, b in plain.named_buffers(
            remove_duplicate=False) if b.is_floating_point()})
        args, kwargs = _doubled((args, kwargs))
        out = torch.func.functional_call(plain, state, args, kwargs)
        if any(t.is_floating_point() and t.dtype != torch.float64 for t in tree_leaves(out)
               if isinstance(t, Tensor)):
            raise _NoIdentity("the forward does not compute in float64")
        return out

    return call, list(leaves.values())


def _weighted_in_float64(model: nn.Module, sides: list[tuple[Batch, Any, Tensor]],
                         loss_fn: Callable, params: Mapping[str, Tensor], draws: Draws,
                         whole: frozenset | None = frozenset()
                         ) -> list[dict[str, Tensor]] | None:
    """:func:`_weighted_gradients` in float64 (:func:`_in_float64`; the floating targets
    cast too), or ``None``."""
    batches, roots = _weighted_roots(sides, loss_fn, cast=_doubled, whole=whole)
    return _in_float64(model, batches, roots, params, draws)


def _doubled(tree: Any) -> Any:
    """``tree`` with its floating tensors in float64."""
    return tree_map(lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point()
                    else t, tree)


def certify_dots(model: nn.Module, side: tuple[Batch, Any], second: tuple[Batch, Any] | None,
                 loss_fn: Callable, params: Mapping[str, Tensor], dots: Tensor,
                 draws: Draws, method: str) -> Certificate | None:
    """Certify per-sample gradient inner products ``dots`` ``(n, m)``: for Gaussian ``u``
    ``(n,)`` and ``v`` ``(m,)``, ``u^T D v = <d(sum_i u_i L_i)/dtheta, d(sum_j v_j
    L'_j)/dtheta>`` (two backwards; ``second=None``: the batch with itself)."""
    a, b = side, side if second is None else second
    tol, eps = _precision(dots.dtype, dots.device)
    cert = Certificate("per-sample gradient inner products", method,
                       "u^T D v = <d(u.L)/dtheta, d(v.L')/dtheta>", tol=tol)
    u, v = _gaussian(a[0].n), _gaussian(b[0].n)
    try:
        (gu, gv), moved, low = _weighted_gradients(model, [(*a, u), (*b, v)], loss_fn,
                                                   params, draws)
    except _NoIdentity as why:
        return cert.undecided(str(why))
    cert.tol, eps = _lowered(cert.tol, eps, low)
    tol = cert.tol
    a = torch.cat([g.double().flatten() for g in gu.values()]).cpu()
    b = torch.cat([g.double().flatten() for g in gv.values()]).cpu()
    d = dots.double().cpu()
    pairs = [(u, v, a, b)]  # u^T D v; with the batch itself also u^T D u and v^T D v,
    if second is None:  # whose errors cannot cancel (a sum of squares)
        pairs += [(u, u, a, a), (v, v, b, b)]
    worst = 0.0
    for x, y, gx, gy in pairs:
        got, want = float(x @ d @ y), float(gx @ gy)
        scale = float(gx.norm() * gy.norm())  # Cauchy-Schwarz: the size of the terms
        err = abs(got - want)
        worst = max(worst, err / max(scale, 1e-300))
        if err > tol * scale + 64 * eps * (scale + 1):
            cert.ok = False
    cert.errors = {"<all parameters>": worst}
    if not cert.ok:
        cert.reason = _why(["<all parameters>"], cert, moved)
    return cert


def certify_projection(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                       params: Mapping[str, Tensor], projected: Tensor,
                       project: Callable[[dict[str, Tensor]], Tensor], draws: Draws,
                       method: str) -> Certificate | None:
    """Certify projected per-sample gradients ``projected`` ``(n, k)`` of a linear map
    ``project``: for Gaussian ``u`` ``(n,)``, ``u^T R = project(d(sum_i u_i
    L_i)/dtheta)``."""
    tol, eps = _precision(projected.dtype, projected.device)
    cert = Certificate("projected per-sample gradients", method,
                       "u^T R = P d(sum_i u_i L_i)/dtheta", tol=tol)
    u = _gaussian(batch.n)
    try:
        (g,), moved, low = _weighted_gradients(model, [(batch, targets, u)], loss_fn, params,
                                               draws)
    except _NoIdentity as why:
        return cert.undecided(str(why))
    cert.tol, eps = _lowered(cert.tol, eps, low)
    want = project({name: t.unsqueeze(0) for name, t in g.items()})[0]  # (k,)
    got = u.to(projected.device, projected.dtype) @ projected

    def exact() -> dict[str, Tensor] | None:
        found = _weighted_in_float64(model, [(batch, targets, u)], loss_fn, params, draws)
        if found is None:
            return None
        try:  # (the projection's own rounding is the method's too)
            return {"projection": project({name: t.unsqueeze(0) for name, t in
                                           found[0].items()})[0]}
        except Exception:  # (a best effort, as in _in_float64)
            return None

    return _verdict(cert, {"projection": got}, {"projection": want}, moved, eps, exact)
