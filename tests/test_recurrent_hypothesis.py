"""The recurrent rule against the loop over drawn configurations (with hypothesis).

nn.RNN (tanh, relu), nn.LSTM (with and without ``proj_size``) and nn.GRU; 1 to 3
layers, one or two directions, ``batch_first`` either way, with or without bias,
an initial state or not, padded or packed sequences of per-sample lengths, and
a loss on the outputs, on the final states, or on both. Float64, tight
tolerances, ``method="rules"`` (torch.func cannot batch these modules at all).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from persample import loop_param_jacobian, loop_per_sample_grads, param_jacobian, per_sample_grads


@st.composite
def rnn_configs(draw):
    kind = draw(st.sampled_from(["RNN_TANH", "RNN_RELU", "LSTM", "LSTM_PROJ", "GRU"]))
    hidden = draw(st.integers(1, 4))
    return {
        "kind": kind,
        "input_size": draw(st.integers(1, 3)),
        "hidden_size": hidden,
        "proj_size": draw(st.integers(1, hidden - 1)) if kind == "LSTM_PROJ" and hidden > 1 else 0,
        "num_layers": draw(st.integers(1, 3)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "initial_state": draw(st.booleans()),
        "packed": draw(st.booleans()),
        "batch": draw(st.integers(1, 4)),
        "steps": draw(st.integers(1, 5)),
        "use": draw(st.sampled_from(["output", "state", "both"])),
        "seed": draw(st.integers(0, 2**16)),
    }


class Model(nn.Module):
    """The RNN on a batch-first input ``(B, T, F)`` whose first feature sets each length."""

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

    def forward(self, x: Tensor) -> Tensor:
        cfg, rnn = self.cfg, self.rnn
        seq = x if rnn.batch_first else x.transpose(0, 1)
        if cfg["packed"]:
            lengths = 1 + (x[:, 0, 0].detach().abs() * 5).long() % x.shape[1]
            seq = pack_padded_sequence(seq, lengths, batch_first=rnn.batch_first,
                                       enforce_sorted=False)
        hx = self.initial_state(x) if cfg["initial_state"] else None
        out, state = rnn(seq, hx)
        if cfg["packed"]:
            out = pad_packed_sequence(out, batch_first=True)[0]
        elif not rnn.batch_first:
            out = out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        from_states = sum(s.transpose(0, 1).flatten(1).sum(1) for s in states)  # (B,)
        from_output = out.flatten(1).sin().sum(1)  # (B,)
        use = cfg["use"]
        y = from_output if use == "output" else from_states if use == "state" else (
            from_output + from_states)
        return torch.stack([y, y.square()], 1)  # (B, 2)

    def initial_state(self, x: Tensor):
        rnn = self.rnn
        stack = rnn.num_layers * (2 if rnn.bidirectional else 1)
        h = torch.tanh(x[:, :1, :1]).reshape(1, -1, 1)  # (1, B, 1), from each sample
        h0 = h.expand(stack, -1, rnn.proj_size or rnn.hidden_size)
        return (h0, (h * 0.5).expand(stack, -1, rnn.hidden_size)) if isinstance(
            rnn, nn.LSTM) else h0


def build(cfg: dict):
    torch.manual_seed(cfg["seed"])
    model = Model(cfg).double()
    x = torch.randn(cfg["batch"], cfg["steps"], cfg["input_size"], dtype=torch.float64)
    return model, x, torch.randn(cfg["batch"], 2, dtype=torch.float64)


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


@settings(max_examples=40, deadline=None)
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
