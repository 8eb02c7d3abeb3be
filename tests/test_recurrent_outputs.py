"""The recurrent rule from the layer's own outputs (one layer, dense input): every
step's gates from the states the fused kernel returned and the backward of the
recurrence by its equations, without running the recurrence again. Exact against the
loop in float64, with the batch size equal to the sequence length and the width; an
output changed in place after the call takes the recomputed recurrence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from persample.rules import recurrent as rule

B = T = 5  # batch size, steps and hidden width coincide: no dim is found by its size
H = 5


class Head(nn.Module):
    def __init__(self, rnn: nn.RNNBase, initial: bool, in_place: bool = False):
        super().__init__()
        self.rnn, self.initial, self.in_place = rnn, initial, in_place
        d = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(d * H, 3)
        self.states = nn.Linear(d * H, 3)

    def forward(self, x):  # (B, T, 4)
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        args = ()
        if self.initial:  # initial states from each sample's data
            d = 2 if self.rnn.bidirectional else 1
            h0 = torch.tanh(x[:, :d, :1].expand(x.shape[0], d, H)).transpose(0, 1).contiguous()
            args = ((h0, 0.5 * h0),) if isinstance(self.rnn, nn.LSTM) else (h0,)
        out, state = self.rnn(seq, *args)
        if self.in_place:
            out.mul_(2.0)  # the returned states no longer hold what the kernel computed
        h = state[0] if isinstance(state, tuple) else state  # (D, B, H)
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        return self.head(out.sum(1)) + self.states(h.transpose(0, 1).flatten(1))


def _model(kind: str, bidirectional: bool, batch_first: bool, initial: bool,
           in_place: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cls, extra = {"lstm": (nn.LSTM, {}), "gru": (nn.GRU, {}),
                  "tanh": (nn.RNN, {"nonlinearity": "tanh"}),
                  "relu": (nn.RNN, {"nonlinearity": "relu"})}[kind]
    rnn = cls(4, H, batch_first=batch_first, bidirectional=bidirectional, **extra)
    return Head(rnn, initial, in_place).double()


def _check(model, method="rules"):
    torch.manual_seed(1)
    x, y = torch.randn(B, T, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss()
    fast = persample.per_sample_grads(model, x, y, loss, method=method)
    slow = persample.loop_per_sample_grads(model, x, y, loss)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh", "relu"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("initial", [False, True])
def test_from_outputs_is_exact(monkeypatch, kind, bidirectional, batch_first, initial):
    def no_rerun(*args, **kwargs):
        raise AssertionError("the recurrence was run again")

    monkeypatch.setattr(rule, "_unrolled", no_rerun)
    _check(_model(kind, bidirectional, batch_first, initial))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_an_output_changed_in_place_runs_the_recurrence_again(monkeypatch, kind):
    ran = []
    unrolled = rule._unrolled
    monkeypatch.setattr(rule, "_unrolled", lambda *a: ran.append(1) or unrolled(*a))
    _check(_model(kind, False, True, True, in_place=True))
    assert ran


def test_the_parameter_jacobian_from_outputs(monkeypatch):
    """Several cotangents per sample (``v = 3`` outputs): the states are each sample's,
    the backward runs on ``(n, v, H)``."""
    monkeypatch.setattr(rule, "_unrolled", lambda *a: (_ for _ in ()).throw(AssertionError))
    model = _model("lstm", True, True, True)
    x = torch.randn(B, T, 4, dtype=torch.float64)
    fast = persample.param_jacobian(model, x, method="rules")
    slow = persample.loop_param_jacobian(model, x)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-9, atol=1e-12)


class _Cells(nn.Module):
    """A recurrence without biases whose loss also reads the final cell state (an LSTM's
    ``c_n``: its own backprop enters the adjoint)."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        d = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(d * H, 3)

    def forward(self, x):  # (B, T, 4)
        out, state = self.rnn(x)
        y = self.head(out[:, -1])
        if isinstance(state, tuple):  # (h_n, c_n), each (D, B, H)
            y = y + state[1].sum(0)[:, :3] ** 2
        return y


@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_without_biases_and_with_the_final_cell_state(monkeypatch, kind, bidirectional):
    monkeypatch.setattr(rule, "_unrolled", lambda *a: (_ for _ in ()).throw(AssertionError))
    torch.manual_seed(0)
    cls, extra = {"lstm": (nn.LSTM, {}), "gru": (nn.GRU, {}),
                  "tanh": (nn.RNN, {"nonlinearity": "tanh"})}[kind]
    rnn = cls(4, H, batch_first=True, bidirectional=bidirectional, bias=False, **extra)
    _check(_Cells(rnn).double())
