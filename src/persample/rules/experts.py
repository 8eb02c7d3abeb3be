"""Per-sample gradients of a mixture of experts as transformers ships it (Mixtral,
Qwen-MoE, OLMoE...): one module holding every expert's weights as 3-d tables,
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``, called with the tokens
``(R, H)`` (the batch's rows merged with its tokens), the experts each token chose
``(R, k)`` and their weights ``(R, k)``.

Whatever the implementation runs inside (the eager loop over the experts any token
chose; the default grouped one, sorting the tokens by expert for ``torch._grouped_mm``
with offsets counted by ``histc``), each token ``r`` routed to expert ``e`` with weight
``w`` computes ``y = w * W_d[e] (act(g) * u)``, ``[g; u] = W_gu[e] x_r``, and the output
row ``r`` is the sum of its ``k`` experts' ``y``. The rule recomputes that per expert on
the tokens routed to it and sums the outer products of each token's backprops and
inputs into its sample's row (Goodfellow 2015, as for a linear layer on sequences):

- ``grad W_d[n, e] = sum_{r of n routed to e} (w g_r) (act(g) * u)_r^T``
- ``grad W_gu[n, e] = sum_{r of n routed to e} [act'(g) (W_d^T w g_r) * u; act(g) *
  (W_d^T w g_r)] x_r^T``

Where the default grouped implementation ran, the rule reads its two products as they
ran instead (the call's ops are kept, ``ModuleSpec.inner``): the gathered tokens and
``act(g) * u``, the inputs of the two grouped products, and the backward's gradients at
their outputs, which are ``w g_r`` and the bracket above: only the sums of outer products
are left to compute, sample by sample within each expert's rows. That is taken only
where every op checks out (see :func:`_grouped_as_run`), else the products are
computed again as above.

Index conventions: ``n`` sample, ``v`` cotangent, ``m`` a token routed to the expert,
``S`` the (token, expert) pairs of the call. The module is recognised by its parameters
and ``forward(hidden_states, top_k_index, top_k_weights)`` (transformers is not
imported); configurations with biases, transposed or interleaved tables, no gate, a gate
of their own (``_apply_gate``) or a norm after each expert take the ops' own paths. The
router, outside this module, takes its linear rule: the gradients through the routing
weights reach it by the main backward.

Source: Shazeer et al. 2017 (sparsely-gated mixture of experts); Jiang et al. 2024
(Mixtral).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..batch import Batched
from ..batch.layouts import grouping, sample_of_positions
from .calls import OpCall
from .spec import Decline, InnerOp, ModuleSpec, OpSpec, register, register_module

_FORWARD = ["hidden_states", "top_k_index", "top_k_weights"]


def is_experts(module: nn.Module) -> bool:
    """Does ``module`` look like transformers' experts module (see the module
    docstring)?"""
    tables = module._parameters  # (no attribute lookup: read at every module call)
    gu, down = tables.get("gate_up_proj"), tables.get("down_proj")
    if gu is None or down is None:  # (most modules: no isinstance through Parameter's
        return False  # metaclass)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter)
            and gu.dim() == 3 and down.dim() == 3 and callable(getattr(module, "act_fn", None))):
        return False
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names == _FORWARD


def check(module: nn.Module) -> None:
    """Decline the configurations the rule does not compute."""
    flags = {"has_bias": False, "is_transposed": False, "has_post_expert_norm": False,
             "_is_expert_parallel": False}
    for name, want in flags.items():
        if bool(getattr(module, name, want)) != want:
            raise Decline(f"experts with {name}={getattr(module, name)}")
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        raise Decline("experts without a concatenated gate")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        raise Decline("experts with a gate of their own (_apply_gate: clamped, scaled)")
    experts, inter2, hidden = module.gate_up_proj.shape
    if module.down_proj.shape != (experts, hidden, inter2 // 2) or inter2 % 2:
        raise Decline("expert tables of unexpected shapes")
    if any(p is not None and p.requires_grad for name, p in module.named_parameters()
           if name not in ("gate_up_proj", "down_proj")):
        raise Decline("experts with other trainable parameters")


def experts(layer: nn.Module, activations: tuple, backprops: Tensor, out: dict,
            inner: list[InnerOp] = ()) -> None:
    """``out["gate_up_proj"] (n, v, E, 2I, H)``, ``out["down_proj"] (n, v, E, H, I)``."""
    hidden, index, weights = activations[:3]  # (n, T, H), (n, T, k), (n, T, k)
    ran = _grouped_as_run(layer, hidden, inner)
    if ran is not None:
        _from_run(ran, backprops.shape[0], hidden.shape[1], out)
    else:
        _computed_again(layer, hidden, index, weights, backprops, out)


def _computed_again(layer: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor,
                    backprops: Tensor, out: dict) -> None:
    """The sums with each expert's products computed again on its tokens (see the module
    docstring)."""
    n, v = backprops.shape[:2]
    rows = hidden.reshape(-1, hidden.shape[-1])  # (R, H), samples in order
    per = rows.shape[0] // n
    sample = torch.arange(n, device=rows.device).repeat_interleave(per)  # (R,)
    index, weights = index.reshape(rows.shape[0], -1), weights.reshape(rows.shape[0], -1)
    g = backprops.reshape(n, v, per, -1).transpose(0, 1).reshape(v, rows.shape[0], -1)
    gate_up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()
    want_gu, want_d = out.get("gate_up_proj"), out.get("down_proj")
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(index == e)  # (m,), (m,)
        if not len(token):
            _unchosen(out, e)
            continue
        x = rows.index_select(0, token).to(gate_up.dtype)  # (m, H)
        pre_up = F.linear(x, gate_up[e])  # (m, 2I)
        pre, up = pre_up.chunk(2, dim=-1)  # (m, I) each
        act, pull = _activation(layer.act_fn, pre)  # act(pre), and its pullback
        h = act * up  # (m, I)
        w = weights[token, slot].to(g.dtype)  # (m,)
        gy = g.index_select(1, token) * w[None, :, None]  # (v, m, H)
        padded = _Padded(sample[token], n)  # each sample's tokens, in rows of its own
        if want_d is not None:
            padded.outer_sums(gy, h, want_d[:, :, e])
        if want_gu is not None:
            dh = gy @ down[e]  # (v, m, I)
            dgu = pre_up.new_empty((v, *pre_up.shape))  # (v, m, 2I): [dpre, dup]
            pull(dh * up, dgu[..., :pre.shape[-1]])
            torch.mul(dh, act, out=dgu[..., pre.shape[-1]:])
            padded.outer_sums(dgu, x, want_gu[:, :, e])


class _Run(NamedTuple):
    """The grouped implementation's products as they ran: ``x (S, H)`` the rows
    ``rows (S,)`` of the call's tokens gathered by expert, ``offs (E,)`` the experts'
    ends in them, ``h (S, I)`` the inputs of the down projection, ``gx (v, S, 2I)``
    and ``gh (v, S, H)`` the backward's gradients at the two products' outputs."""

    rows: Tensor
    offs: Tensor
    x: Tensor
    gx: Tensor
    h: Tensor
    gh: Tensor


def _grouped_as_run(layer: nn.Module, hidden: Tensor, inner: list[InnerOp]) -> _Run | None:
    """transformers' default (grouped) experts as they ran, read from the call's ops
    (``ModuleSpec.inner``): ``x = hidden_states[rows]``, ``[g; u] =
    grouped_mm(x, gate_up_proj^T, offs)``, ``h = grouped_mm(act(g) * u, down_proj^T,
    offs)``, checked op by op (the tables' own transposed views, the gather from the
    call's tokens, the same offsets covering every row, ``h`` equal to ``act(g) * u``
    bit for bit); ``None`` for anything else (the products are then computed again)."""
    mm = [i for i in inner if i.func in _PRODUCTS]
    if len(mm) != 2 or any(i.grad is None for i in mm):
        return None
    (x, w_gu, offs), (h, w_d, offs_d) = (_grouped_args(i) for i in mm)
    gather = next((i for i in inner if i.func is _GETITEM and i.output is x), None)
    if (gather is None or offs is None or offs_d is None
            or not _transposed(w_gu, layer.gate_up_proj)
            or not _transposed(w_d, layer.down_proj)):
        return None
    source, rows = gather.args[0], gather.args[1]
    dtype = layer.gate_up_proj.dtype
    if not (isinstance(source, Tensor) and isinstance(rows, Tensor) and rows.dim() == 1
            and not rows.is_floating_point() and source.data_ptr() == hidden.data_ptr()
            and source.shape == (hidden.shape[0] * hidden.shape[1], hidden.shape[2])
            and source.is_contiguous() and hidden.is_contiguous()
            and x.dtype == h.dtype == mm[0].grad.dtype == mm[1].grad.dtype == dtype
            and offs.shape == (w_gu.shape[0],) and int(offs[-1]) == x.shape[0]
            and (offs_d is offs or torch.equal(offs_d, offs))):
        return None
    pre, up = mm[0].output.chunk(2, dim=-1)  # (S, I) each
    if not torch.equal(_activation(layer.act_fn, pre)[0] * up, h):
        return None
    return _Run(rows, offs, x, mm[0].grad, h, mm[1].grad)


def _from_run(ran: _Run, n: int, per: int, out: dict) -> None:
    """Each sample's sums of outer products over its rows, expert by expert (the rows
    ordered by expert, then sample)."""
    sample = ran.rows // per  # (S,) the sample of each row
    ends = ran.offs.tolist()
    expert = torch.repeat_interleave(torch.arange(len(ends), device=sample.device),
                                     ran.offs.diff(prepend=ran.offs.new_zeros(1)).long())
    order = torch.argsort(expert * n + sample, stable=True)  # (S,)
    owner = sample.index_select(0, order)
    want_gu, want_d = out.get("gate_up_proj"), out.get("down_proj")
    x, gx = ran.x.index_select(0, order), ran.gx.index_select(1, order)  # (S, H), (v, S, 2I)
    h, gh = ran.h.index_select(0, order), ran.gh.index_select(1, order)  # (S, I), (v, S, H)
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if start == end:
            _unchosen(out, e)
            continue
        padded = _Padded(owner[start:end], n)  # expert e's rows, by sample
        if want_d is not None:
            padded.outer_sums(gh[:, start:end], h[start:end], want_d[:, :, e])
        if want_gu is not None:
            padded.outer_sums(gx[:, start:end], x[start:end], want_gu[:, :, e])


def _unchosen(out: dict, e: int) -> None:
    """Expert ``e``, which no token chose: zero gradients."""
    for t in out.values():
        t[:, :, e].zero_()


def _grouped_args(op: InnerOp) -> tuple:
    """``(a, b, offs)`` of ``grouped_mm(a, b, offs=...)``; ``offs`` ``None`` with a
    bias or another output dtype."""
    args = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), op.args), **op.kwargs)
    a, b = args.get("mat_a", args.get("self")), args.get("mat_b", args.get("mat2"))
    offs = args.get("offs")
    dtype = args.get("out_dtype")
    if args.get("bias") is not None or dtype not in (None, getattr(a, "dtype", None)):
        offs = None
    return a, b, offs


def _transposed(t: Tensor, table: Tensor) -> bool:
    """Is ``t`` exactly ``table.transpose(-2, -1)``?"""
    want = table.transpose(-2, -1)
    return (isinstance(t, Tensor) and t._base is table and t.shape == want.shape
            and t.stride() == want.stride() and t.storage_offset() == want.storage_offset())


_GETITEM = torch.Tensor.__getitem__
_PRODUCTS = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                              getattr(F, "grouped_mm", None)) if f is not None)


def _activation(fn: Callable[[Tensor], Tensor], pre: Tensor
                ) -> tuple[Tensor, Callable[[Tensor, Tensor], None]]:
    """``fn(pre)`` and its pullback ``pull(g, into)``, ``into = g * fn'(pre)`` entry by
    entry for ``g (v, m, I)``: for SiLU (Mixtral's) torch's own fused kernels, for
    another activation autograd's."""
    if isinstance(fn, nn.SiLU) or type(fn).__name__ == "SiLUActivation":
        def silu_pull(g: Tensor, into: Tensor) -> None:
            torch.ops.aten.silu_backward(g, pre, grad_input=into)

        return F.silu(pre), silu_pull
    leaf = pre.detach().requires_grad_()
    with torch.enable_grad():
        out = fn(leaf)

    def pull(g: Tensor, into: Tensor) -> None:
        into.copy_(torch.autograd.grad(out, leaf, g, is_grads_batched=True,
                                       retain_graph=True)[0])

    return out.detach(), pull


_GROUPED = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's, on the CPU


class _Padded:
    """Tokens ``(m,)`` of samples ``owner`` (in sample order), each sample's sum of
    outer products taken in one call: on the CPU in float32 or half precision by
    ``torch._grouped_mm`` over the samples' runs of tokens (the products split along
    the tokens by their offsets), otherwise as one batched matrix product of the tokens
    placed in a padded ``(n, M, ...)`` layout, ``M`` the most tokens of one sample."""

    def __init__(self, owner: Tensor, n: int):
        counts = torch.bincount(owner, minlength=n)  # (n,)
        self.ends = torch.cumsum(counts, 0)  # (n,) each sample's tokens end here
        starts = self.ends - counts
        self.owner, self.n = owner, n
        self.slot = torch.arange(len(owner), device=owner.device) - starts[owner]  # (m,)
        self._counts, self._most = counts, None

    def place(self, t: Tensor) -> Tensor:
        """``(..., m, d)`` -> ``(..., n, M, d)``, zeros where a sample has fewer."""
        if self._most is None:  # (read once: a synchronisation on a GPU)
            self._most = int(self._counts.max())
        out = t.new_zeros((*t.shape[:-2], self.n, self._most, t.shape[-1]))
        out[..., self.owner, self.slot, :] = t
        return out

    def outer_sums(self, g: Tensor, x: Tensor, into: Tensor) -> None:
        """``into (*lead, v, o, i)`` (a view of the result, any strides; ``lead`` the
        groups, ``(n,)`` or ``(n, E)`` for ``n E`` groups): per group, ``sum_m g[v, m]^T
        x[m]`` for ``g (v, m, o)``, ``x (m, i)``. The grouped products are taken in the
        order of ``into``'s contiguous dim (``(o, i)`` matrices for a table ``(E, o, i)``,
        ``(i, o)`` for one stored ``(E, i, o)``): copying the other order in costs twice
        the products."""
        v, m, o = g.shape
        lead = into.shape[:-3]
        if not _groups(g, x):
            sums = (self.place(g).transpose(-1, -2) @ self.place(x)).transpose(0, 1)
            into.copy_(sums.reshape(*lead, v, o, -1))  # (groups, v, o, i)
            return
        rows, offs = g.transpose(0, 1).reshape(m, v * o), self.ends.to(torch.int32)
        if into.stride(-2) == 1 and into.stride(-1) != 1:  # (o contiguous: (groups, i, v o))
            sums = torch._grouped_mm(x.contiguous().t(), rows, offs=offs)
            into.copy_(sums.view(*lead, -1, v, o).movedim(-3, -1))
        else:  # (groups, v o, i)
            sums = torch._grouped_mm(rows.t(), x.contiguous(), offs=offs)
            into.copy_(sums.view(*lead, v, o, -1))


def _groups(g: Tensor, x: Tensor) -> bool:
    """Can ``torch._grouped_mm`` take these: the CPU, float32 or half precision, rows of
    a multiple of 16 bytes?"""
    size = g.element_size()
    return (hasattr(torch, "_grouped_mm") and g.device.type == "cpu" and g.dtype in _GROUPED
            and x.dtype == g.dtype and (g.shape[0] * g.shape[2] * size) % 16 == 0
            and (x.shape[-1] * size) % 16 == 0)


def grouped_mm(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``y_r = x_r W[e(r)]`` for rows sorted by expert (``grouped_mm(x, W, offs=)``,
    transformers' grouped experts with biases or a gate of their own, gpt-oss):
    ``grad W[n, e] = sum_{r of n in run e} x_r^T g_r``, the rows of each (sample,
    expert) pair summed in one call (:class:`_Padded`)."""
    x, w = call.arg(0, "mat_a"), call.arg(1, "mat_b")
    offs = call.kwargs.get("offs", call.args[2] if len(call.args) > 2 else None)
    call.only(out, w)
    if not call.shared(w) or call.shared(x) or w not in out:
        raise Decline("not per-sample rows times shared groups")
    n, v = g.shape[:2]
    experts, k, o = w.shape
    runs = torch.searchsorted(offs.long(), torch.arange(x.shape[0], device=offs.device),
                              right=True)  # (S,) each row's expert
    xs, gs, samples, runs = _by_sample(call.pairing(x), call.value(x), g, runs.to(x.device), n)
    into = out[w].permute(0, 2, 1, 4, 3)  # (n, E, v, o, k) of (n, v, E, k, o), any strides
    _Padded(samples * experts + runs, n * experts).outer_sums(gs, xs, into)


def _by_sample(lay: Batched, x: Tensor, g: Tensor, runs: Tensor, n: int
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows ``x (S, k)`` sorted by sample, stably (a sample's rows keep their order:
    by expert), with their backprops ``(v, S, o)`` from ``g (n, v, L, o)`` (the rows in
    front, zero-padded to ``L``), their samples and their ``runs`` ``(S,)``."""
    v, o = g.shape[1], g.shape[-1]
    flat = g.transpose(0, 1).reshape(v, -1, o)  # (v, n L, o)
    if lay.index is None:  # (as many rows each: front() put them in that order, unpadded)
        sample = sample_of_positions(lay, x.shape[0], n, x.device)  # (S,)
        order = torch.argsort(sample, stable=True)
        return (x.index_select(0, order), flat, sample.index_select(0, order),
                runs.index_select(0, order))
    order, _, places = grouping(lay.index, n)
    gs = flat if places is None else flat.index_select(1, places)  # (v, S, o)
    if order is None:
        return x, gs, lay.index, runs
    return (x.index_select(0, order), gs, lay.index.index_select(0, order),
            runs.index_select(0, order))


EXPERTS = register_module(ModuleSpec((), grad=experts, check=check, match=is_experts,
                                     rows=True, keeps_layout=True, inner=_PRODUCTS))
GROUPED_MM = register(OpSpec(_PRODUCTS, grad=grouped_mm, reads_values=True))


# ---------------------------------------------------------------------------
# Switch Transformers' experts: a ModuleDict of MLPs, tokens dispatched by a one-hot mask

_SWITCH_FORWARD = ["hidden_states", "selected_experts", "routing_weights"]


def is_switch_experts(module: nn.Module) -> bool:
    """Does ``module`` look like Switch Transformers' experts (transformers'
    ``SwitchTransformersExperts``): a ``ModuleDict`` of ``expert_{i}`` MLPs called with
    the tokens ``(R, H)``, a one-hot dispatch mask ``(R, 1, E)`` (all zeros for a token
    its expert had no capacity left for) and the routing weights ``(R, 1)``?"""
    if not isinstance(module, nn.ModuleDict) or not len(module):
        return False
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names == _SWITCH_FORWARD and all(
        f"expert_{e}" in module._modules for e in range(len(module)))


def check_switch(module: nn.Module) -> None:
    """Decline experts other than ``wi``, an activation, dropout and ``wo`` (linear maps
    without biases), and dropout that draws (training)."""
    for name, expert in module.items():
        wi, wo = getattr(expert, "wi", None), getattr(expert, "wo", None)
        if not (type(expert).__name__.endswith("DenseActDense") and isinstance(wi, nn.Linear)
                and isinstance(wo, nn.Linear) and wi.bias is None and wo.bias is None
                and callable(getattr(expert, "act", None))):
            raise Decline(f"experts other than wi, act, dropout, wo ({name})")
        dropout = getattr(expert, "dropout", None)
        if expert.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise Decline("experts with dropout in training")
        if any(p.requires_grad for n, p in expert.named_parameters()
               if n not in ("wi.weight", "wo.weight")):
            raise Decline(f"experts with other trainable parameters ({name})")


def switch_experts(layer: nn.Module, activations: tuple, backprops: Tensor, out: dict
                   ) -> None:
    """``out["expert_{e}.wi.weight"] (n, v, F, H)`` and ``out["expert_{e}.wo.weight"]
    (n, v, H, F)``: token ``r`` dispatched to expert ``e`` with weight ``w`` computes
    ``w W_o act(W_i x_r)``; the sums of outer products over each sample's tokens, as
    for transformers' experts above (Fedus et al. 2022, Switch Transformers)."""
    hidden, mask, weights = activations[:3]  # (n, T, H), (n, T, 1, E), (n, T, 1)
    n, v = backprops.shape[:2]
    rows = hidden.reshape(-1, hidden.shape[-1])  # (R, H), samples in order
    per = rows.shape[0] // n
    sample = torch.arange(n, device=rows.device).repeat_interleave(per)  # (R,)
    mask, weights = mask.reshape(rows.shape[0], -1), weights.reshape(rows.shape[0])
    g = backprops.reshape(n, v, per, -1).transpose(0, 1).reshape(v, rows.shape[0], -1)
    for e in range(mask.shape[1]):
        expert = layer[f"expert_{e}"]
        want_i, want_o = out.get(f"expert_{e}.wi.weight"), out.get(f"expert_{e}.wo.weight")
        token = torch.nonzero(mask[:, e]).squeeze(1)  # (m,) its tokens
        if not len(token):
            for t in (want_i, want_o):
                if t is not None:
                    t.zero_()
            continue
        wi, wo = expert.wi.weight.detach(), expert.wo.weight.detach()
        x = rows.index_select(0, token).to(wi.dtype)  # (m, H)
        h, pull = _activation(expert.act, F.linear(x, wi))  # (m, F)
        gy = g.index_select(1, token) * weights[token].to(g.dtype)[None, :, None]  # (v, m, H)
        padded = _Padded(sample[token], n)  # each sample's tokens, in rows of its own
        if want_o is not None:
            padded.outer_sums(gy, h.to(wo.dtype), want_o)
        if want_i is not None:
            dpre = torch.empty((v, *h.shape), dtype=h.dtype, device=h.device)  # (v, m, F)
            pull(gy @ wo, dpre)
            padded.outer_sums(dpre, x, want_i)


SWITCH_EXPERTS = register_module(ModuleSpec((), grad=switch_experts, check=check_switch,
                                            match=is_switch_experts, rows=True,
                                            keeps_layout=True, recurse=True))
