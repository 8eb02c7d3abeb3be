"""Matrix products: the batch stays in rows, columns or broadcast dims; in the
contracted dim it mixes samples.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

import string
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .flow import (
    VALUE_READERS,
    Flow,
    aliases,
    arg,
    mixed,
    name_of,
    op_leaves,
    register,
    worst,
)
from .layouts import SHARED, Batched, Mixed, Unknown
from .ops_indexing import (
    NO_SAMPLE,
    agree,
    followed,
    follows_partly,
    keys_of,
    landed_rows,
    located,
    merge,
    partly,
    samples_along,
    trouble,
)

# ---------------------------------------------------------------------------
# matrix products


def _linear(ctx, func, args, kwargs, out) -> Any:
    """``linear(x, W, b)``: the batch stays where it is unless it is the feature dim."""
    x = arg(args, kwargs, 0, "input")
    w = arg(args, kwargs, 1, "weight", None)
    lay = ctx.layout(x)
    others = [ctx.layout(t) for t in (w, arg(args, kwargs, 2, "bias", None))]
    mixing = next((o for o in [lay, *others] if isinstance(o, Mixed)), None)
    if mixing is not None:  # (inputs of any layout reach it: it carries Partly)
        return mixing
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
register(_matmul, *aliases("bmm", "addmm", "baddbmm", "mv", "addmv", "addmm_", "baddbmm_"))


# ---------------------------------------------------------------------------
# sparse adjacency products: ``sparse_coo_tensor(edge_index, values, (N, N)) @ x``

_ENTRIES = WeakIdKeyDictionary()  # a sparse matrix -> (nnz,) the sample of each entry


def _sparse_coo(ctx, func, args, kwargs, out) -> Any:
    """``sparse_coo_tensor(indices (2, nnz), values (nnz,), size)``: an adjacency built
    in the forward. Each stored entry's sample is that of its index column and its value
    (a graph batch's edges); the matrix's rows hold the samples of the entries stored in
    them (rows of none: :class:`~persample.batch.ops_indexing.Partly`). The entries'
    samples are kept for the product that reads the matrix (:func:`_sparse_product`)."""
    indices, values = arg(args, kwargs, 0, "indices"), arg(args, kwargs, 1, "values")
    if not (isinstance(indices, Tensor) and isinstance(values, Tensor) and isinstance(
            out, Tensor) and out.is_sparse and indices.shape == (2, values.shape[0])
            and values.dim() == 1 and out.dim() == 2):
        return Unknown(f"{name_of(func)} other than a matrix of (2, nnz) indices")
    named = [(t, followed(ctx, t), d) for t, d in ((indices, 1), (values, 0))]
    bad = trouble([lay for _, lay, _ in named])
    if bad is not None:
        return bad
    own = None
    for t, lay, d in named:
        if lay is SHARED:
            continue
        found = samples_along(ctx, t, lay)
        if found is None or found[0] != d:
            return Unknown(f"{name_of(func)} with samples along the indices' rows")
        own = found[1] if own is None else merge(own, found[1])
        if own is None:
            return mixed(func, "pairs one sample's indices with another's values")
    if own is None:
        return SHARED
    _ENTRIES[out] = own
    rows = landed_rows(indices[0].long(), own, out.shape[0])
    if rows is None:
        return mixed(func, "stores several samples' entries in one row")
    return located(0, rows, ctx.n, out, name_of(func))


def _sparse_product(ctx, func, args, kwargs, out) -> Any:
    """``A @ x`` for a sparse ``A (N, M)`` (COO) and a dense ``x (M, F)``: row ``i`` sums
    ``A[i, j] x[j]`` over the entries stored in row ``i``. Every entry must be of the
    sample of the row of ``x`` it reads, where both name one (an adjacency joining two
    graphs mixes them); each row of the result is the sample of its entries."""
    a, x = args[0], args[1]
    if not (isinstance(x, Tensor) and x.dim() == 2 and not x.is_sparse and a.dim() == 2
            and a.layout == torch.sparse_coo):
        return Unknown(f"{name_of(func)} other than a sparse COO matrix times a dense one")
    la, lx = ctx.layout(a), followed(ctx, x)
    bad = trouble([la, lx])  # (a matrix's rows of no entry: located)
    if bad is not None:
        return bad
    indices = a._indices()  # (2, nnz), as stored
    own = _ENTRIES.get(a)
    if (own is None and la is not SHARED) or (own is not None
                                               and own.shape[0] != indices.shape[1]):
        return Unknown(f"{name_of(func)} of a sparse matrix whose entries' samples are "
                       "not known (made by another op than sparse_coo_tensor)")
    if own is None:
        own = torch.full((indices.shape[1],), NO_SAMPLE, dtype=torch.long,
                         device=indices.device)
    if lx is not SHARED:
        found = samples_along(ctx, x, lx)
        if found is None or found[0] != 0:
            return Unknown(f"{name_of(func)} of a dense matrix with samples in its columns")
        own = merge(own, found[1][indices[1]])
        if own is None:
            return mixed(func, "reads with one sample's entries another sample's rows")
    if bool((own < 0).all()):
        return SHARED
    rows = landed_rows(indices[0], own, a.shape[0])
    if rows is None:
        return mixed(func, "sums several samples' entries into one row")
    return located(0, rows, ctx.n, out, name_of(func))


def _products(ctx, func, args, kwargs, out) -> Any:
    """``a @ b``, ``mm``: a sparse ``a`` by :func:`_sparse_product`, else :func:`_matmul`."""
    a = args[0] if args else kwargs.get("input")
    if isinstance(a, Tensor) and a.is_sparse:
        return _sparse_product(ctx, func, args, kwargs, out)
    if partly(ctx, a) is not None and all(
            followed(ctx, t) is SHARED for t in op_leaves(args, kwargs) if t is not a):
        return _partly_matmul(ctx, func, args, kwargs, out)  # (a row of no sample times a
        # shared matrix stays one: RGCNConv's mean per relation, ``h @ weight[i]``)
    bad = worst([ctx.layout(t) for t in op_leaves(args, kwargs)])
    if isinstance(bad, (Mixed, Unknown)):  # (as for any op: a sparse matrix's own layout
        return bad  # says only where its rows' entries are)
    return _matmul(ctx, func, args, kwargs, out)


_partly_matmul = follows_partly(_matmul)
_SPARSE = (*aliases("matmul", "mm", "__matmul__"), torch._C._sparse._sparse_mm)
register(_products, *_SPARSE[:-1])
register(_sparse_product, _SPARSE[-1])
register(_sparse_coo, *aliases("sparse_coo_tensor"))
VALUE_READERS.update(_SPARSE + tuple(aliases("sparse_coo_tensor")))  # (they check their
# operands themselves: a sparse matrix's rows of no entry, a Partly)


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
    if kwargs.get("left", True):
        return _matmul(ctx, torch.matmul, (a, b), {}, out)
    got = _matmul(ctx, torch.matmul, (b, a), {}, out)  # (its pairing in the op's order)
    if isinstance(got, Flow) and got.pairing is not None:
        return Flow(got.outputs, got.pairing[::-1], got.writes)
    return got


register(_solve_triangular, *aliases("solve_triangular", where=(torch.linalg,)))


def _solve(ctx, func, args, kwargs, out) -> Any:
    """``linalg.solve(A, B, left=)``: ``X = A^-1 B`` (``B A^-1`` with ``left=False``)
    carries the samples as :func:`_solve_triangular` does. ``B`` a batch of vectors
    (``B.shape == A.shape[:-1]``, or 1-D), solved as ``B.unsqueeze(-1)``: ``A``'s batch
    dims are ``B``'s leading ones, and ``X`` keeps the samples of either (the same where
    both hold them) where they are in those dims."""
    a, b = arg(args, kwargs, 0, "A"), arg(args, kwargs, 1, "B")
    if b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1]):
        own = {id(a): ctx.layout(a), id(b): ctx.layout(b)}
        held = [lay for lay in own.values() if lay is not SHARED]
        if not held:
            return SHARED
        lay = held[0]
        if not (all(type(h) is Batched and h == lay for h in held) and lay.dim < b.dim() - 1):
            return Unknown(f"{name_of(func)} of a batch of vectors with samples along them, "
                           "or in the matrices")
        # (a shared input as long as the batch along its dim pairs with the samples there)
        paired = {k: o if o is not SHARED else None for k, o in own.items()}
        for t in (a, b):
            if paired[id(t)] is None and t.shape[lay.dim] > 1:
                paired[id(t)] = lay
        return Flow(lay, tuple(paired.get(id(t)) for t in op_leaves(args, kwargs)))
    return _solve_triangular(ctx, func, (a, b), {"left": kwargs.get("left", True)}, out)


register(_solve, *aliases("solve", where=(torch.linalg,)))


def _solve_ex(ctx, func, args, kwargs, out) -> Any:
    """``linalg.solve_ex(A, B, left=)``: ``X`` as :func:`_solve`'s, ``info`` (a code per
    system, ``A`` and ``B``'s batch dims) the samples of ``X``'s batch dims (none where
    the samples are in ``X``'s columns only: ``info`` is ``A``'s then, shared)."""
    a, b = arg(args, kwargs, 0, "A"), arg(args, kwargs, 1, "B")
    got = _solve(ctx, func, (a, b), {"left": kwargs.get("left", True)}, out[0])
    flow = got if isinstance(got, Flow) else Flow(got)
    lay = flow.outputs
    info = (SHARED if lay.dim >= out[1].dim() else lay) if type(lay) is Batched else lay
    return Flow((lay, info), flow.pairing)


register(_solve_ex, *aliases("solve_ex", where=(torch.linalg,)))


def _cholesky_solve(ctx, func, args, kwargs, out) -> Any:
    """``cholesky_solve(B, L, upper=)``: ``X = (L L^T)^-1 B``, the samples carried as by
    ``linalg.solve(L L^T, B)`` (:func:`_solve_triangular`)."""
    b, factor = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "input2")
    got = _solve_triangular(ctx, func, (factor, b), {}, out)
    if isinstance(got, Flow) and got.pairing is not None:
        return Flow(got.outputs, got.pairing[::-1], got.writes)
    return got


register(_cholesky_solve, *aliases("cholesky_solve"))


def _lu_solve(ctx, func, args, kwargs, out) -> Any:
    """``linalg.lu_solve(LU, pivots, B, left=, adjoint=)``: ``X`` carries the samples as
    ``linalg.solve(A, B, left=)`` of the factored ``A`` does (:func:`_solve_triangular`);
    the pivots, ``A``'s, hold them where ``LU`` does (else they mix)."""
    lu, pivots = arg(args, kwargs, 0, "LU"), arg(args, kwargs, 1, "pivots")
    b = arg(args, kwargs, 2, "B")
    if ctx.layout(pivots) != ctx.layout(lu):
        return mixed(func, "solves with pivots of other samples than its factors")
    got = _solve_triangular(ctx, func, (lu, b), {"left": kwargs.get("left", True)}, out)
    if isinstance(got, Flow) and got.pairing is not None:  # (leaves: LU, pivots, B)
        return Flow(got.outputs, (got.pairing[0], got.pairing[0], got.pairing[1]),
                    got.writes)
    return got


register(_lu_solve, *aliases("lu_solve", where=(torch.linalg,)))


def _matrix_function(ctx, func, args, kwargs, out) -> Any:
    """``linalg.matrix_exp(A)``: a function of each matrix in the last two dims; samples
    in the leading dims stay apart, in the matrix dims they mix."""
    a = arg(args, kwargs, 0, "input")
    lay = ctx.layout(a)
    if isinstance(lay, Batched) and lay.dim >= a.dim() - 2:
        return mixed(func, "is a function of a matrix the samples are in")
    return lay


register(_matrix_function, *aliases("matrix_exp"))


def _householder(ctx, func, args, kwargs, out) -> Any:
    """``linalg.householder_product(A, tau)``: the product of each matrix's reflectors;
    samples in the leading dims of both stay apart, in the matrix dims they mix; one of
    them holding samples and the other not is not followed (its leading dims are the
    other's, so a shared one is as long as the batch)."""
    a, tau = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "tau")
    la, lt = ctx.layout(a), ctx.layout(tau)
    if la is SHARED and lt is SHARED:
        return SHARED
    if isinstance(la, Batched) and la.dim >= a.dim() - 2 or (
            isinstance(lt, Batched) and lt.dim >= tau.dim() - 1):
        return mixed(func, "is a product of reflectors the samples are in")
    if la != lt:
        return Unknown(f"{name_of(func)} of reflectors holding samples with scales that "
                       "do not")
    return la


register(_householder, *aliases("householder_product", "orgqr"))


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
