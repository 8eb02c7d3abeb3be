"""Matrix products: the batch stays in rows, columns or broadcast dims; in the
contracted dim it mixes samples.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

import string
from typing import Any

import torch
from torch import Tensor

from .flow import (
    VALUE_READERS,
    Flow,
    aliases,
    arg,
    mixed,
    name_of,
    op_leaves,
    register,
)
from .layouts import SHARED, Batched, Unknown
from .ops_indexing import agree, follows_partly, keys_of

# ---------------------------------------------------------------------------
# matrix products


def _linear(ctx, func, args, kwargs, out) -> Any:
    """``linear(x, W, b)``: the batch stays where it is unless it is the feature dim."""
    x = arg(args, kwargs, 0, "input")
    w = arg(args, kwargs, 1, "weight", None)
    lay = ctx.layout(x)
    others = [ctx.layout(t) for t in (w, arg(args, kwargs, 2, "bias", None))]
    if any(o is not SHARED for o in others):
        return Unknown(f"{name_of(func)} with a per-sample weight")
    if isinstance(lay, Batched) and lay.dim == x.dim() - 1:
        return mixed(func, "contracts the batch dim")
    return lay


register(follows_partly(_linear), *aliases("linear"))
VALUE_READERS.update(aliases("linear"))  # (carries Partly: a row of no sample stays one)


def _matmul(ctx, func, args, kwargs, out) -> Any:
    """``a @ b`` with broadcasting batch dims: a batch in ``a``'s rows or ``b``'s columns
    or a broadcast dim stays; in the contracted dim it mixes samples. A shared operand of
    full size in the batch's broadcast dim is paired with the samples
    (DeBERTa's relative keys repeated to ``(B*H, ...)``)."""
    if func in _ADDMM:  # addmm(input, mat1, mat2), baddbmm(input, batch1, batch2), addmv
        names = _OPERANDS.get(getattr(func, "__name__", ""), ("mat1", "mat2"))
        a, b = arg(args, kwargs, 1, names[0]), arg(args, kwargs, 2, names[1])
        bias_in = arg(args, kwargs, 0, "input")
    else:
        a = arg(args, kwargs, 0, "input")
        b = args[1] if len(args) > 1 else next(kwargs[k] for k in ("other", "mat2", "vec")
                                               if k in kwargs)
    la, lb = ctx.layout(a), ctx.layout(b)
    rank = out.dim()
    place = []
    for t, lay, side in ((a, la, "a"), (b, lb, "b")):
        if not isinstance(lay, Batched):
            continue
        r = t.dim()
        if r == 1:
            return mixed(func, "contracts the batch dim")
        if side == "a":
            if lay.dim == r - 1:
                return mixed(func, "contracts the batch dim")
            d = rank - 1 - (1 if b.dim() > 1 else 0) if lay.dim == r - 2 else (
                lay.dim + rank - r)
        else:
            if lay.dim == r - 2:
                return mixed(func, "contracts the batch dim")
            d = rank - 1 if lay.dim == r - 1 else lay.dim + rank - r
        if lay.dim < r - 2 and t.shape[lay.dim] != out.shape[d]:
            return mixed(func, "spreads one sample's data over others")
        place.append(lay.moved(d))
    if len(place) == 2 and place[0] != place[1]:
        same = agree(place[0], place[1], out.shape[place[0].dim], ctx.n)
        place = [same] if same is not None else place
    if len(place) == 2 and place[0] != place[1]:
        return mixed(func, "pairs samples of its two operands")
    found = place[0] if place else SHARED
    if func in _ADDMM:
        bias = ctx.layout(bias_in)
        if isinstance(bias, Batched) and (not isinstance(found, Batched) or agree(
                bias.moved(bias.dim + rank - bias_in.dim()), found, out.shape[found.dim],
                ctx.n) is None):
            return mixed(func, "adds samples from different dims")
    if not isinstance(found, Batched) or found.dim >= rank - 2:
        return found
    pairing = []
    for t in op_leaves(args, kwargs):
        own = ctx.layout(t)
        d = found.dim - (rank - t.dim())
        if own is not SHARED:
            pairing.append(own)
        elif 0 <= d < t.dim() - 2 and t.shape[d] == out.shape[found.dim] > 1:
            pairing.append(found.moved(d))
        else:
            pairing.append(None)
    return Flow(found, tuple(pairing))


_ADDMM = set(aliases("addmm", "baddbmm", "addmm_", "baddbmm_", "addmv"))
_OPERANDS = {"baddbmm": ("batch1", "batch2"), "baddbmm_": ("batch1", "batch2"),
             "addmv": ("mat", "vec")}
register(_matmul, *aliases("matmul", "mm", "bmm", "__matmul__", "addmm", "baddbmm", "mv",
                             "addmv", "addmm_", "baddbmm_"))


def _rmatmul(ctx, func, args, kwargs, out) -> Any:
    return _matmul(ctx, torch.matmul, (args[1], args[0]), {}, out)


register(_rmatmul, torch.Tensor.__rmatmul__)


def _solve_triangular(ctx, func, args, kwargs, out) -> Any:
    """``linalg.solve_triangular(A, B, upper=, left=)`` (gated DeltaNet's chunks):
    ``X = A^-1 B`` (``B A^-1`` with ``left=False``) carries the samples as the product
    with ``A^-1`` does; samples in ``A``'s matrix dims mix (the inverse mixes them)."""
    a, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "B")
    la = ctx.layout(a)
    if isinstance(la, Batched) and la.dim >= a.dim() - 2:
        return mixed(func, "inverts a matrix the samples are in")
    left = kwargs.get("left", True)
    return _matmul(ctx, torch.matmul, (a, b) if left else (b, a), {}, out)


register(_solve_triangular, *aliases("solve_triangular", where=(torch.linalg,)))


def einsum_subscripts(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Each operand's subscripts and the output's, ``...`` spelled out as capitals not in
    the equation (aligned at the right end, as einsum broadcasts them), an implicit
    output made explicit (the letters seen once, sorted, after the ellipsis).

    Raises:
        ValueError: terms that do not match the operands or their ranks.

    Examples:
        >>> einsum_subscripts("...i,io", [3, 2])
        (['ABi', 'io'], 'ABo')
    """
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError("an equation whose terms do not match the operands")
    spare = [c for c in string.ascii_uppercase if c not in equation]
    extra = [r - (len(t) - 3) for t, r in zip(terms, ranks) if "..." in t]
    widest = max(extra, default=0)
    ellipsis = "".join(spare[:widest])
    subs = [t.replace("...", ellipsis[widest - (r - (len(t) - 3)):]) if "..." in t else t
            for t, r in zip(terms, ranks)]
    if not arrow:
        joined = "".join(subs)
        rhs = ellipsis + "".join(sorted(c for c in set(joined) if joined.count(c) == 1
                                        and c not in ellipsis))
    out = rhs.replace("...", ellipsis)
    if any(len(t) != r for t, r in zip(subs, ranks)):
        raise ValueError("subscripts that do not match an operand's rank")
    return subs, out


def _einsum(ctx, func, args, kwargs, out) -> Any:
    """``einsum``: the batch's letter, if the output keeps it."""
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if not isinstance(args[0], str):
        return Unknown("einsum in its sublist form")
    try:
        inputs, output = einsum_subscripts(args[0], [t.dim() for t in operands])
    except ValueError as err:
        return Unknown(f"einsum: {err}")
    found = None
    for spec, t in zip(inputs, operands):
        lay = ctx.layout(t)
        if not isinstance(lay, Batched):
            continue
        letter = spec[lay.dim]
        if letter not in output:
            return mixed(func, "sums over the batch")
        if spec.count(letter) != 1:
            return mixed(func, "takes a diagonal along the batch")
        here = lay.moved(output.index(letter))
        if found is not None and found != here:
            return mixed(func, "pairs samples of its operands")
        found = here
    if found is None:
        return SHARED
    # a shared operand indexed by the samples' letter (XLNet's segment matrix, made as
    # long as the batch) is paired with them one to one, as the letter's dims are
    letter = output[found.dim]
    pairing = []
    for spec, t in zip(inputs, operands):
        lay = ctx.layout(t)
        if isinstance(lay, Batched):
            pairing.append(lay)
        elif letter in spec and t.shape[spec.index(letter)] != 1:
            if spec.count(letter) != 1 or not found.plain:
                return mixed(func, "reads a shared operand along the batch")
            pairing.append(Batched(spec.index(letter)))
        else:
            pairing.append(None)
    if all(p is None or ctx.layout(t) is p for p, t in zip(pairing, operands)):
        return found
    return Flow(found, tuple(pairing))


register(_einsum, *aliases("einsum"))


def _bilinear(ctx, func, args, kwargs, out) -> Any:
    l1, l2 = ctx.layout(args[0]), ctx.layout(args[1])
    found = [lay for lay in (l1, l2) if isinstance(lay, Batched)]
    if any(lay.dim == args[0].dim() - 1 for lay in found):
        return mixed(func, "contracts the batch dim")
    if len(found) == 2 and found[0] != found[1]:
        return mixed(func, "pairs samples of its operands")
    return found[0]


register(_bilinear, *aliases("bilinear"))


def _grouped_mm(ctx, func, args, kwargs, out) -> Any:
    """``grouped_mm(x (S, K), W (G, K, N), offs=)`` (a mixture's experts, each on its
    run of rows): row ``r`` is ``x_r @ W[g(r)]``, ``g(r)`` the run ``offs`` puts it in.
    The rows keep their samples where each row's run is its own sort key (the rows sorted
    by expert, ``offs`` the cumulative counts of the keys over the batch): then which
    weights a row meets depends on that row's own routing alone. Any other grouping, or
    rows past the last run, is not followed."""
    a, b = arg(args, kwargs, 0, "mat_a"), arg(args, kwargs, 1, "mat_b")
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    la, lb = ctx.layout(a), ctx.layout(b)
    if lb is not SHARED or a.dim() != 2 or b.dim() != 3 or not isinstance(offs, Tensor):
        return Unknown(f"{name_of(func)} other than per-sample rows times shared groups")
    if la is SHARED:
        return SHARED
    if not isinstance(la, Batched) or la.dim != 0:
        return la if not la.known else Unknown(f"{name_of(func)} of rows by another dim")
    keys = keys_of(la)
    rows = torch.arange(a.shape[0], device=offs.device)
    if keys is None or int(offs[-1]) != a.shape[0] or not torch.equal(
            torch.searchsorted(offs.long(), rows, right=True), keys.long().to(offs.device)):
        return mixed(func, "groups rows by offsets that are not each row's own sort key")
    return la


register(_grouped_mm, *[f for f in (getattr(torch, "_grouped_mm", None),
                                    getattr(torch.nn.functional, "grouped_mm", None)) if f])
VALUE_READERS.update(f for f in (getattr(torch, "_grouped_mm", None),
                                 getattr(torch.nn.functional, "grouped_mm", None)) if f)


def _counts(ctx, func, args, kwargs, out) -> Any:
    """``histc``/``bincount`` of values from several samples: counts over the batch."""
    return mixed(func, "counts values over the batch")


register(_counts, *aliases("histc", "bincount"))
