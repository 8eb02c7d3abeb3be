"""Per-sample gradients of linear maps: ``F.linear``, ``torch.addmm`` (GPT-2's
``Conv1D``), ``matmul``/``mm``/``@`` with a parameter operand, ``F.bilinear``.

Index conventions: ``n`` sample, ``v`` cotangent (1 for a loss gradient; the
output index for a parameter Jacobian), ``t`` position inside a sample (all dims
of the per-sample input but the features, flattened: a sequence, the rows of a
``(B*T, E)`` reshape that belong to one sample, windows), ``i`` input feature,
``o`` output feature.

Goodfellow (2015), "Efficient per-example gradient computations":
``grad_W[n, v] = sum_t g[n, v, t, :] outer a[n, t, :]`` and
``grad_b[n, v] = sum_t g[n, v, t, :]``. An activation shared by all samples (a
derived parameter's input) broadcasts: ``grad_W[n, v] = g[n, v]^T a``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .calls import OpCall, write_reduced
from .ghost import Factors
from .outer import add_product, ghost_norm, sum_outer_into
from .spec import Decline, OpSpec, register


def as_rows(call: OpCall, x: Tensor, features: int) -> Tensor:
    """An input as ``(n, t, features)``, or ``(t, features)`` when shared."""
    a = call.front(x)
    return a.reshape(-1, features) if call.shared(x) else a.reshape(a.shape[0], -1, features)


def _expanded(call: OpCall, x: Tensor, features: int, n: int) -> Tensor:
    """An input as ``(n, t, features)``, a shared one expanded to the samples."""
    a = as_rows(call, x, features)
    return a.expand(n, *a.shape) if call.shared(x) else a


def _scaled_smaller(a: Tensor, g: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``a (n, t, i)``, ``g (n, t, o)`` with the one of fewer features times ``c (n,)``."""
    c = c.view(-1, 1, 1)
    return (a * c, g) if a.shape[2] <= g.shape[2] else (a, g * c)


def _one_entry(b: Tensor, o: int) -> bool:
    """Is the bias one entry broadcast over the ``o`` outputs (0-dim, or ``(1,)`` beside
    ``o > 1``: a learned offset), rather than a vector of the outputs? Any other shape is
    declined (:func:`_check_bias`)."""
    return tuple(b.shape) != (o,)


def _check_bias(b: Tensor | None, o: int) -> None:
    """Decline a bias (``None``: none wanted) that is neither ``(o,)`` nor one entry."""
    if b is not None and tuple(b.shape) != (o,) and b.numel() != 1:
        raise Decline("a bias that is neither a vector of the outputs nor one entry")


def _bias_rows(gt: Tensor, b: Tensor, o: int) -> Tensor:
    """A bias's per-sample gradient from backprops ``gt (n, t, o)``: ``sum_t g_t (n, o)``,
    or for one entry (:func:`_one_entry`) also summed over the outputs, ``(n, 1)``."""
    if _one_entry(b, o):
        return gt.sum((1, 2)).unsqueeze(1)
    return gt[:, 0] if gt.shape[1] == 1 else gt.sum(1)  # (one position: a view)


def _bias_factors(gt: Tensor, b: Tensor, o: int) -> Factors:
    """A bias's gradient ``sum_t g_t``: ``g_t outer 1`` (for one entry, the outputs'
    sum: a ``(1, 1)`` matrix, as ``matrix_shape`` sees a 0-dim parameter)."""
    left = gt.sum(2, keepdim=True) if _one_entry(b, o) else gt  # (n, t, o or 1)
    return Factors(left, gt.new_ones(*gt.shape[:2], 1))


# ---------------------------------------------------------------------------
# F.linear: y = x W^T + b


def linear(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``y = x W^T + b``: ``W (o, i)`` gets ``sum_t g^T x``, ``b (o,)`` gets ``sum_t g``;
    a derived input ``x`` (computed from parameters, with or without the samples' pairing)
    its cotangent ``g W``."""
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    call.only(out, x, w, b)
    if not call.shared(w) or (b is not None and not call.shared(b)):
        raise Decline("a weight paired with the samples")
    if (w in out or x in out) and w.dim() != 2:
        raise Decline("a 1-d weight")
    if x in out:  # a derived input (a learned query, an initial state): g W
        out[x].copy_(torch.matmul(g, call.front(w)).view(out[x].shape))
    n, v = g.shape[:2]
    o, i = w.shape if w.dim() == 2 else (1, w.shape[0])
    _check_bias(b if b in out else None, o)
    gt = g.reshape(n, v, -1, o)  # (n, v, t, o)
    if w in out:
        sum_outer_into(gt, as_rows(call, x, i), out[w])  # (n, v, o, i)
    if b is not None and b in out:
        if _one_entry(b, o):  # (0-dim or (1,): the outputs' sum too)
            out[b].view(n, v).copy_(gt.sum((2, 3)))
        else:
            torch.sum(gt, dim=2, out=out[b])  # (n, v, o)


def linear_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Tensor]:
    """Squared per-sample gradient norms without the gradients ("ghost norm").

    ``T = 1``: ``|grad_W[n]|^2 = |a_n|^2 |g_n|^2``. ``T > 1``:
    ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` costs ``n T^2 (i + o)`` against ``n T i o``
    for materialising; the cheaper one is taken (Goodfellow 2015; Lee & Kifer 2021;
    Li et al. 2022).
    """
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    if call.shared(x) or w.dim() != 2:
        raise Decline("a shared input, or a 1-d weight")
    o, i = w.shape
    _check_bias(b if b in wanted else None, o)
    return _ghost_norms(call, x, g.reshape(g.shape[0], -1, o), w, b, wanted, i)


def _ghost_norms(call: OpCall, x: Tensor, gt: Tensor, w: Tensor, b: Tensor | None,
                 wanted: set[Tensor], i: int) -> dict[Tensor, Tensor]:
    """``{w, b: (n,)}`` squared per-sample norms (those ``wanted``) of a linear map's
    weight and bias from its input ``x`` (``i`` features) and backprops ``gt (n, t, o)``.
    At one position a vector bias's, ``|g_n|^2``, is the factor the weight's ``|a_n|^2
    |g_n|^2`` has: computed once."""
    o, found = gt.shape[2], {}
    vector = b is not None and b in wanted and not _one_entry(b, o)
    one = gt.shape[1] == 1 and (vector or w in wanted)
    g_sq = gt.square().sum((1, 2)) if one else None  # (n,) at one position
    if w in wanted:
        a = as_rows(call, x, i)  # (n, t, i)
        found[w] = a.square().sum((1, 2)) * g_sq if one else ghost_norm(a, gt)
        if found[w] is None:
            raise Decline("materialising is cheaper")
    if b is not None and b in wanted:
        found[b] = g_sq if one and vector else _bias_rows(gt, b, o).square().sum(1)
    return found


def linear_sum(call: OpCall, g: Tensor, c: Tensor, into: dict[Tensor, Tensor]) -> None:
    """Adds ``sum_n c_n grad_n`` for backprops ``g (n, 1, *out)`` and factors ``c (n,)``:
    ``W (o, i)`` gets ``g^T (c x)`` over samples and positions (one GEMM, the factors on
    the smaller operand), ``b`` ``c^T sum_t g``."""
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    if call.shared(x) or w.dim() != 2:
        raise Decline("a shared input, or a 1-d weight")
    o, i = w.shape
    _check_bias(b if b in into else None, o)
    gt = g.reshape(g.shape[0], -1, o)  # (n, t, o)
    if w in into:
        a, gw = _scaled_smaller(as_rows(call, x, i), gt, c)
        add_product(into[w], gw.reshape(-1, o).T, a.reshape(-1, i))  # (o, n*t) @ (n*t, i)
    if b is not None and b in into:
        into[b].add_((c @ _bias_rows(gt, b, o)).view(b.shape))  # (n,) @ (n, o or 1)


def linear_factors(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Factors]:
    """``W (o, i)``: ``L = g``, ``R = x``; ``b``: ``L = g``, ``R = 1``."""
    x, w, b = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    if w.dim() != 2 or not call.shared(w) or (b is not None and not call.shared(b)):
        raise Decline("a 1-d weight, or a weight paired with the samples")
    o, i = w.shape
    _check_bias(b if b in wanted else None, o)
    gt = g.reshape(g.shape[0], -1, o)  # (n, t, o)
    found = {}
    if w in wanted:
        found[w] = Factors(gt, _expanded(call, x, i, gt.shape[0]))
    if b is not None and b in wanted:
        found[b] = _bias_factors(gt, b, o)
    return found


# ---------------------------------------------------------------------------
# torch.addmm: y = beta * b + alpha * x @ W (GPT-2's Conv1D)


def _addmm_args(call: OpCall) -> tuple:
    """``(b, x, W, beta, alpha)`` of ``torch.addmm(b, x, W, beta=, alpha=)``."""
    return (call.arg(0, "input"), call.arg(1, "mat1"), call.arg(2, "mat2"),
            call.kwargs.get("beta", 1), call.kwargs.get("alpha", 1))


def addmm(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``y = beta * b + alpha * x @ W`` (GPT-2's ``Conv1D``: ``W (i, o)``, rows of
    ``(B*T, i)``): ``W`` gets ``alpha * sum_t x^T g``, ``b`` ``beta * sum_t g``."""
    b, x, w, beta, alpha = _addmm_args(call)
    call.only(out, b, w)
    if any(t in out and not call.shared(t) for t in (b, w)):
        raise Decline("a paired operand is a parameter")
    n, v = g.shape[:2]
    i, o = w.shape
    if b in out and b.dim() > 1:
        raise Decline("a bias with rows")
    _check_bias(b if b in out else None, o)
    gt = g.reshape(n, v, -1, o)  # (n, v, t, o)
    if w in out:
        dst = out[w].transpose(2, 3)  # (n, v, o, i) view of (n, v, i, o)
        sum_outer_into(gt if alpha == 1 else gt * alpha, as_rows(call, x, i), dst)
    if b in out:
        if _one_entry(b, o):  # (0-dim or (1,): the outputs' sum too)
            out[b].view(n, v).copy_(gt.sum((2, 3)))
        else:
            torch.sum(gt, dim=2, out=out[b])
        if beta != 1:
            out[b].mul_(beta)


def addmm_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Tensor]:
    """The ghost norms of :func:`linear_norm`, times ``alpha^2`` and ``beta^2``."""
    b, x, w, beta, alpha = _addmm_args(call)
    if call.shared(x) or b.dim() > 1:
        raise Decline("a shared input, or a bias with rows")
    i, o = w.shape
    _check_bias(b if b in wanted else None, o)
    found = _ghost_norms(call, x, g.reshape(g.shape[0], -1, o), w, b, wanted, i)
    for t, scale in ((w, alpha), (b, beta)):
        if t in found and scale != 1:
            found[t] = found[t] * scale**2
    return found


def addmm_sum(call: OpCall, g: Tensor, c: Tensor, into: dict[Tensor, Tensor]) -> None:
    """``beta * b + alpha * x @ W``: ``W (i, o)`` gets ``alpha (c x)^T g``, ``b``
    ``beta c^T sum_t g``."""
    b, x, w, beta, alpha = _addmm_args(call)
    if call.shared(x) or b.dim() > 1:
        raise Decline("a shared input, or a bias with rows")
    i, o = w.shape
    _check_bias(b if b in into else None, o)
    gt = g.reshape(g.shape[0], -1, o)  # (n, t, o)
    if w in into:
        a, gw = _scaled_smaller(as_rows(call, x, i), gt, c)
        add_product(into[w], a.reshape(-1, i).T, gw.reshape(-1, o), alpha)  # (i, o)
    if b in into:
        into[b].add_((c @ _bias_rows(gt, b, o)).view(b.shape), alpha=beta)


def addmm_factors(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Factors]:
    """``W (i, o)``: ``L = x``, ``R = alpha g``; ``b``: ``L = beta g``, ``R = 1``."""
    b, x, w, beta, alpha = _addmm_args(call)
    if b.dim() > 1 or not call.shared(w) or not call.shared(b) or x in wanted:
        raise Decline("a bias with rows, a paired operand, or the first matrix wanted")
    i, o = w.shape
    _check_bias(b if b in wanted else None, o)
    gt = g.reshape(g.shape[0], -1, o)  # (n, t, o)
    found = {}
    if w in wanted:
        found[w] = Factors(_expanded(call, x, i, gt.shape[0]), gt if alpha == 1 else gt * alpha,
                           "right")
    if b in wanted:
        found[b] = _bias_factors(gt if beta == 1 else gt * beta, b, o)
    return found


# ---------------------------------------------------------------------------
# matmul, mm, bmm, @: y = A @ B


def _operands(call: OpCall) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of ``A @ B`` in any of the matmul spellings (``__rmatmul__`` swaps)."""
    if call.func.__name__ == "__rmatmul__":
        return call.args[1], call.args[0]
    return call.arg(0, "input"), call.kwargs.get("mat2", call.arg(1, "other"))


def matmul(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``y = A @ B`` with one operand a (shared) matrix parameter: ``x @ W`` gives
    ``W`` ``sum_t x^T g``; ``W @ x`` gives ``W`` ``sum g x^T`` over the other dims."""
    a, b = _operands(call)
    n, v = g.shape[:2]
    if b in out and a not in out and call.shared(b) and b.dim() == 2:
        k, p = b.shape
        gt = g.reshape(n, v, -1, p)  # (n, v, t, p)
        sum_outer_into(gt, as_rows(call, a, k), out[b].transpose(2, 3))  # (n, v, p, k)
    elif a in out and b not in out and call.shared(a) and a.dim() == 2 and b.dim() >= 2:
        m, k = a.shape
        bx = call.front(b)  # (n, *lead, k, p) or shared (*lead, k, p)
        # grad A = sum over lead and columns of g (m, p) x^T (p, k)
        gm = g.reshape(n, v, -1, m, g.shape[-1]).transpose(3, 4).reshape(n, v, -1, m)
        xs = bx.transpose(-1, -2).reshape(-1, k) if call.shared(b) else (
            bx.transpose(-1, -2).reshape(n, -1, k))  # (n, t, k) with t = lead * p
        sum_outer_into(gm, xs, out[a])  # (n, v, m, k)
    elif call.shared(a) or call.shared(b):
        _broadcast_product(call, a, b, g, out)
    else:
        _paired(call, a, b, g, out)


def _broadcast_product(call: OpCall, a: Tensor, b: Tensor, g: Tensor, out: dict) -> None:
    """Any operand asked for, at least one of them shared (a parameter with dims of its
    own beside the matrices, RG-LRU's ``(heads, k, p)`` gates; a derived operand): each
    sample's product ``A_n @ B_n`` broadcast as the op did, ``grad A_n = g B_n^T`` and
    ``grad B_n = A_n^T g`` summed over the dims broadcasting added."""
    if a.dim() < 2 or b.dim() < 2:
        raise Decline("a vector operand")
    fa, fb = call.front(a), call.front(b)  # (n, *per_sample) or shared
    sa, sb = (f if call.shared(t) else f[0] for t, f in ((a, fa), (b, fb)))  # one sample's
    if sa.shape[-1] != sb.shape[-2]:
        raise Decline("the samples in a contracted dim")
    lead = torch.broadcast_shapes(sa.shape[:-2], sb.shape[:-2])
    if (*lead, sa.shape[-2], sb.shape[-1]) != tuple(g.shape[2:]):
        raise Decline("a product whose samples' part is not the op's")
    af, bf = (f if call.shared(t) else f.unsqueeze(1) for t, f in ((a, fa), (b, fb)))
    if a in out:
        write_reduced(call, out, a, torch.matmul(g, bf.transpose(-1, -2)))  # (n, v, .., m, k)
    if b in out:
        write_reduced(call, out, b, torch.matmul(af.transpose(-1, -2), g))  # (n, v, .., k, p)


def _paired(call: OpCall, a: Tensor, b: Tensor, g: Tensor, out: dict) -> None:
    """Both operands per sample (one of them computed from parameters and paired with
    the samples, as DeBERTa's relative keys): per-sample products, no broadcasting."""
    if call.shared(a) or call.shared(b) or a.dim() < 2 or b.dim() < 2:
        raise Decline("not a matrix parameter times per-sample data")
    af, bf = call.front(a), call.front(b)  # (n, ..., m, k), (n, ..., k, p)
    if af.shape[:-2] != bf.shape[:-2] or g.shape[2:-2] != af.shape[1:-2]:
        raise Decline("operands broadcast against each other")
    if a in out:
        torch.matmul(g, bf.unsqueeze(1).transpose(-1, -2), out=out[a])  # (n, v, ..., m, k)
    if b in out:
        torch.matmul(af.unsqueeze(1).transpose(-1, -2), g, out=out[b])  # (n, v, ..., k, p)


def matmul_factors(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Factors]:
    """``x @ W`` with ``W (k, p)`` shared: ``L = x``, ``R = g`` over the other dims."""
    a, b = _operands(call)
    if set(wanted) != {b} or a is b or not call.shared(b) or b.dim() != 2:
        raise Decline("not a shared matrix parameter on the right")
    k, p = b.shape
    n = g.shape[0]
    return {b: Factors(_expanded(call, a, k, n), g.reshape(n, -1, p), "right")}


# ---------------------------------------------------------------------------
# F.bilinear: y[t, o] = sum_ij x1[t, i] W[o, i, j] x2[t, j] + b[o]


def _bilinear_args(call: OpCall) -> tuple:
    return (call.arg(0, "input1"), call.arg(1, "input2"), call.arg(2, "weight"),
            call.arg(3, "bias"))


def bilinear(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """A linear map of the outer products ``z[t] = x1[t] outer x2[t]``."""
    x1, x2, w, b = _bilinear_args(call)
    call.only(out, w, b)
    n, v = g.shape[:2]
    o, i, j = w.shape
    gt = g.reshape(n, v, -1, o)  # (n, v, t, o)
    if w in out:
        z = (as_rows(call, x1, i).unsqueeze(-1) * as_rows(call, x2, j).unsqueeze(-2)).flatten(-2)
        dst = out[w]
        flat = dst.view(n, v, o, i * j) if dst.is_contiguous() else dst.new_empty(n, v, o, i * j)
        sum_outer_into(gt, z, flat)
        if flat.data_ptr() != dst.data_ptr():
            dst.copy_(flat.view(dst.shape))
    if b is not None and b in out:
        torch.sum(gt, dim=2, out=out[b])


def bilinear_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict[Tensor, Tensor]:
    """``|grad_W[n]|^2 = |g|^2 |x1|^2 |x2|^2`` for ``T = 1``, ``sum_{t,s} (g_t . g_s)
    (x1_t . x1_s)(x2_t . x2_s)`` when ``T^2 (o + i + j)`` is below ``T o i j``."""
    x1, x2, w, b = _bilinear_args(call)
    if call.shared(x1) or call.shared(x2):
        raise Decline("a shared input")
    n = g.shape[0]
    o, i, j = w.shape
    gt = g.reshape(n, -1, o)  # (n, t, o)
    found = {}
    if w in wanted:
        a1, a2 = as_rows(call, x1, i), as_rows(call, x2, j)
        t = gt.shape[1]
        if t == 1:
            found[w] = (gt.square().sum((1, 2)) * a1.square().sum((1, 2))
                        * a2.square().sum((1, 2)))
        elif t * (o + i + j) <= o * i * j:
            grams = [torch.bmm(a, a.transpose(1, 2)) for a in (gt, a1, a2)]  # 3 x (n, t, t)
            found[w] = (grams[0] * grams[1] * grams[2]).sum((1, 2))
        else:
            raise Decline("materialising is cheaper")
    if b is not None and b in wanted:
        found[b] = gt.sum(1).square().sum(1)
    return found


LINEAR = register(OpSpec((F.linear,), grad=linear, norm=linear_norm, sum=linear_sum,
                         factors=linear_factors))
ADDMM = register(OpSpec((torch.addmm,), grad=addmm, norm=addmm_norm, sum=addmm_sum,
                        factors=addmm_factors))
MATMUL = register(OpSpec((torch.matmul, torch.mm, torch.bmm), grad=matmul,
                         factors=matmul_factors))
BILINEAR = register(OpSpec((F.bilinear,), grad=bilinear, norm=bilinear_norm))
