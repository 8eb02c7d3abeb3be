"""Per-sample gradients of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``.

``torch.func`` has no batching rule for the fused recurrent kernels, and a loop
over samples is slow. The rule recomputes the recurrence step by step, batched
over samples (the equations of PyTorch's documentation), keeping each step's
pre-activations in the graph. One backward of the captured backprops through
that unrolled recurrence gives the backprops of the pre-activations; the weight
gradients are then sums over time of outer products, as for a Linear layer on
sequences (Goodfellow 2015, applied per gate):

- ``grad W_ih[n] = sum_t dgi[n, t]^T x[n, t]``, ``grad b_ih[n] = sum_t dgi[n, t]``
- ``grad W_hh[n] = sum_t dgh[n, t]^T h[n, t - 1]``, ``grad b_hh[n] = sum_t dgh[n, t]``
- ``grad W_hr[n] = sum_t dh[n, t]^T r[n, t]`` (LSTM with ``proj_size``)

with ``gi = x W_ih^T + b_ih`` and ``gh = h W_hh^T + b_hh`` (kept apart because
GRU's new gate multiplies ``gh`` by its reset gate). Index conventions: ``n``
sample (times ``v`` cotangents, folded into one batch ``N``), ``t`` time step,
``g`` gate unit. Packed sequences are padded and each sample's state is frozen
past its length, which is exactly what the packed kernels compute.

Precision: the recurrence is recomputed in at least float32 (the fused kernels keep
their gates and states in float32 for bfloat16 weights, and each of the step's many
small ops rounding to bfloat16 would drift from them over time); the gradients are
written in the results' dtype at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..batch import Batched, front
from ..capture.records import KEPT_OUTPUTS
from ..precision import accumulate_dtype, cast
from .calls import Destinations
from .outer import sum_outer_into
from .spec import Decline, ModuleSpec, OpSpec, register, register_module


@dataclass
class _Trace:
    """One layer and direction of the unrolled recurrence (lists in processing order)."""

    suffix: str  # "_l0", "_l1_reverse", ...
    x: Tensor  # (N, T, I) the layer's input
    gi: Tensor  # (N, T, G) input pre-activations, in the graph
    gh: list[Tensor] = field(default_factory=list)  # T x (N, G) hidden pre-activations
    h_prev: list[Tensor] = field(default_factory=list)  # T x (N, H_out) state fed in
    projected: list[Tensor] = field(default_factory=list)  # T x (N, P) (LSTM proj_size)
    raw: list[Tensor] = field(default_factory=list)  # T x (N, H) before the projection


def _cell(mode: str, gates: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One RNN or LSTM step from ``gates = gi + gh`` ``(N, G)``: the new (unprojected)
    hidden state and, for LSTM, the new cell state."""
    if mode == "RNN_TANH":
        return torch.tanh(gates), None
    if mode == "RNN_RELU":
        return torch.relu(gates), None
    s, hidden = torch.sigmoid(gates), gates.shape[1] // 4  # LSTM: gates i, f, g, o
    c = s[:, hidden:2 * hidden] * c + s[:, :hidden] * torch.tanh(gates[:, 2 * hidden:3 * hidden])
    return s[:, 3 * hidden:] * torch.tanh(c), c


def _gru_cell(gi: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    """One GRU step; ``gh`` enters apart, its new-gate part scaled by the reset gate."""
    ir, iz, in_ = gi.chunk(3, 1)
    hr, hz, hn = gh.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    return (1 - z) * torch.tanh(in_ + r * hn) + z * h


def _weights(layer: nn.RNNBase, name: str, dtype: torch.dtype) -> Tensor | None:
    """The layer's weight ``name`` (detached) in the dtype the recurrence runs in."""
    w = getattr(layer, name, None)
    return None if w is None else cast(w.detach(), dtype)


def _direction(layer: nn.RNNBase, trace: _Trace, valid: Tensor | None, h: Tensor,
               c: Tensor | None, reverse: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run one layer in one direction: outputs ``(N, T, H_out)``, final ``h`` and ``c``."""
    w_hh, b_hh, w_hr = (_weights(layer, name + trace.suffix, h.dtype)
                        for name in ("weight_hh", "bias_hh", "weight_hr"))
    steps = trace.gi.unbind(1)  # T x (N, G)
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    outs: list[Tensor] = [h] * len(steps)
    for t in order:
        if layer.mode == "GRU":
            gh = F.linear(h, w_hh, b_hh)  # (N, G)
            new, c_new = _gru_cell(steps[t], gh, h), None
        else:  # gates = gi + gh: one tensor, whose backprops are those of gi and gh
            gh = torch.addmm(steps[t], h, w_hh.T)  # b_hh is in gi already
            new, c_new = _cell(layer.mode, gh, c)
        trace.gh.append(gh)
        trace.h_prev.append(h)
        if w_hr is not None:
            trace.raw.append(new)
            new = new @ w_hr.T  # (N, P)
            trace.projected.append(new)
        if valid is not None:  # past a sample's length its state stays as it was
            keep = valid[:, t, None]
            new = torch.where(keep, new, h)
            c_new = None if c is None else torch.where(keep, c_new, c)
        h, c = new, c_new
        outs[t] = h
    return torch.stack(outs, 1), h, c


def _unrolled(layer: nn.RNNBase, x: Tensor, valid: Tensor | None, h0: Tensor,
              c0: Tensor | None) -> tuple[list[_Trace], list[Tensor]]:
    """The whole recurrence; returns the traces and ``[output, h_n, (c_n)]`` batch-first."""
    directions = 2 if layer.bidirectional else 1
    traces, h_n, c_n = [], [], []
    for k in range(layer.num_layers):
        outs = []
        for d in range(directions):
            suffix = f"_l{k}" + ("_reverse" if d else "")
            gi = F.linear(x, _weights(layer, "weight_ih" + suffix, x.dtype),
                          _weights(layer, "bias_ih" + suffix, x.dtype))  # (N, T, G)
            b_hh = _weights(layer, "bias_hh" + suffix, x.dtype)
            if layer.mode != "GRU" and b_hh is not None:
                gi = gi + b_hh  # the steps then add only h W_hh^T
            trace = _Trace(suffix, x, gi)
            j = k * directions + d
            out, h, c = _direction(layer, trace, valid, h0[:, j],
                                   None if c0 is None else c0[:, j], reverse=bool(d))
            traces.append(trace)
            outs.append(out)
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outs, 2) if directions > 1 else outs[0]  # (N, T, D * H_out)
    results = [x, torch.stack(h_n, 1)]  # (N, T, D * H_out), (N, L * D, H_out)
    if c0 is not None:
        results.append(torch.stack(c_n, 1))  # (N, L * D, H)
    return traces, results


def _inputs(layer: nn.RNNBase, activations: tuple, v: int, dtype: torch.dtype):
    """Padded input ``(n * v, T, I)``, valid-step mask ``(n * v, T)`` (packed input) or
    ``None``, ``h0 (n * v, L * D, H_out)`` and ``c0`` (LSTM), each sample repeated ``v``
    times, in ``dtype``. ``activations`` are batch-first, in sample order: input ``(n, T,
    I)`` or a ``PackedSequence`` that unpacks in sample order, ``hx`` ``(n, L * D, H)`` or
    a tuple of them, or absent."""
    x, hx = activations[0], activations[1] if len(activations) > 1 else None
    valid = None
    if isinstance(x, PackedSequence):
        x, lengths = pad_packed_sequence(x, batch_first=True)  # (n, T, I), (n,) sample order
        valid = (torch.arange(x.shape[1]) < lengths[:, None]).to(x.device)  # (n, T)
        valid = valid.repeat_interleave(v, 0)
    n, stack = x.shape[0], layer.num_layers * (2 if layer.bidirectional else 1)
    h0, c0 = hx if isinstance(hx, tuple) else (hx, None)
    if h0 is None:
        h0 = x.new_zeros(n, stack, layer.proj_size or layer.hidden_size)
    if layer.mode == "LSTM" and c0 is None:
        c0 = x.new_zeros(n, stack, layer.hidden_size)
    # leaves of the unrolled graph, so that every pre-activation is in it
    x, h0, c0 = [None if t is None else
                 cast(t.detach(), dtype).repeat_interleave(v, 0).requires_grad_()
                 for t in (x, h0, c0)]
    return x, valid, h0, c0


def training_dropout(layer: nn.RNNBase) -> str | None:
    """The reason the rule refuses ``layer``: dropout between layers in training mode."""
    if layer.dropout > 0 and layer.training and layer.num_layers > 1:
        return (
            f"dropout={layer.dropout} between the layers in training mode draws a random mask "
            "the per-sample rule cannot reproduce (and no two calls agree). Set dropout=0, "
            "or call model.eval()."
        )
    return None


def _check_dropout(layer: nn.RNNBase) -> None:
    reason = training_dropout(layer)
    if reason:
        raise ValueError(f"{type(layer).__name__} has {reason}")


def _wanted(layer: nn.RNNBase, trace: _Trace) -> list[Tensor]:
    """The tensors of one layer and direction whose backprops the rule needs."""
    return ([trace.gi] if layer.mode == "GRU" else []) + trace.gh + trace.projected


def recurrent(layer: nn.RNNBase, activations: tuple, backprops: list[Tensor], out: dict,
              outputs: list[Tensor] | None = None):
    """Per-sample gradients of every weight of ``layer``; backprops ``[output, h_n, (c_n)]``,
    a packed output's ``(n, v, T, H)`` padded per sample (``(n, v, H)`` where each sample
    has one row); ``outputs``: the call's ``[output (n, T, D * H), h_n, (c_n)]``, or
    ``None``.

    One layer on dense inputs with its outputs at hand (:func:`_from_outputs`): every
    step's gates from the states the kernel returned, in a few batched products, and the
    backward of the recurrence by its equations. Otherwise the recurrence is recomputed
    rather than captured (keeping the unrolled steps in the main forward instead of the
    fused kernel measured no faster) and differentiated by autograd.
    """
    _check_dropout(layer)
    if outputs is not None and _from_outputs(layer, activations, backprops, outputs, out):
        return
    n, v = backprops[0].shape[:2]
    if isinstance(activations[0], PackedSequence) and backprops[0].dim() == 3:
        backprops = [backprops[0].unsqueeze(2), *backprops[1:]]  # one row per sample: T = 1
    work = accumulate_dtype(backprops[0].dtype)  # float32 for bfloat16 / float16 results
    x, valid, h0, c0 = _inputs(layer, activations, v, work)
    with torch.enable_grad():
        traces, results = _unrolled(layer, x, valid, h0, c0)
        wrt = [t for trace in traces for t in _wanted(layer, trace)]
        grads = torch.autograd.grad(
            results, wrt, [cast(g, work).flatten(0, 1) for g in backprops], allow_unused=True)
    grads = [(torch.zeros_like(w) if g is None else g).unflatten(0, (n, v))
             for g, w in zip(grads, wrt)]  # (n, v, ...)
    for trace in traces:  # the inputs and states were repeated v times: take one copy
        trace.x = trace.x[::v]
        trace.h_prev = [h[::v] for h in trace.h_prev]
        trace.raw = [r[::v] for r in trace.raw]
    _write_traces(layer, traces, iter(grads), out)


def _from_outputs(layer: nn.RNNBase, activations: tuple, backprops: list[Tensor],
                  outputs: list[Tensor], out: dict) -> bool:
    """The gradients of a one-layer recurrence without running it again, where it can be
    done (else ``False``, nothing written). Its outputs hold every step's state ``h_t``
    (each direction's in its half), so every step's pre-activations come from two
    batched products, ``x W_ih^T`` and ``h_{t-1} W_hh^T``; an LSTM's cell states from one
    elementwise scan. The backward then runs step by step on ``(n, v, H)`` tensors (the
    adjoint equations of the cell: :func:`_lstm_adjoint`, :func:`_adjoint`), and the
    weight gradients are sums over time of outer products, as in the module docstring."""
    x, hx = activations[0], activations[1] if len(activations) > 1 else None
    lstm = layer.mode == "LSTM"
    if (layer.num_layers != 1 or getattr(layer, "proj_size", 0) or not isinstance(x, Tensor)
            or x.dim() != 3 or len(outputs) != len(backprops) or len(outputs) != 2 + lstm):
        return False
    work = accumulate_dtype(backprops[0].dtype)
    n, steps, hidden = x.shape[0], x.shape[1], layer.hidden_size
    directions = 2 if layer.bidirectional else 1
    h0, c0 = hx if isinstance(hx, tuple) else (hx, None)
    h0 = x.new_zeros(n, directions, hidden) if h0 is None else h0
    c0 = x.new_zeros(n, directions, hidden) if lstm and c0 is None else c0
    x, h0, c0, seq = (None if t is None else cast(t.detach(), work)
                      for t in (x, h0, c0, outputs[0]))  # seq (n, T, D * H)
    grads = [cast(g, work) for g in backprops]  # (n, v, T, D * H), (n, v, D, H), ...
    for d in range(directions):
        suffix = "_l0" + ("_reverse" if d else "")
        w_ih, b_ih, w_hh, b_hh = (_weights(layer, name + suffix, work) for name in (
            "weight_ih", "bias_ih", "weight_hh", "bias_hh"))
        h = seq[..., d * hidden:(d + 1) * hidden].transpose(0, 1)  # (T, n, H) after each step
        first = h0[None, :, d]  # (1, n, H)
        h_prev = torch.cat([first, h[:-1]] if d == 0 else [h[1:], first])  # (T, n, H)
        dout = grads[0][..., d * hidden:(d + 1) * hidden]  # (n, v, T, H)
        ends = [g[:, :, d] for g in grads[1:]]  # (n, v, H): h_n's and c_n's backprops
        if lstm:
            a = _preactivations(x, h_prev, w_ih, b_ih, w_hh, b_hh)  # (T, n, 4H)
            dgates = _lstm_adjoint(a, c0[:, d], dout, ends, w_hh, forward=d == 0)
            dgi = dgh = dgates.permute(1, 2, 0, 3)  # (n, v, T, 4H), a view
            bias = dgates.sum(0)  # (n, v, 4H): both biases' gradient
            for name in ("bias_ih", "bias_hh"):
                if name + suffix in out:
                    out[name + suffix].copy_(bias)
        else:
            hb = h_prev.transpose(0, 1)  # (n, T, H)
            gi, gh = F.linear(x, w_ih, b_ih), F.linear(hb, w_hh, b_hh)  # (n, T, G)
            order = range(steps - 1, -1, -1) if d == 0 else range(steps)  # the backward's
            dgi, dgh = _adjoint(layer.mode, gi, gh, hb, dout, ends, w_hh, order)
        _write(out, "weight_ih" + suffix, dgi, x)
        _write(out, "weight_hh" + suffix, dgh, h_prev.transpose(0, 1))
        if not lstm:
            _write(out, "bias_ih" + suffix, dgi, None)
            _write(out, "bias_hh" + suffix, dgh, None)
    return True


def _preactivations(x: Tensor, h_prev: Tensor, w_ih: Tensor, b_ih: Tensor | None,
                    w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    """``x W_ih^T + b_ih + h_prev W_hh^T + b_hh`` ``(T, n, G)``, time-major, from ``x (n, T,
    I)`` and the states fed in ``h_prev (T, n, H)``: two products into one buffer."""
    steps, n = h_prev.shape[:2]
    a = x.new_empty(steps * n, w_ih.shape[0])  # (T n, G)
    xt = x.transpose(0, 1).reshape(steps * n, -1)  # (T n, I)
    bias = b_ih if b_hh is None else b_hh if b_ih is None else b_ih + b_hh
    if bias is None:
        torch.mm(xt, w_ih.T, out=a)
    else:
        torch.addmm(bias, xt, w_ih.T, out=a)
    a.addmm_(h_prev.reshape(steps * n, -1), w_hh.T)
    return a.view(steps, n, -1)


def _tanh(z: Tensor) -> Tensor:
    """``tanh(z)`` as ``2 sigmoid(2 z) - 1``, the same function: torch's CPU ``tanh``
    takes several times as long as its ``sigmoid``."""
    return torch.sigmoid_(z * 2).mul_(2).sub_(1)


def _lstm_adjoint(a: Tensor, c0: Tensor, dout: Tensor, ends: list[Tensor], w_hh: Tensor,
                  forward: bool) -> Tensor:
    """The backprops ``(T, n, v, 4H)`` (time-major) of one LSTM direction's pre-activations
    ``a (T, n, 4H)`` (gates ``i, f, g, o``; time-major; overwritten), from those of its
    outputs ``dout (n, v, T, H)`` and final states ``ends`` (``dh_n``, ``dc_n`` ``(n, v,
    H)``); ``c0 (n, H)`` the initial cell state; ``forward``: the direction ran from
    ``t = 0``. The cell states and each step's factors (the gates' derivatives) are
    computed for all steps at once, time-major so that each step's rows are contiguous;
    the loop carries ``dh`` and ``dc`` back through ``W_hh`` (the cell's adjoint
    equations: ``dc_t += dh_t o_t (1 - tanh^2 c_t)``; ``da = (dc i', dc c_{t-1} f', dc i
    (1 - g^2), dh tanh(c_t) o')`` with ``s' = s (1 - s)``; ``dh_{t-1} = dout_{t-1} + da
    W_hh``; ``dc_{t-1} = dc f_t``)."""
    steps, n, hidden = a.shape[0], a.shape[1], a.shape[2] // 4
    v = dout.shape[1]

    def gate(t: Tensor, k: int) -> Tensor:  # gate k of (..., 4H)
        return t[..., k * hidden:(k + 1) * hidden]

    s = _tanh_gate(a, hidden)  # (T, n, 4H): sigmoid(i, f, o), tanh(g)
    i, f, g, o = (gate(s, k) for k in range(4))
    c = i * g  # (T, n, H): i_t g_t, then the cell states c_t = f_t c_{t-1} + i_t g_t
    order = range(steps) if forward else range(steps - 1, -1, -1)
    prev, cells, forgets = c0, c.unbind(0), f.unbind(0)  # each step's (n, H), views
    for t in order:
        prev = cells[t].addcmul_(forgets[t], prev)
    tc = _tanh(c)  # (T, n, H)
    to_c = torch.addcmul(o, o, tc * tc, value=-1)  # d c_t / d h_t's share: o (1 - tanh^2 c)
    factors = torch.addcmul(s, s, s, value=-1)  # s (1 - s), gate by gate (T, n, 4H)
    gate(factors, 0).mul_(g)  # i' g
    later, earlier = (slice(1, None), slice(None, -1)) if forward else (
        slice(None, -1), slice(1, None))
    gate(factors, 1)[later].mul_(c[earlier])  # f' c_{t-1}
    gate(factors, 1)[order[0]].mul_(c0)
    torch.addcmul(i, i, g * g, value=-1, out=gate(factors, 2))  # i (1 - g^2)
    gate(factors, 3).mul_(tc)  # o' tanh(c_t)
    dgates = dout.new_empty(steps, n, v, 4 * hidden)
    # Every step's operands as views made once (one op per list, not a few per step):
    # the states carried back are (n, v, 1, H), so that each gate's rows are one
    # broadcast product of a step's (n, 1, 4, H) factors.
    quads = dgates.view(steps, n, v, 4, hidden)
    rows = dgates.view(steps, n * v, 4 * hidden).unbind(0)  # (n v, 4H)
    cell_rows, out_rows = quads[:, :, :, :3].unbind(0), quads[:, :, :, 3:].unbind(0)
    quarters = factors.view(steps, n, 1, 4, hidden)
    cell_f, out_f = quarters[:, :, :, :3].unbind(0), quarters[:, :, :, 3:].unbind(0)
    to_cs = to_c.reshape(steps, n, 1, 1, hidden).unbind(0)
    keeps = f[:, :, None, None].unbind(0)  # f_t (n, 1, 1, H)
    douts = dout.permute(2, 0, 1, 3).reshape(steps, n * v, hidden).unbind(0)  # (n v, H)
    back = order[::-1]
    dc = ends[1].reshape(n, v, 1, hidden)
    dh = (douts[back[0]] + ends[0].reshape(n * v, hidden)).view(n, v, 1, hidden)
    for k, t in enumerate(back):
        dc = torch.addcmul(dc, dh, to_cs[t])
        torch.mul(dc, cell_f[t], out=cell_rows[t])
        torch.mul(dh, out_f[t], out=out_rows[t])
        if k + 1 < steps:  # the next step's dh: its output's, plus through W_hh
            dh = torch.addmm(douts[back[k + 1]], rows[t], w_hh).view(n, v, 1, hidden)
            dc = dc * keeps[t]
    return dgates


def _tanh_gate(a: Tensor, hidden: int) -> Tensor:
    """``a (..., 4H)`` in place: ``sigmoid`` of gates ``i, f, o``, ``tanh`` of ``g`` (as
    :func:`_tanh`)."""
    g = a[..., 2 * hidden:3 * hidden]
    g.mul_(2)
    torch.sigmoid_(a)
    g.mul_(2).sub_(1)
    return a


def _adjoint(mode: str, gi: Tensor, gh: Tensor, h_prev: Tensor, dout: Tensor,
             ends: list[Tensor], w_hh: Tensor, order: range) -> tuple[Tensor, Tensor]:
    """The backprops ``(n, v, T, G)`` of one RNN or GRU direction's input and hidden
    pre-activations ``gi``, ``gh`` ``(n, T, G)``, from those of its outputs ``dout (n, v,
    T, H)`` and final state ``ends[0]`` (``dh_n``, ``(n, v, H)``); ``h_prev (n, T, H)``
    the states fed in; ``order``: the steps in the backward's order (the forward's
    reversed). Each step's factors (the gates' derivatives, ``(n, T, ...)``) are computed
    for all steps at once; the loop carries ``dh`` back through ``W_hh``."""
    n, v, steps, hidden = dout.shape
    dh_all = dout.new_empty(n, v, steps, hidden)
    dh_next = ends[0]
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        new = _tanh(in_ + r * hn)
        dn = (1 - z) * (1 - new * new)  # d pre-activation of the new gate / d h_t
        to_r, to_z = dn * hn * r * (1 - r), (h_prev - new) * z * (1 - z)
        hidden_factors = torch.cat([to_r, to_z, dn * r], -1)  # (n, T, 3H)
        for t in order:
            dh = dh_all[:, :, t] = dout[:, :, t] + dh_next
            step = torch.cat([dh, dh, dh], -1) * hidden_factors[:, None, t]
            dh_next = torch.addcmul(step @ w_hh, dh, z[:, None, t])
        triple = torch.cat([dh_all, dh_all, dh_all], -1)
        return triple * torch.cat([to_r, to_z, dn], -1)[:, None], triple * hidden_factors[:, None]
    a = gi + gh
    act = _tanh(a) if mode == "RNN_TANH" else torch.relu(a)
    slope = 1 - act * act if mode == "RNN_TANH" else (a > 0).to(a.dtype)  # (n, T, H)
    for t in order:
        dh = dout[:, :, t] + dh_next
        step = dh_all[:, :, t] = dh * slope[:, None, t]
        dh_next = step @ w_hh
    return dh_all, dh_all


def _write_traces(layer: nn.RNNBase, traces: list[_Trace], grads: Any, out: dict) -> None:
    """Weight gradients from the backprops ``(n, v, ...)`` of each trace's pre-activations,
    in :func:`_wanted` order."""
    for trace in traces:
        dgi = next(grads) if layer.mode == "GRU" else None  # (n, v, T, G)
        dgh = torch.stack([next(grads) for _ in trace.gh], 2)  # (n, v, T, G), processing order
        dproj = [next(grads) for _ in trace.projected]
        if dgi is None:  # back to time order, as trace.x
            dgi = dgh.flip(2) if trace.suffix.endswith("_reverse") else dgh
        _write(out, "weight_ih" + trace.suffix, dgi, trace.x)
        _write(out, "bias_ih" + trace.suffix, dgi, None)
        _write(out, "weight_hh" + trace.suffix, dgh, torch.stack(trace.h_prev, 1))
        _write(out, "bias_hh" + trace.suffix, dgh, None)
        if dproj:
            _write(out, "weight_hr" + trace.suffix, torch.stack(dproj, 2),
                   torch.stack(trace.raw, 1))


def _write(out: dict, name: str, g: Tensor, a: Tensor | None) -> None:
    """``out[name] (n, v, ...)`` = ``sum_t g^T a`` (a weight) or ``sum_t g`` (a bias),
    summed in ``g``'s dtype and written in ``out[name]``'s; a weight the engine sums
    with other uses' (``out.defer``) is given as the factors ``g``, ``a`` instead."""
    if name not in out:
        return
    if a is not None and isinstance(out, Destinations) and g.shape[1] == 1 and a.dim() == 3 and (
            out.defer(name, g[:, 0], a.detach())):
        return
    dst = out[name]
    into = dst if dst.dtype == g.dtype else g.new_empty(dst.shape)
    if a is None:
        torch.sum(g, dim=2, out=into)  # g (n, v, T, G) -> (n, v, G)
    else:
        sum_outer_into(g, a.detach(), into)  # (n, v, G, I)
    if into is not dst:
        dst.copy_(into)


def _check(layer: nn.RNNBase) -> None:
    """A layer whose weights are read through a parametrization (``weight_norm``,
    ``orthogonal``) is left to its kernel's rule, which gives the weights as the
    kernel reads them (the parametrized ones pulled back through their parametrization
    by the engine) in one pass: the module rule would give the others only."""
    if parametrize.is_parametrized(layer):
        raise Decline("a weight read through a parametrization: the kernel's rule takes it")


RECURRENT = register_module(ModuleSpec((nn.RNN, nn.LSTM, nn.GRU), grad=recurrent,
                                       check=_check, refusal=training_dropout,
                                       multi_output=True, outputs=True))


_MODES = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH",
          torch.rnn_relu: "RNN_RELU"}


def kernel(call: Any, g: list, out: dict) -> None:
    """Per-sample gradients of the weights of one call of a recurrent kernel
    (``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu`` on a padded input) that no
    module rule claims: a layer called again from its own earlier state (``Set2Set``'s
    LSTM, whose state after one step is the next step's initial state), or one called
    on a shared input and state whose rows its readers pair with the samples (that
    first step, pulled back as a derived tensor). The input and states are read as the
    op pairs them with the samples (:meth:`OpCall.front`: ``(n, T, I)`` and ``(n, L *
    D, H)``), ``g`` is one ``(n, v, ...)`` per output (``None``: zeros), and the
    gradients are the recurrent rule's (:func:`recurrent`; for one layer from the
    kernel's outputs as the capture kept them, :func:`_kept`). Also a layer whose
    weight a parametrization rewrites, all its weights at once. Declines a packed sequence,
    a projection (``proj_size``), dropout between layers in training mode, inputs not
    all paired with the samples, and derived inputs beside the weights (the engine
    differentiates those)."""
    args = call.args
    if isinstance(args[1], Tensor) and args[1].dim() == 1 and not args[1].is_floating_point():
        raise Decline("a packed sequence outside its module")
    x, hx, weights, has_biases, layers, dropout, train, bidirectional = args[:8]
    call.only(out, *weights)
    layer = _kernel_layer(_MODES[call.func], list(weights), has_biases, layers, dropout,
                          train, bidirectional)
    states = list(hx) if isinstance(hx, (tuple, list)) else [hx]
    pairings = [call.pairing(t) for t in [x, *states]]
    if not all(_one_each(p) for p in pairings) or not all(
            p is None or _one_each(p) for p in call.out_pairings):
        raise Decline("an input or state not paired one sequence per sample")
    xs, *hs = [call.front(t).squeeze(p.dim + 1) for t, p in zip([x, *states], pairings)]
    given = next(gk for gk in g if gk is not None)  # (n, v, ..., 1, ...) per output
    n, v = given.shape[:2]
    shapes = [(xs.shape[1], (2 if bidirectional else 1) * hs[0].shape[-1]),
              *[tuple(h.shape[1:]) for h in hs]]  # output (T, D * H), states (L * D, H)
    backprops = [given.new_zeros(n, v, *shape) if gk is None else gk.squeeze(p.dim + 2)
                 for gk, p, shape in zip(g, call.out_pairings, shapes)]
    by_name = dict(zip(layer.names, weights))
    named = Destinations({name: out[w] for name, w in by_name.items() if w in out},
                         lambda name, left, right: call.defer(by_name[name], left, right))
    outputs = None if layer.num_layers != 1 else _kept(call, n) or _outputs(
        call.func, layer, xs, hs, weights, has_biases)
    recurrent(layer, (xs, tuple(hs) if layer.mode == "LSTM" else hs[0]), backprops, named,
              outputs)


def _kept(call: Any, n: int) -> list[Tensor] | None:
    """The kernel's outputs as the capture kept them (``KEPT_OUTPUTS``), samples first:
    ``[output (n, T, D * H), h_n (n, D, H), (c_n)]``; ``None`` where they were not kept
    or one changed in place since."""
    outs = call.op.kept_outputs()
    if outs is None or len(outs) != len(call.out_pairings) or not all(
            _one_each(p) for p in call.out_pairings):
        return None
    return [front(o.detach(), p, n).squeeze(p.dim + 1) for o, p in zip(outs, call.out_pairings)]


def _outputs(func: Any, layer: SimpleNamespace, xs: Tensor, hs: list[Tensor],
             weights: list[Tensor], has_biases: bool) -> list[Tensor]:
    """The kernel's outputs ``[output (n, T, D * H), h_n (n, D, H), (c_n)]`` of one layer
    computed again on the inputs and states as the rule reads them (``xs (n, T, I)``,
    ``hs`` each ``(n, D, H)``), samples first, for the rule's path from outputs, where
    the capture did not keep them. One call of the fused kernel, cheaper than
    differentiating the recurrence unrolled."""
    with torch.no_grad():
        states = [h.transpose(0, 1) for h in hs]  # (D, n, H) each, as the kernel takes
        got = func(xs, tuple(states) if layer.mode == "LSTM" else states[0],
                   [w.detach() for w in weights], has_biases, 1, 0.0, False,
                   layer.bidirectional, True)
    return [got[0], *[h.transpose(0, 1) for h in got[1:]]]


def _one_each(lay: Any) -> bool:
    """A pairing of one position per sample, in order (a kernel's sequences)."""
    return isinstance(lay, Batched) and lay.plain


def _kernel_layer(mode: str, weights: list[Tensor], has_biases: bool, layers: int,
                  dropout: float, train: bool, bidirectional: bool) -> SimpleNamespace:
    """The attributes of an ``nn.RNNBase`` the recurrent rule reads, for a kernel's flat
    weights (per layer and direction: ``w_ih, w_hh[, b_ih, b_hh]``); ``names``: each
    weight's name in the layer."""
    directions = 2 if bidirectional else 1
    each = 4 if has_biases else 2
    if len(weights) != layers * directions * each:
        raise Decline("a projection (proj_size)")
    kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")[:each]
    names = [f"{kind}_l{k}" + ("_reverse" if d else "")
             for k in range(layers) for d in range(directions) for kind in kinds]
    layer = SimpleNamespace(mode=mode, num_layers=layers, bidirectional=bidirectional,
                            hidden_size=weights[1].shape[1], proj_size=0, dropout=dropout,
                            training=train, names=names, **dict(zip(names, weights)))
    reason = training_dropout(layer)
    if reason:
        raise Decline(reason)
    return layer


KERNELS = register(OpSpec(tuple(_MODES), grad=kernel, multi_output=True))
KEPT_OUTPUTS.update(KERNELS.funcs)  # (the rule reads the states they return)
