"""The clipped sums of one micro-batch from one forward and one backward ("book-keeping").

Abadi et al. (2016), "Deep learning with differential privacy": clip each
sample's gradient to norm ``C``, sum, add ``N(0, sigma^2 C^2 I)``, divide by the
batch size. This module does the first two for one micro-batch, without the ``(B, P)``
tensor (Bu et al. 2023, "book-keeping"): the captured activations and backprops give
the per-sample norms (``persample.norms``), then the clipped sum of every layer
whose norms came from the ghost norm is that layer's ordinary weight gradient
with each sample's backprops scaled by its clip factor ``c_i`` (one local
backward of the captured graph: for Linear, the matrix product ``(c G)^T A``);
layers whose per-sample gradients were materialised for their norms are summed
with the factors directly.

:func:`clipped_sums` is the entry point. It adds the sums into memory that a
:class:`Destination` gives once the norms are known, and knows nothing of the noise,
the divisor or the processes: :class:`persample.dp.PrivateStep` and its reducers
(:mod:`persample.dp.reduce`) do that. :class:`Clipped` holds what the sums are
computed from.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from .. import checks
from ..certificate import (
    Certificate,
    Checker,
    Draws,
    certify_step,
    norms_disagree,
    signature,
)
from ..engine import Captured, loss_backprops
from ..engine.norms import group_squared_norms, per_sample_rows, squared_norms, sum_of_squares
from ..engine.weighted import (
    PartialSums,
    add_materialised,
    add_module_normed,
    book_keeping,
    complete_sums,
    keeps_graph,
)
from ..errors import CertificateError, InternalError, internal, internal_errors_raised
from ..inputs import Batch
from ..methods import AMBIGUOUS, Taken, answer, leave_rules, slower, user_stacklevel
from ..precision import accumulate_dtype
from ..sharded import fsdp_units
from ..whole import loop_grads, vmap_grads
from .clipping import ClipBounds


class Accumulated(NamedTuple):
    """What one micro-batch of a DP step gives back, for logging: ``losses (n,)``, each
    sample's own loss in the forward that was clipped (detached; the loss's dtype, or
    at least float32 where the gradients came from ``torch.func`` or the loop), and
    ``norms (n,)``, its gradient's norm before clipping over all parameters (at least
    float32). ``losses.mean()`` is the batch's training loss.

    Examples:
        >>> from persample.dp import private_grad
        >>> net = nn.Linear(3, 2)
        >>> out = private_grad(net, torch.randn(4, 3), torch.randn(4, 2), nn.MSELoss(),
        ...                    max_grad_norm=1.0, noise_multiplier=1.0)
        >>> losses, norms = out
        >>> losses.shape, norms.shape
        (torch.Size([4]), torch.Size([4]))
    """

    losses: Tensor
    norms: Tensor


@dataclass
class MicroBatch:
    """One validated call: what the per-sample gradients are taken of.

    Attributes:
        model: the ``nn.Module`` (for FSDP2, the sharded model: ``sharded`` is then true).
        batch: the inputs, read (``persample.inputs.as_batch``), ``n`` samples.
        targets: the targets, batch in dim 0.
        loss_fn: ``loss_fn(output, targets)``.
        params: ``{name: parameter}`` the forward reads (FSDP2: the unsharded ones).
        users: ``(n,)`` int64, each sample's user (user-level DP: a user's samples are
            clipped together), or ``None`` (each sample its own).
        check: when the clipped sums are certified (:mod:`persample.certificate`):
            ``"first"`` (the first micro-batch of each plan), ``"always"``, ``"never"``
            or ``N``.
        sharded: whether ``model`` has FSDP2 units (set on creation).

    Examples:
        >>> from persample import checks
        >>> net, loss_fn = nn.Linear(3, 2), nn.MSELoss()
        >>> x, y = torch.randn(4, 3), torch.randn(4, 2)
        >>> batch, n, params = checks.validate_call(net, x, y, loss_fn, "auto", None)
        >>> micro = MicroBatch(net, batch, y, loss_fn, params)
        >>> micro.batch.n, micro.sharded
        (4, False)
    """

    model: nn.Module
    batch: Batch
    targets: Any
    loss_fn: Callable[[Any, Any], Tensor]
    params: dict[str, nn.Parameter]
    users: Tensor | None = None
    check: str | int | None = None
    sharded: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sharded = bool(fsdp_units(self.model))


class Destination(Protocol):
    """Where :func:`clipped_sums` adds a micro-batch's clipped sums: ``check(norms)``
    first, then per group ``make(group)`` (memory, after the backward) and ``flush(sums)``
    (complete). Each mode of :mod:`persample.dp.reduce` has one (an ``Accumulation``).

    Examples:
        >>> from persample.dp.reduce import Local, Terms
        >>> net = nn.Linear(3, 2)
        >>> params = dict(net.named_parameters())
        >>> into = Local().micro_batch(None, params, Terms(params, 0.0, None, 1.0))
        >>> into.groups == [[id(net.weight), id(net.bias)]]
        True
        >>> into.check(torch.tensor([1.0, float("inf")]))
        Traceback (most recent call last):
        ...
        FloatingPointError: the gradients of samples [1] are not finite (NaN or Inf), ...
    """

    groups: list[list[int]]
    """Parameter ids (``id(p)`` of ``MicroBatch.params``) summed in turn: one FSDP unit's
    at a time, else one group of all."""

    def check(self, norms: Tensor) -> None:
        """Raise before anything is summed, given the ``(n,)`` per-sample norms (e.g. a
        ``FloatingPointError`` for non-finite ones)."""

    def make(self, group: list[int]) -> dict[int, Tensor]:
        """The memory the sums of ``group`` (parameter ids) are added into: ``{id(p):
        tensor}`` of ``p``'s shape, in the dtype sums accumulate in, initialised (zeros,
        or the noise); asked for after the backward."""

    def flush(self, sums: dict[int, Tensor]) -> None:
        """The group's sums (``make``'s tensors), complete."""


def clipped_sums(micro: MicroBatch, *, clipping: ClipBounds, into: Destination) -> Accumulated:
    """Add ``sum_i c_i g_i`` of every parameter of one micro-batch into ``into``.

    ``g_i`` is sample ``i``'s own gradient and ``c_i`` its clip factor for the
    parameter's group (:class:`~persample.dp.clipping.Clipping`: flat ``min(1, C /
    (||g_i|| + 1e-6))``, per layer, per group, or automatic). One forward and
    backward, the norms by the rules (or, where the rules cannot split the model, the
    per-sample gradients of ``torch.func`` or the loop, with a warning; not for a
    sharded model, which has no whole-model fallback). An unused parameter gets nothing
    added. Abadi et al. 2016 (clipping); Bu et al. 2023 (book-keeping).

    Args:
        micro: the validated call.
        clipping: how each sample's gradient is clipped (its groups name
            ``micro.params``).
        into: the memory, group by group (:class:`Destination`): ``into.check(norms)``
            first, then ``make`` and ``flush`` per group.

    Returns:
        :class:`Accumulated`: the ``(n,)`` per-sample losses of the forward, and the
        ``(n,)`` per-sample gradient norms before clipping, in the dtype norms
        accumulate in (at least float32).

    Raises:
        Whatever ``into.check`` raises (before anything is summed), and the errors of
        ``per_sample_grads``.

    Examples:
        >>> from persample import checks
        >>> from persample.dp import Clipping
        >>> net = nn.Linear(3, 2)
        >>> x, y = torch.randn(4, 3), torch.randn(4, 2)
        >>> batch, _, params = checks.validate_call(net, x, y, nn.MSELoss(), "auto", None)
        >>> class Zeros:
        ...     groups = [[id(p) for p in params.values()]]
        ...     def check(self, norms): assert torch.isfinite(norms).all()
        ...     def make(self, group):
        ...         return {id(p): torch.zeros_like(p) for p in params.values()}
        ...     def flush(self, sums): self.sums = sums
        >>> zeros = Zeros()
        >>> losses, norms = clipped_sums(MicroBatch(net, batch, y, nn.MSELoss(), params),
        ...                              clipping=Clipping.flat(1e-3).bound(list(params)),
        ...                              into=zeros)
        >>> norms.shape, zeros.sums[id(net.weight)].shape
        (torch.Size([4]), torch.Size([2, 3]))
    """
    if micro.batch.n == 0:
        return _nothing_to_clip(micro, into)
    clipped = _certified(micro, clipping, into)
    for group in into.groups:
        sums = into.make(group)
        clipped.add_group(sums, set(group))
        into.flush(sums)
    return Accumulated(clipped.losses, clipped.norms())


def _certified(micro: MicroBatch, clipping: ClipBounds, into: Destination) -> Clipped:
    """The micro-batch measured and clipped, its result certified where due: the
    per-sample gradients behind the norms, the norms, and the clipped sum (see
    :mod:`persample.certificate`). A mismatch warns and takes the next exact method
    (``torch.func``, then the loop); the loop's mismatch raises."""
    params = micro.params
    checker = Checker(micro.check, micro.model, signature(
        "clipped", micro.model, micro.batch, micro.targets, params.values(),
        micro.users is not None))
    taken = Taken()
    if not micro.sharded and checker.rejected("rules"):
        taken.method = "vmap"
    while True:
        draws = Draws.now()
        clipped = Clipped.measure(micro, taken)
        norms = clipped.norms()  # (n,)
        into.check(norms)
        clipped.clip(clipping)
        how = "rules" if clipped.captured is not None else taken.method
        cert = None if micro.sharded else checker(
            how, lambda clipped=clipped, draws=draws, how=how: clipped.certify(draws, how))
        if (cert is not None and not cert.decided and cert.reason == AMBIGUOUS
                and taken.mixing and how != "rules"):
            raise CertificateError(
                f"the rules found this model's samples mixed ({taken.reason.split('. ')[0]}),"
                f" and the whole-model answer cannot be certified ({cert.describe()}): a "
                "sample's gradient, its clipping and the privacy guarantee may not be "
                "defined.")
        if cert is None or cert.ok:
            return clipped
        if how == "loop":
            raise CertificateError(
                f"persample's certificate rejects the DP step's result: {cert.describe()}. "
                "Even the loop over samples (each sample's forward alone) disagrees with the "
                "batch's forward: the model mixes samples (a statistic or a permutation of "
                "the batch), so a sample's gradient, its clipping and the privacy guarantee "
                "are not defined, or its forward does not reproduce under torch's "
                "generators.")
        warnings.warn(f"persample's certificate caught a wrong result of the DP step and "
                      f"discarded it: {cert.describe()}. Taking the next exact method "
                      "(torch.func over the whole model, then the loop), itself certified; "
                      "please report this model.", stacklevel=user_stacklevel())
        taken.reason = f"certificate mismatch: {cert.describe()}"
        taken.method = "vmap" if how == "rules" else "loop"
        draws.restore()


def refuse_capture() -> None:
    """Raise ``RuntimeError`` while a CUDA graph is captured (``torch.cuda.graph``): a DP
    step refuses non-finite per-sample gradients by reading their norms on the host, which
    a capture cannot do and its replays would skip.

    Examples:
        >>> refuse_capture()  # (no capture here: nothing raised)
    """
    if checks.capturing():
        raise RuntimeError(
            "a DP step cannot be captured in a CUDA graph: refusing non-finite per-sample "
            "gradients reads their norms on the host, which a capture cannot do and its "
            "replays would skip. Run the DP step outside torch.cuda.graph.")


def check_finite(norms: Tensor) -> None:
    """Refuse non-finite per-sample norms: such gradients cannot be clipped.

    Args:
        norms: ``(n,)`` per-sample gradient norms, any floating dtype.

    Raises:
        FloatingPointError: naming the samples (the first ten) and the fix.
        RuntimeError: while a CUDA graph is captured (the check reads the norms on the
            host, which a capture cannot, and a replay would not check them).

    Examples:
        >>> check_finite(torch.tensor([1.0, float("nan")]))
        Traceback (most recent call last):
        ...
        FloatingPointError: the gradients of samples [1] are not finite (NaN or Inf), ...
    """
    refuse_capture()
    bad = checks.non_finite_samples(norms)
    if bad:
        raise FloatingPointError(
            f"the gradients of samples {bad[:10]}{'...' if len(bad) > 10 else ''} are not "
            "finite (NaN or Inf), so they cannot be clipped; p.grad was left unchanged. "
            "Check those inputs (or the loss), drop them and call again."
        )


def _nothing_to_clip(micro: MicroBatch, into: Destination) -> Accumulated:
    """An empty micro-batch: every group's memory made and handed back as it is."""
    params = list(micro.params.values())
    if micro.sharded:  # the other ranks' all-gathers wait for this rank's forward and backward
        _empty_pass(micro.model, micro.batch, params)
    into.check(params[0].new_zeros(0))
    for group in into.groups:
        into.flush(into.make(group))
    empty = params[0].new_zeros(0, dtype=accumulate_dtype(params[0].dtype))
    return Accumulated(empty, empty)


def _empty_pass(model: nn.Module, batch: Batch, params: list[nn.Parameter]) -> None:
    """A rank of an FSDP2 model without samples in this micro-batch runs a forward and
    backward all the same: FSDP's all-gathers are collectives. Many models cannot run a
    batch of none (transformers' attention reshapes by ``(B, T, -1)``), so where every
    leaf that carries samples is a plain tensor the pass runs one sample of zeros in
    their shapes and dtypes instead; its gradients are thrown away (nothing of it
    reaches ``p.grad`` or another rank)."""
    from torch.utils._pytree import tree_leaves

    with torch.enable_grad():
        out = _one_zero_sample(batch).call(model)
    outs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if outs:
        torch.autograd.grad(torch.stack([t.sum() for t in outs]).sum(), params,
                            allow_unused=True)


def _one_zero_sample(batch: Batch) -> Batch:
    """``batch`` (of no samples) as one sample of zeros: each sample-carrying tensor
    ``(0, *rest)`` becomes ``zeros(1, *rest)`` (token ids 0, masks 0, features 0); the
    batch as it is where a special form (packed sequences, rows, graphs) carries them."""
    leaves = batch.leaves()
    if not all(isinstance(leaves[k], Tensor) for k in batch.sample_leaves):
        return batch
    zeros = [leaf.new_zeros((1, *leaf.shape[1:])) if k in batch.sample_leaves else leaf
             for k, leaf in enumerate(leaves)]
    args, kwargs = batch.rebuilt(zeros)
    return Batch(args, kwargs, 1, batch.sample_leaves, batch.form)


@dataclass
class Clipped:
    """One micro-batch's per-sample norms and what its clipped sums are computed from.

    Made by :meth:`measure`; :meth:`clip` sets the clip factors, then
    :meth:`add_group` adds ``sum_i c_i g_i`` of a group of parameters. Parameters are
    keyed by ``id(p)`` (of ``micro.params``).

    Attributes:
        micro: the call.
        captured: the forward and backward the rules read (``None``: the per-sample
            gradients were materialised by ``torch.func`` or the loop).
        squared: ``{id(p): (n,)}`` squared norm of each sample's gradient of ``p``, in at
            least float32.
        materialised: ``{id(p): (n, 1, *p.shape)}`` per-sample gradients computed for the
            norms (a layer without a ghost norm, or every parameter after a fallback).
        ghosted: ``{op: {id(p)}}`` the ops whose parameters got ghost norms (a parameter
            several ops read is in each).
        module_normed: ``(call, output edge, its layout, {name: p})`` of the module calls
            whose parameters a module norm rule normed.
        factors: ``{id(p): (n,)}`` the clip factors ``c_i`` (empty before :meth:`clip`).
        losses: ``(n,)`` each sample's own loss in the forward measured (detached).
        groups: ``(n,)`` int64, each sample's user as an index in ``[0, U)``, or ``None``:
            ``squared`` then holds the squared norms of each user's gradient (the sum of
            its samples'), ``(U,)``, and each sample gets its user's factor.

    Examples:
        >>> from persample import checks
        >>> from persample.dp import Clipping
        >>> net, loss_fn = nn.Linear(3, 2), nn.MSELoss()
        >>> x, y = torch.randn(4, 3), torch.randn(4, 2)
        >>> batch, _, params = checks.validate_call(net, x, y, loss_fn, "auto", None)
        >>> clipped = Clipped.measure(MicroBatch(net, batch, y, loss_fn, params))
        >>> norms = clipped.norms()  # (4,) before clipping
        >>> clipped.clip(Clipping.flat(1e-3).bound(list(params)))
        >>> sums = {id(p): torch.zeros_like(p) for p in params.values()}
        >>> clipped.add_group(sums, set(sums))  # each sample's gradient clipped to 1e-3
        >>> total = torch.cat([t.flatten() for t in sums.values()]).norm()
        >>> bool(total <= 4 * 1e-3 * (1 + 1e-5))
        True
    """

    micro: MicroBatch
    captured: Captured | None
    squared: dict[int, Tensor]
    materialised: dict[int, Tensor]
    ghosted: dict[Any, set[int]]
    module_normed: list[tuple]
    losses: Tensor
    groups: Tensor | None = None
    factors: dict[int, Tensor] = field(default_factory=dict)

    @classmethod
    def measure(cls, micro: MicroBatch, taken: Taken | None = None) -> Clipped:
        """One forward and backward of ``micro`` and the per-sample squared norms: by the
        rules (``method="auto"``: else ``torch.func``'s or the loop's per-sample gradients,
        with a warning; a sharded model: the rules only).

        Args:
            micro: the validated call.
            taken: where ``method="auto"`` starts and what it took (shared by the tries
                of one micro-batch), or ``None``.

        Returns:
            The :class:`Clipped` of ``micro``, without clip factors yet.

        Raises:
            The errors of ``per_sample_grads`` (the model's own, or persample's where the
            rules cannot split a sharded model).
        """
        params = micro.params
        watched = {id(p): p for p in params.values()}
        groups, count = _user_groups(micro.users)

        def by_rules() -> Clipped:
            captured = loss_backprops(micro.model, micro.batch, micro.targets, micro.loss_fn,
                                      watched, retain_graph=keeps_graph)
            with internal("the norm rules"):
                if groups is None:
                    return cls(micro, captured, *squared_norms(captured, params),
                               captured.losses)
                squared, mats, ghosted = group_squared_norms(captured, params, groups, count)
                return cls(micro, captured, squared, mats, ghosted, [], captured.losses,
                           groups)

        def by(method: Callable) -> Callable[[], Clipped]:
            def materialised() -> Clipped:
                first = next(iter(params.values()))
                losses = first.new_empty(micro.batch.n, dtype=accumulate_dtype(first.dtype))
                grads = method(micro.model, micro.batch, micro.targets, micro.loss_fn, params,
                               losses)
                mats = {id(params[name]): g.unsqueeze(1) for name, g in grads.items()}
                squared = {pid: sum_of_squares(_summed(m.flatten(1), groups, count))
                           for pid, m in mats.items()}
                return cls(micro, None, squared, mats, {}, [], losses, groups)
            return materialised

        return answer(
            "rules" if micro.sharded else "auto", rules=by_rules,
            vmap=by(vmap_grads),
            loop=by(lambda m, b, t, f, _, losses: loop_grads(m, b, t, f, losses)),
            taken=taken, hint=lambda: checks.dtype_note(micro.batch, params))

    def certify(self, draws: Draws, how: str) -> Certificate:
        """The certificate of this micro-batch once clipped
        (:func:`persample.certificate.certify_step`): its per-sample gradients and its
        clipped sum, from this step's own machinery with random weights added to the
        clip factors, and the norms of module norm rules against their rows.

        Args:
            draws: where the generators stood when the micro-batch was measured.
            how: the method that measured it.

        Returns:
            The :class:`~persample.certificate.Certificate`.
        """
        micro = self.micro
        params = micro.params
        names = list(params)
        dtype = next(iter(self.factors.values())).dtype

        def summed(weights: dict[str, Tensor]) -> dict[str, Tensor]:
            factors = self.factors
            self.factors = {id(p): weights[name].to(factors[id(p)].device, dtype)
                            for name, p in params.items()}
            try:
                return dict(zip(names, self._sums().values()))
            finally:
                self.factors = factors

        rows = (per_sample_rows(self.captured, params, self.materialised)
                if self.captured is not None
                else lambda name: self.materialised[id(params[name])][:, 0])
        ruled = {id(p) for _, _, _, normed in self.module_normed for p in normed.values()}
        squared = {name: self.squared[id(p)] for name, p in params.items() if id(p) in ruled}
        return certify_step(micro.model, micro.batch, micro.targets, micro.loss_fn, params,
                            {name: self.factors[id(p)] for name, p in params.items()},
                            summed, draws, how,
                            lambda: norms_disagree(squared, rows, self.groups), self.losses)

    def _sums(self) -> dict[int, Tensor]:
        """``{id(p): sum_i c_i g_i}`` of every parameter with the factors set now, into
        memory of their own."""
        with torch.no_grad():
            sums = {id(p): torch.zeros_like(p, dtype=accumulate_dtype(p.dtype))
                    for p in self.micro.params.values()}
            self.add_group(sums, set(sums))
        return sums

    def norms(self) -> Tensor:
        """``(n,)`` per-sample gradient norms over all parameters (with users: each
        sample's user's), in the dtype the squared norms accumulate in (at least
        float32)."""
        norms = torch.stack([self.squared[id(p)] for p in self.micro.params.values()]
                            ).sum(0).sqrt()
        return norms if self.groups is None else norms[self.groups]

    def clip(self, clipping: ClipBounds) -> None:
        """Set :attr:`factors` from the squared norms: each sample's factor for each
        parameter's group (the same for every parameter of a group).

        Args:
            clipping: the groups (names of ``micro.params``) and their bounds.
        """
        params = self.micro.params
        by_name = clipping.factors({name: self.squared[id(p)] for name, p in params.items()})
        if self.groups is not None:  # (U,) per user: each sample its user's
            by_name = {name: c[self.groups] for name, c in by_name.items()}
        self.factors = {id(p): by_name[name] for name, p in params.items()}

    def add_group(self, into: dict[int, Tensor], group: set[int]) -> None:
        """Add ``sum_i c_i g_i`` of the parameters ``group`` into ``into``: the
        materialised ones with the factors, the module-normed ones through their module's
        backward, the ghost-normed ones op by op (Bu et al. 2023); where persample's own
        code fails, the rest from per-sample gradients, with a warning.

        Args:
            into: ``{id(p): tensor}`` of ``p``'s shape, added to (a parameter no op reads
                gets nothing).
            group: the ids of the parameters to sum (those of one FSDP unit, or all).

        Raises:
            persample's ``InternalError`` where its own code fails on a sharded model
            (no whole-model fallback there); the errors of ``torch.func`` and the loop.
        """
        done = add_materialised(self.materialised, self.factors, into, group)
        left: dict[int, list] = {}  # id -> the ops whose sums are not added yet
        try:
            with internal("the clipped sums"):
                add_module_normed(self.captured, self.module_normed, self.factors, into,
                                  group, done)
                if self.captured is not None:
                    book_keeping(self.captured, {op: pids & group for op, pids in
                                                  self.ghosted.items() if pids & group},
                                  self.factors, into, done, left)
        except InternalError as err:  # the norms are right: the rest from per-sample gradients
            if self.micro.sharded or internal_errors_raised() or isinstance(err, PartialSums):
                raise  # (partly added sums: nothing may add them again)
            leave_rules(Taken(), err)
            with internal("the clipped sums of the uses left"):
                complete_sums(self.captured, self.ghosted, left, self.factors, into, done)
            self._add_per_sample(into, group, done)

    def _add_per_sample(self, into: dict[int, Tensor], group: set[int],
                        done: set[int]) -> None:
        """After a failure: the parameters of ``group`` not in ``done`` from per-sample
        gradients (``torch.func``, else the loop)."""
        micro = self.micro
        rest = {name: p for name, p in micro.params.items()
                if id(p) in group and id(p) not in done}
        grads = slower(
            lambda: vmap_grads(micro.model, micro.batch, micro.targets,
                                          micro.loss_fn, rest),
            lambda: loop_grads(micro.model, micro.batch, micro.targets,
                                          micro.loss_fn))
        with torch.no_grad():
            for name, p in rest.items():
                into[id(p)].add_(torch.tensordot(self.factors[id(p)].to(grads[name].dtype),
                                                 grads[name], dims=1))


def _user_groups(users: Tensor | None) -> tuple[Tensor | None, int]:
    """Each sample's user as an index in ``[0, U)``, and ``U``; ``(None, 0)`` without
    users."""
    if users is None:
        return None, 0
    ids, groups = torch.unique(users, return_inverse=True)
    return groups, len(ids)


def _summed(rows: Tensor, groups: Tensor | None, count: int) -> Tensor:
    """``(n, m)`` per-sample rows summed by user ``(U, m)`` (as they are without users)."""
    if groups is None:
        return rows
    return rows.new_zeros(count, rows.shape[1]).index_add_(0, groups, rows)
