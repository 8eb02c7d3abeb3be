"""Each sample's own loss, from the model's output as it is.

``loss_fn(output, targets)`` gets the model's output unchanged (a tensor, a tuple, a
dict, a Hugging Face ``ModelOutput``), and runs under the capture's data flow. It may
return per-sample losses ``(B,)``: if each entry holds its own sample alone (the data
flow says so) they are summed as they are. Otherwise (a scalar reduced over the
batch, or a ``(B,)`` loss that mixes samples) the loss is evaluated again for each
sample on that sample's slice of the output (each output tensor cut along the dim the
capture found its samples in, as a batch of one): with ``torch.func.vmap`` where the
loss can be vmapped, else one call per sample. That is the loop's answer for any
loss (any reduction, class weights, ``ignore_index``, a ``.item()`` inside); nothing is
"undone".

An output that no pytree opens and that holds batched tensors (a
``torch.distributions`` object, a key/value cache) has no sample's slice: a loss that
reads it in a sample's evaluation raises ``NeedsWholeModel``, where a ``(B,)`` loss
whose ops keep the samples apart (``dist.log_prob(a)``) is summed as it is, and a loss
that leaves it unread (the logits beside a cache) is evaluated as any other.

A scalar the model computed over the whole batch (``out.loss`` when ``labels`` go
into the model) cannot be split by sample: reading such an output raises
:class:`LossNotPerSampleError`, which says how to write a per-sample loss. Reading
an output whose samples the capture could not locate raises ``NeedsWholeModel``
(``method="auto"`` then takes the whole-model methods) rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.utils._pytree import (
    keystr,
    tree_flatten_with_path,
    tree_unflatten,
)

from .batch import SHARED, Batched, Layout, Mixed, front
from .errors import LossNotPerSampleError, NeedsWholeModel, internal, named_loss
from .inputs import mapped_targets, samples_of
from .patches import solves_broadcast

FIX = """Compute each sample's own loss from the logits and pass the labels as targets, e.g. for a
causal LM:
    def loss_fn(out, labels):  # labels (B, T), -100 where padded
        logits, labels = out.logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1) \\
            / (labels != -100).sum(1)"""


def _refuse(name: str, why: str) -> LossNotPerSampleError:
    return LossNotPerSampleError(
        f"loss_fn reads the model's {name}, in which the samples are mixed: {why}. "
        "Per-sample gradients need each sample's output to depend on that sample alone, "
        "and a loss made of per-sample terms. If that is a loss the model computes over "
        "the whole batch (Hugging Face's out.loss when labels go into the model: a mean "
        f"over every token of every sample cannot be split by sample): {FIX}")


def _unlocated(name: str, why: str) -> NeedsWholeModel:
    return NeedsWholeModel(f"loss_fn reads the model's {name}, whose samples cannot be "
                           f"located: {why}")


class _Unsplittable(Tensor):
    """A model output that cannot be cut by sample (its samples mixed, or not located):
    any op on it raises (``LossNotPerSampleError`` or ``NeedsWholeModel``)."""

    name: str = "?"
    why: str = ""
    mixed: bool = True

    def error(self) -> Exception:
        return (_refuse if self.mixed else _unlocated)(self.name, self.why)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, _Unsplittable):
                raise a.error()
        return super().__torch_function__(func, types, args, kwargs)


def _guarded(output: Any, layout_of: Callable[[Tensor], Layout], n: int) -> Any:
    """``output`` with each tensor whose samples are mixed or not located replaced by a
    stand-in that raises when read. (Packed rows, a sample's positions in any order, are
    read as they are: the loss's own data flow says whether its result is per sample.)"""
    flat, spec = tree_flatten_with_path(output)
    leaves = []
    for path, leaf in flat:
        lay = layout_of(leaf) if isinstance(leaf, Tensor) else SHARED
        if not lay.known:
            stand_in = Tensor._make_subclass(_Unsplittable, leaf.detach())
            stand_in.name = _output_name(path)
            stand_in.why = lay.why
            stand_in.mixed = isinstance(lay, Mixed)
            leaf = stand_in
        leaves.append(leaf)
    return tree_unflatten(leaves, spec)


def _output_name(path: tuple) -> str:
    return f"output{keystr(path)}" if path else "output"


def per_sample_losses(output: Any, targets: Any, loss_fn: Callable, n: int,
                      layout_of: Callable[[Tensor], Layout] | None = None,
                      follow: Callable[[], AbstractContextManager] | None = None,
                      unfollowed: Callable[[], None] | None = None) -> Tensor:
    """``(n,)`` each sample's own loss ``loss_fn(output_i, targets_i)``, in the graph of
    the forward that made ``output`` (its sum is what the backward differentiates).

    ``layout_of`` gives where each tensor holds its samples (the capture's data flow;
    without it every output tensor has them in dim 0, and a ``(n,)`` loss is taken as
    per-sample); ``follow()`` is the context in which the loss's own ops are followed.
    ``unfollowed()`` is called where the losses returned are not the followed call's
    result (a scalar, or a loss evaluated again on each sample's part of the output):
    it raises if that call did what only a followed loss may (read a trainable
    parameter, whose reads the capture then recorded in a graph the result is not in).
    """
    layout_of = layout_of or (lambda t: Batched(0))
    with internal("guarding the model's output"):
        guarded = _guarded(output, layout_of, n)
    if (isinstance(guarded, Tensor) and not isinstance(guarded, _Unsplittable) and n > 1
            and _one_per_row(layout_of(guarded))):  # a torch.nn loss: each sample's, at once
        with named_loss(loss_fn, output, targets):
            stock = stock_per_sample(loss_fn, guarded, targets, n)
        if stock is not None:
            return stock
    with follow() if follow is not None else nullcontext(), named_loss(loss_fn, output,
                                                                       targets):
        loss = loss_fn(guarded, targets)
    if isinstance(loss, _Unsplittable):
        raise loss.error()
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if n == 1 and loss.numel() == 1:  # a batch of one: the loss is that sample's
        if loss.dim() == 0 and unfollowed is not None:  # (a scalar: as for a batch)
            unfollowed()
        return loss.reshape(1)
    if loss.shape == (n,) and _one_per_row(layout_of(loss)):
        return loss
    if loss.dim() != 0 and loss.shape != (n,):
        raise ValueError(
            f"loss_fn returned shape {tuple(loss.shape)}; it must return per-sample losses of "
            f"shape ({n},) or a scalar. For a torch.nn loss, use reduction='none' and reduce "
            "extra dims per sample, or reduction='mean'/'sum'.")
    lay = layout_of(loss)
    return _each_sample(guarded, targets, loss_fn, n, layout_of,
                        getattr(lay, "why", "") if loss.dim() else "", unfollowed)


_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                nn.BCEWithLogitsLoss, nn.SoftMarginLoss)


def stock_per_sample(loss_fn: Callable, output: Tensor, targets: Any, n: int
                     ) -> Tensor | None:
    """``(n,)`` each sample's own loss for a ``torch.nn`` loss with ``reduction="mean"``
    or ``"sum"``, from a copy with ``reduction="none"`` reduced per sample: what
    ``loss_fn(output[i:i+1], targets[i:i+1])`` gives, without ``torch.func`` (whose first
    call costs about half a second). ``None`` where this form is not known exact (class
    weights, label smoothing, probability targets, broadcasting, other losses): the
    caller then evaluates ``loss_fn`` sample by sample.

    Cross-entropy and NLL average over the sample's positions whose target is not
    ``ignore_index`` (``nan`` when there are none, as ``loss_fn`` gives); the
    elementwise losses over the sample's elements.
    """
    kind = type(loss_fn)
    if (getattr(loss_fn, "reduction", None) not in ("mean", "sum") or not isinstance(
            targets, Tensor) or output.dim() == 0 or targets.shape[:1] != (n,)
            or output.shape[0] != n):
        return None
    none = kind.__new__(kind)  # a shallow copy (copy.copy of a module is several times
    none.__dict__.update(vars(loss_fn))  # slower), reducing nothing
    none.reduction = "none"
    if kind in (nn.CrossEntropyLoss, nn.NLLLoss):
        if (loss_fn.weight is not None or getattr(loss_fn, "label_smoothing", 0.0) != 0
                or targets.is_floating_point() or output.dim() < 2):
            return None
        per = none(output, targets).reshape(n, -1)  # (n, positions)
        if loss_fn.reduction == "sum":
            return per.sum(1)
        return per.sum(1) / (targets != loss_fn.ignore_index).reshape(n, -1).sum(1)
    if kind in _ELEMENTWISE:
        if (output.shape != targets.shape or getattr(loss_fn, "weight", None) is not None
                or getattr(loss_fn, "pos_weight", None) is not None):
            return None
        per = none(output, targets).reshape(n, -1)  # (n, elements)
        return per.sum(1) if loss_fn.reduction == "sum" else per.mean(1)
    return None


def _one_per_row(lay: Layout) -> bool:
    return lay == Batched(0)


def _each_sample(guarded: Any, targets: Any, loss_fn: Callable, n: int,
                 layout_of: Callable[[Tensor], Layout], why: str = "",
                 unfollowed: Callable[[], None] | None = None) -> Tensor:
    """``(n,)`` ``loss_fn(output_i, targets_i)``: each sample's outputs as a batch of one
    (merged positions, as ``(B*T, V)`` logits, come out as that sample's ``(T, V)``).

    An output that is an object holding batched tensors (a ``torch.distributions``
    object: no pytree opens it) has no sample's part to give: refused
    (``NeedsWholeModel``), where passing it whole to each sample's call would give
    every sample the loss of the whole batch. ``why``: why the loss's own result was
    not per sample, for that message; ``unfollowed()``: as for
    :func:`per_sample_losses`, called once the output is known to be cut."""
    with internal("cutting the model's output by sample"):
        paths, spec = tree_flatten_with_path(guarded)
        flat = [t for _, t in paths]
        for k, (path, t) in enumerate(paths):
            if not isinstance(t, Tensor) and any(layout_of(h) is not SHARED
                                                 for h in _held_tensors(t)):
                flat[k] = _Uncut(NeedsWholeModel(
                    f"each sample's loss is evaluated on its part of the model's outputs, "
                    f"and the model's {_output_name(path)} is a {type(t).__name__} that "
                    "holds tensors with the samples' data, which persample cannot cut by "
                    "sample (only tensors and what torch.utils._pytree opens: tuples, "
                    "lists, dicts, dataclasses registered with it); return per-sample "
                    f"losses ({n},) computed by ops that keep the samples apart"
                    f"{f' ({why})' if why else ''}"))
                continue
            lay = _layout(t, layout_of)
            if isinstance(lay, Batched) and not lay.sliceable(n):
                raise NeedsWholeModel(
                    f"loss_fn reduces over the samples of the model's {_output_name(path)}, "
                    "whose rows are packed (a sample's rows are not one slice), so each "
                    "sample's loss cannot be evaluated on its own slice; return per-sample "
                    f"losses ({n},) instead")
        cut = [front(t, lay, n) if isinstance(lay := _layout(t, layout_of), Batched) else t
               for t in flat]
        dims = [0 if c is not t else None for c, t in zip(cut, flat)]
    if unfollowed is not None:
        uncut = next((t for t in flat if isinstance(t, _Uncut)), None)
        try:
            unfollowed()
        except ValueError as why:  # (a parameter read where only the whole model's
            if uncut is None:  # methods can say whose it is: theirs, if a part is uncut)
                raise
            raise object.__getattribute__(uncut, "_error") from why
    mapped = mapped_targets(targets)
    if mapped is not None:
        rows, target_dims, one_target = mapped

        def one(flat_i: list, rows_i: list) -> Tensor:
            return loss_fn(tree_unflatten(flat_i, spec), one_target(rows_i)).sum()

        try:
            with solves_broadcast():
                return vmap(one, in_dims=(dims, target_dims))(cut, rows)
        except (LossNotPerSampleError, NeedsWholeModel):
            raise
        except Exception:  # loss_fn cannot be vmapped (.item(), data-dependent code)
            pass
    each = []
    for i in range(n):  # one call per sample, as the loop over samples makes it
        output_i = tree_unflatten([c[i] if d == 0 else c for c, d in zip(cut, dims)], spec)
        targets_i = samples_of(targets, i, i + 1)
        try:
            with named_loss(loss_fn, output_i, targets_i):
                each.append(loss_fn(output_i, targets_i).sum())
        except (LossNotPerSampleError, NeedsWholeModel):
            raise
        except Exception as err:
            raise _as_long_as_the_batch(paths, dims, n, err, layout_of) from err
    return torch.stack(each)


def _as_long_as_the_batch(paths: list, dims: list, n: int, err: Exception,
                          layout_of: Callable[[Tensor], Layout]) -> Exception:
    """``loss_fn``'s error ``err`` on a sample's part of the output, as a refusal
    (:class:`NeedsWholeModel`, which ``method="auto"`` answers by the whole model's
    methods) where a part passed whole holds no sample's data yet is as long as the batch
    in dim 0 (a parameter expanded to the output's shape, ``p.expand_as(mu)``): beside a
    sample's own part of the other outputs its shape is the batch's, where the sample's
    forward alone would have made it a sample's. Else ``err`` itself."""
    found = next((path for (path, t), d in zip(paths, dims) if d is None
                  and isinstance(t, Tensor) and t.dim() and t.shape[0] == n
                  and _layout(t, layout_of) is SHARED), None)
    if found is None:
        return err
    return NeedsWholeModel(
        f"each sample's loss is evaluated on its part of the model's outputs, and the "
        f"model's {_output_name(found)} holds no sample's data (made from parameters "
        f"alone) but is as long as the batch in dim 0, so it went to each sample's loss "
        f"whole, where loss_fn failed on it ({type(err).__name__}: {err}). Return it "
        "without expanding it to the batch (it broadcasts), or return per-sample losses "
        f"({n},); method='auto' takes the whole model's methods")


class _Uncut:
    """In each sample's part of the output, an object that holds the samples' data and
    cannot be cut by sample (a ``torch.distributions`` object, a key/value cache): the
    loss may leave it unread (a cache beside the logits); reading it raises ``error``."""

    __slots__ = ("_error",)

    def __init__(self, error: Exception):
        object.__setattr__(self, "_error", error)

    def __getattr__(self, name: str) -> Any:
        raise object.__getattribute__(self, "_error")

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise object.__getattribute__(self, "_error")

    __getitem__ = __iter__ = __len__ = __bool__ = __call__ = __contains__ = _refuse
    __setattr__ = __eq__ = __lt__ = __float__ = __int__ = __index__ = _refuse

    def __repr__(self) -> str:
        return "<a part of the output persample cannot cut by sample>"

    __hash__ = object.__hash__


def _held_tensors(x: Any, depth: int = 6) -> list[Tensor]:
    """The tensors an object holds in its attributes and their containers, to ``depth``
    (a mixture's component distribution's ``loc``: three deep)."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, Tensor):
            found.append(v)
            return
        if depth == 0 or id(v) in seen or isinstance(
                v, (nn.Module, type, str, bytes, int, float, bool, complex, type(None))):
            return
        seen.add(id(v))
        if isinstance(v, dict):
            items = list(v.values())
        elif isinstance(v, (tuple, list, set, frozenset)):
            items = list(v)
        else:
            try:
                items = list(vars(v).values())
            except TypeError:  # no __dict__ (slots, builtins)
                items = [getattr(v, s, None) for s in getattr(type(v), "__slots__", ())]
        for item in items:
            walk(item, depth - 1)

    walk(x, depth)
    return found


def _layout(t: Any, layout_of: Callable[[Tensor], Layout]) -> Layout:
    if not isinstance(t, Tensor) or isinstance(t, _Unsplittable):
        return SHARED
    return layout_of(t)
