"""The recurrent rule against the loop over drawn configurations (with hypothesis).

nn.RNN (tanh, relu), nn.LSTM (with and without ``proj_size``) and nn.GRU; 1 to 3
layers, one or two directions, ``batch_first`` either way, with or without bias;
padded sequences, or packed ones of per-sample lengths: unsorted
(``enforce_sorted=False``), sorted (``enforce_sorted=True`` on a batch that comes
longest first), sorted by the model itself (``index_select`` before packing, and back
after), or the ``PackedSequence`` given to the model as its input; no initial state,
one from each sample's data, zeros made for the batch (not with an unsorted packed
sequence), or (padded) a learned one; a
loss on the outputs, on the final states, or on both. Float64, tight tolerances,
``method="rules"`` (torch.func cannot batch these modules at all).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from persample import loop_param_jacobian, loop_per_sample_grads, param_jacobian, per_sample_grads

PACKED = ["", "unsorted", "sorted", "by-hand", "input-unsorted", "input-sorted"]


@st.composite
def rnn_configs(draw):
    kind = draw(st.sampled_from(["RNN_TANH", "RNN_RELU", "LSTM", "LSTM_PROJ", "GRU"]))
    hidden = draw(st.integers(1, 4))
    packed = draw(st.sampled_from(PACKED))
    # zeros given with an unsorted packed sequence are reordered by the layer with the
    # sort's indices, which the rules refuse (test_stock_layers.py); a learned state
    # takes the kernel's own per-sample VJP, which packed rows do not fit
    states = ["", "sample"] + ([] if "unsorted" in packed else ["zeros"]) + (
        [] if packed else ["learned"])
    return {
        "kind": kind,
        "input_size": draw(st.integers(1, 3)),
        "hidden_size": hidden,
        "proj_size": draw(st.integers(1, hidden - 1)) if kind == "LSTM_PROJ" and hidden > 1 else 0,
        "num_layers": draw(st.integers(1, 3)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "initial_state": draw(st.sampled_from(states)),
        "packed": packed,
        "batch": draw(st.integers(1, 4)),
        "steps": draw(st.integers(1, 5)),
        "use": draw(st.sampled_from(["output", "state", "both"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def lengths_of(x: Tensor) -> Tensor:
    """Each sample's length from its first feature: 1 to T steps."""
    return 1 + (x[:, 0, 0].detach().abs() * 5).long() % x.shape[1]


class Model(nn.Module):
    """The RNN on a batch-first input ``(B, T, F)`` whose first feature sets each length,
    or on a ``PackedSequence`` and a ``(B,)`` tensor that sets each initial state."""

    def __init__(self, cfg: dict):
        super().__init__()
        cls = {"RNN_TANH": nn.RNN, "RNN_RELU": nn.RNN, "LSTM": nn.LSTM, "LSTM_PROJ": nn.LSTM,
               "GRU": nn.GRU}[cfg["kind"]]
        kwargs = {"nonlinearity": "relu"} if cfg["kind"] == "RNN_RELU" else {}
        if cfg["proj_size"]:
            kwargs["proj_size"] = cfg["proj_size"]
        self.rnn = cls(cfg["input_size"], cfg["hidden_size"], num_layers=cfg["num_layers"],
                       bidirectional=cfg["bidirectional"], batch_first=cfg["batch_first"],
                       bias=cfg["bias"], **kwargs)
        self.cfg = cfg
        if cfg["initial_state"] == "learned":
            self.h0 = nn.Parameter(torch.randn(self.stack, 1, self.width))

    @property
    def stack(self) -> int:
        return self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)

    @property
    def width(self) -> int:
        return self.rnn.proj_size or self.rnn.hidden_size

    def forward(self, x: Tensor | PackedSequence, first: Tensor | None = None) -> Tensor:
        cfg, rnn = self.cfg, self.rnn
        packed, order = cfg["packed"], None
        if isinstance(x, PackedSequence):
            seq, n = x, int(x.batch_sizes[0])
        else:
            first, n, lengths = x[:, 0, 0], x.shape[0], lengths_of(x)
            if packed == "by-hand":
                order = torch.argsort(lengths, descending=True, stable=True)
                x, first = x.index_select(0, order), first.index_select(0, order)
                lengths = lengths[order]
            seq = x if rnn.batch_first else x.transpose(0, 1)
            if packed:
                seq = pack_padded_sequence(seq, lengths, batch_first=rnn.batch_first,
                                           enforce_sorted=packed != "unsorted")
        out, state = rnn(seq, self.initial_state(first, n))
        if packed:
            out = pad_packed_sequence(out, batch_first=True)[0]
        elif not rnn.batch_first:
            out = out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        if order is not None:  # back to the samples' order
            back = torch.argsort(order)
            out, states = out.index_select(0, back), [s.index_select(1, back) for s in states]
        from_states = sum(s.transpose(0, 1).flatten(1).sum(1) for s in states)  # (B,)
        from_output = out.flatten(1).sin().sum(1)  # (B,)
        use = cfg["use"]
        y = from_output if use == "output" else from_states if use == "state" else (
            from_output + from_states)
        return torch.stack([y, y.square()], 1)  # (B, 2)

    def initial_state(self, first: Tensor, n: int):
        """``(h0, c0)`` or ``h0`` ``(L * D, n, H)`` of the drawn kind, or ``None``."""
        kind, rnn = self.cfg["initial_state"], self.rnn
        if not kind:
            return None
        if kind == "learned":
            h0 = self.h0.expand(-1, n, -1)
        else:  # from each sample's first feature, or zeros made for the batch
            h = (torch.tanh(first).reshape(1, -1, 1) if kind == "sample"
                 else torch.zeros(1, n, 1, dtype=first.dtype))
            h0 = h.expand(self.stack, -1, self.width)
        if not isinstance(rnn, nn.LSTM):
            return h0
        return h0, (0.5 * h0[..., :1]).expand(-1, -1, rnn.hidden_size)


def build(cfg: dict):
    """``(model, inputs, targets)``; a batch longest first where the model packs it sorted."""
    torch.manual_seed(cfg["seed"])
    model = Model(cfg).double()
    x = torch.randn(cfg["batch"], cfg["steps"], cfg["input_size"], dtype=torch.float64)
    if cfg["packed"] in ("sorted", "input-sorted"):
        x = x[torch.argsort(lengths_of(x), descending=True, stable=True)]
    inputs = x
    if cfg["packed"].startswith("input"):
        packed = pack_padded_sequence(x, lengths_of(x), batch_first=True,
                                      enforce_sorted=cfg["packed"] == "input-sorted")
        inputs = (packed, x[:, 0, 0].clone())
    return model, inputs, torch.randn(cfg["batch"], 2, dtype=torch.float64)


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


@settings(max_examples=50, deadline=None)
@given(cfg=rnn_configs())
def test_recurrent_rule_matches_loop(cfg):
    model, x, y = build(cfg)
    got = per_sample_grads(model, x, y, loss_fn, method="rules")
    want = loop_per_sample_grads(model, x, y, loss_fn)
    assert list(got) == list(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=10, deadline=None)
@given(cfg=rnn_configs())
def test_recurrent_rule_param_jacobian_matches_loop(cfg):
    """Several cotangents per sample (v = 2) through the same rule."""
    model, x, _ = build(cfg)
    got = param_jacobian(model, x, method="rules")
    want = loop_param_jacobian(model, x)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
