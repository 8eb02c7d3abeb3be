"""Per-sample gradients of parameters used directly in a forward, op by op ("taps").

A class token, a positional embedding, a learnable scale or a tied weight read
with ``F.linear`` in a parent's ``forward`` belong to no layer rule. Instead of
differentiating the parent's whole forward per sample, the capture follows each
such parameter through the ops that read it:

- an op whose inputs are the parameter (or batch-free functions of it, such as
  ``pos[:, :T]`` or ``W.t()``) and other batch-free tensors gives a batch-free
  *derived* tensor, remembered with the op so it can be replayed;
- the first op on each path whose output has the batch in dim 0
  (``x + pos``, ``cls.expand(B, -1, -1)``, ``h @ W.t()``) is a *tap*: the main
  backward also returns the backprops of its output, and the parameter's
  per-sample gradient is the sum over taps of the per-sample vector-Jacobian
  products of that one op (replaying its derived inputs), batched with
  ``torch.func.vmap`` over the samples (the fallback of seed 001, on one op).

A parameter read in a way the taps cannot follow (an op that merges the batch
into another dim, a sequence-first layout) is *untraceable* and keeps the
per-call fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layout import batch_first


@dataclass
class Op:
    """One recorded op: ``output = func(*args, **kwargs)``."""

    func: Any
    args: tuple
    kwargs: dict
    output: Any
    index: int | None = None  # which element of a tuple output
    stack: tuple = ()  # the module calls under way (capture.Call), outermost first


@dataclass
class Tracer:
    """Follows watched parameters through the ops of one forward (see module docstring)."""

    watched: set[int]
    n: int
    derived: dict[int, tuple[Tensor, set[int], Op]] = field(default_factory=dict)
    taps: dict[int, list[Op]] = field(default_factory=dict)  # id(param) -> taps
    untraceable: set[int] = field(default_factory=set)
    # id(tap output) -> (tensor, version) of its output and non-source inputs
    versions: dict[int, list[tuple[Tensor, int]]] = field(default_factory=dict)

    def sources(self, leaves: list) -> set[int]:
        """The watched parameters an op reads, directly or through derived tensors."""
        pids: set[int] = set()
        for leaf in leaves:
            if isinstance(leaf, nn.Parameter) and id(leaf) in self.watched:
                pids.add(id(leaf))
            elif isinstance(leaf, Tensor) and self._derived(leaf) is not None:
                pids |= self.derived[id(leaf)][1]
        return pids

    def _derived(self, t: Tensor) -> tuple | None:
        entry = self.derived.get(id(t))
        return entry if entry is not None and entry[0] is t else None

    def record(self, func, args: tuple, kwargs: dict, output: Any, leaves: list,
               pids: set[int], stack: tuple) -> None:
        """Classify one op reading ``pids``: derived, tap, or untraceable."""
        others = [t for t in leaves if isinstance(t, Tensor) and not self._is_source(t)]
        n = self.n
        outs = [output] if isinstance(output, Tensor) else (
            list(output) if isinstance(output, (tuple, list)) else [])
        if not outs or not all(isinstance(o, Tensor) for o in outs):
            return  # .shape, .dtype, ...: no data flows on
        if not any(o.requires_grad for o in outs):  # no_grad, or inside an autograd.Function
            self.untraceable |= pids  # whose own backward the taps would not know
            return
        if _in_place(func, kwargs):  # replaying it would write into the captured tensors
            self.untraceable |= pids
            return
        sequence_first = any(batch_first(c.module) is False for c in stack)
        if sequence_first or any(n in t.shape and (t.dim() == 0 or t.shape[0] != n)
                                 for t in others):
            self.untraceable |= pids  # the batch is not (only) in dim 0 somewhere
        elif _others_batched(others, n):  # x + pos, h @ W.t(), cat([cls_b, h], 1)
            if isinstance(output, Tensor) and output.dim() > 0 and output.shape[0] == n:
                self._tap(Op(func, args, kwargs, output, None, stack), pids, others)
            else:
                self.untraceable |= pids  # the op merges or drops the batch dim
        elif isinstance(output, Tensor) and output.dim() > 0 and output.shape[0] == n \
                and output.stride(0) == 0:  # broadcast to the batch: cls.expand(B, -1, -1)
            self._tap(Op(func, args, kwargs, output, None, stack), pids, others)
        else:  # batch-free: pos[:, :T], W.t(), w.sum(0) (whatever its size)
            for k, o in enumerate(outs):
                index = None if isinstance(output, Tensor) else k
                self.derived[id(o)] = (o, pids, Op(func, args, kwargs, output, index))

    def _tap(self, op: Op, pids: set[int], others: list[Tensor]) -> None:
        for pid in pids:
            self.taps.setdefault(pid, []).append(op)
        self.versions[id(op.output)] = [(t, t._version) for t in [op.output, *others]]

    def taps_in(self, pid: int, call: Any) -> list[Op] | None:
        """The taps of a parameter if it is traceable, restricted to those inside ``call``."""
        if pid in self.untraceable or pid not in self.taps:
            return None
        return [op for op in self.taps[pid] if any(c is call for c in op.stack)] or None

    def _is_source(self, t: Tensor) -> bool:
        return (isinstance(t, nn.Parameter) and id(t) in self.watched) or (
            self._derived(t) is not None)

    def changed(self, op: Op) -> bool:
        """Was a tap's output or batched input modified in place after it ran?"""
        return any(t._version != version for t, version in self.versions[id(op.output)])

    # -- per-sample gradients -------------------------------------------------

    def replay(self, leaf: Any, param: nn.Parameter, value: Tensor) -> Any:
        """``leaf`` as a function of ``value`` standing for ``param``."""
        if leaf is param:
            return value
        if isinstance(leaf, Tensor):
            entry = self._derived(leaf)
            if entry is not None and id(param) in entry[1]:
                op = entry[2]
                out = self.run(op, param, value)
                return out if op.index is None else out[op.index]
            return leaf.detach()
        return leaf

    def run(self, op: Op, param: nn.Parameter, value: Tensor, rows: dict | None = None) -> Any:
        """Re-run ``op`` with ``param`` replaced by ``value`` (and batched inputs by ``rows``)."""
        leaves, spec = tree_flatten((op.args, op.kwargs))
        rows = rows or {}
        values = [rows[k] if k in rows else self.replay(leaf, param, value)
                  for k, leaf in enumerate(leaves)]
        args, kwargs = tree_unflatten(values, spec)
        return op.func(*args, **kwargs)

    def tap_grads(self, op: Op, param: nn.Parameter, backprops: Tensor) -> Tensor:
        """``(n, v, *param.shape)``: per-sample VJPs of one tap with ``(n, v, *out)`` backprops."""
        leaves, _ = tree_flatten((op.args, op.kwargs))
        mapped = {k: leaf.detach() for k, leaf in enumerate(leaves)
                  if isinstance(leaf, Tensor) and not self._is_source(leaf)
                  and leaf.dim() > 0 and leaf.shape[0] == self.n}
        keys = list(mapped)

        def one_sample(rows_i: list[Tensor], index: Tensor, cot_i: Tensor) -> Tensor:
            rows = {k: r.unsqueeze(0) for k, r in zip(keys, rows_i)}

            def f(value: Tensor) -> Tensor:
                out = self.run(op, param, value, rows)  # (1, ...) or (n, ...)
                return out if out.shape[0] == 1 else out.index_select(0, index.reshape(1))

            _, pull = vjp(f, param.detach())
            return vmap(lambda c: pull(c.unsqueeze(0))[0])(cot_i)  # (v, *param.shape)

        index = torch.arange(self.n, device=backprops.device)
        return vmap(one_sample)([mapped[k] for k in keys], index, backprops)


def _in_place(func: Any, kwargs: dict) -> bool:
    """``x.add_(p)``, ``x += p``, ``torch.add(x, p, out=y)``."""
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__"))


def _others_batched(others: list[Tensor], n: int) -> bool:
    return any(t.dim() > 0 and t.shape[0] == n for t in others)
