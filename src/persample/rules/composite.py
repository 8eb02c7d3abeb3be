"""Ops run as the ops they are made of: batched products with an added term and the
recurrent cells.

Under the capture each of these runs as its plain ops (the same arithmetic, the same
values up to rounding), so that a parameter read by one of them takes the rules of
those ops (``bmm``, ``F.linear``, an elementwise shift or scale) and a parameter
broadcast into the batch first (RecurrentGemma's RG-LRU gates: ``baddbmm`` of a bias,
the activations and a weight per head; a learned initial state of a ``GRUCell``
decoder) is a derived tensor pulled back through them:

- ``baddbmm(C, A, B, beta, alpha) = beta C + alpha (A @ B)``, ``addbmm`` the same summed
  over the product's batch dim (``torch.baddbmm``'s definition);
- ``gru_cell``, ``lstm_cell``, ``rnn_tanh_cell``, ``rnn_relu_cell``: the equations of
  ``nn.GRUCell``, ``nn.LSTMCell`` and ``nn.RNNCell`` (Cho et al. 2014; Hochreiter &
  Schmidhuber 1997, with the forget gate of Gers et al. 2000), gates in PyTorch's order.

An in-place call (``baddbmm_``) or one with ``out=`` runs whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .spec import OpSpec, register


def baddbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta=1, alpha=1,
            out: Tensor | None = None) -> Tensor:
    """``beta * input + alpha * bmm(batch1, batch2)``; ``beta = 0`` ignores ``input``."""
    if out is not None:
        return NotImplemented
    product = torch.bmm(batch1, batch2)  # (b, n, p)
    return _added(input, product, beta, alpha)


def addbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta=1, alpha=1,
           out: Tensor | None = None) -> Tensor:
    """``beta * input + alpha * sum_b batch1[b] @ batch2[b]``."""
    if out is not None:
        return NotImplemented
    product = torch.bmm(batch1, batch2).sum(0)  # (n, p)
    return _added(input, product, beta, alpha)


def _added(input: Tensor, product: Tensor, beta, alpha) -> Tensor:
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # (torch ignores input then, NaN included)
        return product.expand(torch.broadcast_shapes(input.shape, product.shape)).clone()
    return (input if beta == 1 else input * beta) + product


def _gates(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None,
           b_hh: Tensor | None) -> tuple[Tensor, Tensor]:
    return F.linear(x, w_ih, b_ih), F.linear(h, w_hh, b_hh)  # (b, k * hidden) each


def gru_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
             b_hh: Tensor | None = None) -> Tensor:
    """``nn.GRUCell``: ``r, z = sigmoid(.)``, ``n = tanh(W_in x + b_in + r (W_hn h +
    b_hn))``, ``h' = (1 - z) n + z h``."""
    gi, gh = _gates(input, hx, w_ih, w_hh, b_ih, b_hh)
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return n + z * (hx - n)


def lstm_cell(input: Tensor, hx, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
              b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``nn.LSTMCell``: gates ``i, f, g, o``; ``c' = f c + i g``, ``h' = o tanh(c')``."""
    h, c = hx
    gi, gh = _gates(input, h, w_ih, w_hh, b_ih, b_hh)
    i, f, g, o = (gi + gh).chunk(4, -1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def rnn_tanh_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> Tensor:
    """``nn.RNNCell(nonlinearity="tanh")``: ``h' = tanh(W_ih x + b_ih + W_hh h + b_hh)``."""
    gi, gh = _gates(input, hx, w_ih, w_hh, b_ih, b_hh)
    return torch.tanh(gi + gh)


def rnn_relu_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> Tensor:
    """``nn.RNNCell(nonlinearity="relu")``."""
    gi, gh = _gates(input, hx, w_ih, w_hh, b_ih, b_hh)
    return torch.relu(gi + gh)


BADDBMM = register(OpSpec((torch.baddbmm,), expand=baddbmm))
ADDBMM = register(OpSpec((torch.addbmm,), expand=addbmm))
GRU_CELL = register(OpSpec((torch.gru_cell,), expand=gru_cell))
LSTM_CELL = register(OpSpec((torch.lstm_cell,), expand=lstm_cell))
RNN_TANH_CELL = register(OpSpec((torch.rnn_tanh_cell,), expand=rnn_tanh_cell))
RNN_RELU_CELL = register(OpSpec((torch.rnn_relu_cell,), expand=rnn_relu_cell))
