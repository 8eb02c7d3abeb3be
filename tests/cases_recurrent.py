"""Cases (see ``cases.py``) for nn.RNN, nn.LSTM, nn.GRU, nn.MultiheadAttention and the
Transformer layers, in both layouts (``batch_first`` or not).

The models take batch-first inputs (the library's contract) and transpose inside
when their sequence module is sequence-first. Sequences of length ``N`` (the
batch size) make a layout bug visible: dim 0 and dim 1 then have the same size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import (
    PackedSequence,
    pack_padded_sequence,
    pack_sequence,
    pad_packed_sequence,
)

from cases import N, case, classes, cross_entropy, ids, per_sample_squares, randn, regression


def lengths_of(x: Tensor) -> Tensor:
    """Each sample's own length, from its data: 1 to T steps."""
    return 1 + (x[:, 0, 0].detach().abs() * 7).long() % x.shape[1]


def sorted_by_length(x: Tensor) -> Tensor:
    """The samples of ``x`` reordered longest first (``enforce_sorted=True`` needs it)."""
    return x[torch.argsort(lengths_of(x), descending=True, stable=True)]


class Recurrent(nn.Module):
    """``rnn`` over a batch-first ``(B, T, F)`` input, then a Linear head on the summed
    outputs and final states.

    ``packed``: ``""`` (padded), ``"unsorted"`` (``enforce_sorted=False``), ``"sorted"``
    (``enforce_sorted=True``: the batch comes longest first) or ``"by-hand"`` (the
    model sorts the samples itself with ``index_select``, packs them sorted, and puts
    the outputs and final states back in order). ``initial_state``: ``""`` (none),
    ``"sample"`` (from each sample's data), ``"zeros"`` (made for the batch, shared)
    or ``"learned"`` (a parameter expanded to the batch)."""

    def __init__(self, rnn: nn.RNNBase, packed: str = "", initial_state: str = ""):
        super().__init__()
        self.rnn, self.packed, self.initial_state = rnn, packed, initial_state
        directions = 2 if rnn.bidirectional else 1
        width = (rnn.proj_size or rnn.hidden_size) * directions
        self.head = nn.Linear(width, 3)
        if initial_state == "learned":
            self.h0 = nn.Parameter(torch.randn(rnn.num_layers * directions, 1,
                                               rnn.proj_size or rnn.hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        lengths, order = lengths_of(x), None
        if self.packed == "by-hand":
            order = torch.argsort(lengths, descending=True, stable=True)
            x, lengths = x.index_select(0, order), lengths[order]
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        if self.packed:
            seq = pack_padded_sequence(seq, lengths, batch_first=self.rnn.batch_first,
                                       enforce_sorted=self.packed != "unsorted")
        out, state = self.rnn(seq, self._initial_state(x))
        if self.packed:
            out = pad_packed_sequence(out, batch_first=True)[0]
        elif not self.rnn.batch_first:
            out = out.transpose(0, 1)
        h_n = state[0] if isinstance(state, tuple) else state  # (L * D, B, H_out)
        if order is not None:  # back to the samples' order
            back = torch.argsort(order)
            out, h_n = out.index_select(0, back), h_n.index_select(1, back)
        return self.head(out.sum(1)) + h_n.transpose(0, 1).sum((1, 2))[:, None]

    def _initial_state(self, x: Tensor) -> Any:
        r, kind = self.rnn, self.initial_state
        stack = r.num_layers * (2 if r.bidirectional else 1)
        width = r.proj_size or r.hidden_size
        if not kind:
            return None
        if kind == "sample":
            h0 = torch.tanh(x[:, :1, :1]).reshape(1, -1, 1).expand(stack, -1, width)
        elif kind == "zeros":
            h0 = torch.zeros(stack, x.shape[0], width, dtype=x.dtype)
        else:
            h0 = self.h0.expand(-1, x.shape[0], -1)
        if isinstance(r, nn.LSTM):
            return h0, 0.5 * h0[..., :1].expand(-1, -1, r.hidden_size)
        return h0


class PackedInput(nn.Module):
    """``rnn`` on a ``PackedSequence`` given to the model itself (Opacus' recurrent
    tests): the head reads the padded outputs and the final states."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(rnn.hidden_size * directions, 3)

    def forward(self, packed: PackedSequence) -> Tensor:
        out, state = self.rnn(packed)
        padded = pad_packed_sequence(out, batch_first=True)[0]  # (B, T, D * H)
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(padded.sum(1)) + h_n.sum(0).sum(1, keepdim=True)


def packed_sequences(n: int, features: int, longest_first: bool) -> tuple[PackedSequence]:
    """``(PackedSequence,)`` of ``n`` sequences of lengths 1 to ``N``, in no order of
    length unless ``longest_first``."""
    lengths = [1 + (2 * i + 1) % N for i in range(n)]
    if longest_first:
        lengths.sort(reverse=True)
    return (pack_sequence([randn(t, features) for t in lengths],
                          enforce_sorted=longest_first),)


class LSTMClassifier(nn.Module):
    """A text classifier: Embedding, 2-layer bidirectional LSTM, Linear on the last state."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 4, padding_idx=0)
        self.lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True)
        self.out = nn.Linear(10, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        _, (h, _) = self.lstm(self.emb(tokens).transpose(0, 1))  # h: (4, B, 5)
        return self.out(torch.cat([h[-2], h[-1]], 1))


def recurrent(cls: type, packed: str = "", initial_state: str = "", **kwargs):
    return lambda: Recurrent(cls(3, 4, **kwargs), packed, initial_state)


def rnn_case(*args, **kwargs) -> dict[str, Any]:
    """A case whose model torch.func cannot batch (``method="vmap"`` refuses it)."""
    return case(*args, **kwargs, vmap=False)


def padding_mask(x: Tensor) -> Tensor:
    """``(B, T)`` keys to ignore, from each sample's own data; never the first key."""
    pad = x[:, :, 0].detach() > 0.5
    pad[:, 0] = False
    return pad


class Attention(nn.Module):
    """Stock nn.MultiheadAttention on batch-first inputs, in either of its layouts."""

    def __init__(self, batch_first: bool, kdim: int | None = None, mask: str = "",
                 use_weights: bool = False, average: bool = True, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim,
                                          **kwargs)
        self.mask, self.use_weights, self.average = mask, use_weights, average
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        kv = x if self.attn.kdim == 8 else x[..., : self.attn.kdim]
        n, t = x.shape[:2]
        kwargs = {}
        if "causal" in self.mask:
            kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(t).to(x)
        if "bool" in self.mask:  # True: not allowed
            kwargs["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(1)
        if "heads" in self.mask:  # a 3-d float mask, (B * heads, T, T), from each sample's data
            m = (x[:, :, :1] - x[:, :, 1:2].transpose(1, 2)).detach()  # (B, T, T)
            kwargs["attn_mask"] = torch.stack([m, -m], 1).flatten(0, 1)
        if "padding" in self.mask:
            kwargs["key_padding_mask"] = padding_mask(x)
        q, kv = (x, kv) if self.attn.batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
        y, w = self.attn(q, kv, kv, need_weights=self.use_weights,
                         average_attn_weights=self.average, **kwargs)
        y = y if self.attn.batch_first else y.transpose(0, 1)
        out = self.head(y.mean(1))
        return out + w.flatten(1)[:, :3] if self.use_weights else out


class Encoder(nn.Module):
    """nn.TransformerEncoder of 2 layers, sequence-first or batch-first, with masks."""

    def __init__(self, batch_first: bool, norm_first: bool = False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8),
                                         enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        pad = padding_mask(x)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1]).to(x)
        seq = x if self.enc.layers[0].self_attn.batch_first else x.transpose(0, 1)
        y = self.enc(seq, mask=causal, src_key_padding_mask=pad, is_causal=True)
        y = y if self.enc.layers[0].self_attn.batch_first else y.transpose(0, 1)
        return self.head(y.mean(1))


class Decoder(nn.Module):
    """nn.TransformerDecoderLayer with a memory of another length, either layout."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(8, 2, 12, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        tgt, memory = x, torch.tanh(x[:, :2] * 2)  # (B, T, 8), (B, 2, 8)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1]).to(x)
        if not self.dec.self_attn.batch_first:
            tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
        y = self.dec(tgt, memory, tgt_mask=causal)
        y = y if self.dec.self_attn.batch_first else y.transpose(0, 1)
        return self.head(y.mean(1))


class FullTransformer(nn.Module):
    """nn.Transformer (encoder and decoder), sequence-first."""

    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(8, 2, 1, 1, 12, dropout=0.0)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        s = x.transpose(0, 1)
        return self.head(self.t(s, s[:2]).mean(0))


RECURRENT_CASES: list[dict[str, Any]] = [
    # nn.RNN / nn.LSTM / nn.GRU: sequence length N (= batch size) unless stated
    rnn_case("rnn-tanh", recurrent(nn.RNN), lambda n: randn(n, N, 3)),
    rnn_case("rnn-relu-batch-first-nobias",
         recurrent(nn.RNN, nonlinearity="relu", batch_first=True, bias=False),
         lambda n: randn(n, 4, 3)),
    rnn_case("rnn-2-layers-bidirectional", recurrent(nn.RNN, num_layers=2, bidirectional=True),
         lambda n: randn(n, 4, 3)),
    rnn_case("lstm", recurrent(nn.LSTM), lambda n: randn(n, N, 3), classes, cross_entropy),
    rnn_case("lstm-batch-first-2-layers", recurrent(nn.LSTM, batch_first=True, num_layers=2),
         lambda n: randn(n, 5, 3)),
    rnn_case("lstm-bidirectional-initial-state",
         recurrent(nn.LSTM, initial_state="sample", bidirectional=True), lambda n: randn(n, 4, 3)),
    rnn_case("lstm-proj-size-2-layers-bidirectional",
         recurrent(nn.LSTM, proj_size=2, num_layers=2, bidirectional=True, batch_first=True),
         lambda n: randn(n, 4, 3)),
    rnn_case("lstm-packed", recurrent(nn.LSTM, packed="unsorted"), lambda n: randn(n, 4, 3)),
    rnn_case("lstm-packed-bidirectional-2-layers-batch-first",
         recurrent(nn.LSTM, packed="unsorted", bidirectional=True, num_layers=2,
                   batch_first=True),
         lambda n: randn(n, 4, 3), classes, cross_entropy),
    rnn_case("gru", recurrent(nn.GRU), lambda n: randn(n, N, 3)),
    rnn_case("gru-batch-first-bidirectional-nobias",
         recurrent(nn.GRU, batch_first=True, bidirectional=True, bias=False),
         lambda n: randn(n, 4, 3), regression, per_sample_squares),
    rnn_case("gru-packed-initial-state-2-layers",
         recurrent(nn.GRU, packed="unsorted", initial_state="sample", num_layers=2),
         lambda n: randn(n, 5, 3)),
    # packed sorted (enforce_sorted=True: the final states come in the packed order), sorted
    # by the model itself, zeros or learned initial states, the PackedSequence as the input
    rnn_case("gru-packed-sorted-batch-first", recurrent(nn.GRU, packed="sorted", batch_first=True),
             lambda n: sorted_by_length(randn(n, N, 3))),
    rnn_case("rnn-packed-sorted-bidirectional",
             recurrent(nn.RNN, packed="sorted", bidirectional=True),
             lambda n: sorted_by_length(randn(n, 4, 3))),
    rnn_case("lstm-packed-sorted-2-layers-zeros-state",
             recurrent(nn.LSTM, packed="sorted", num_layers=2, initial_state="zeros"),
             lambda n: sorted_by_length(randn(n, N, 3)), classes, cross_entropy),
    rnn_case("lstm-packed-by-hand-bidirectional-sample-state",
             recurrent(nn.LSTM, packed="by-hand", bidirectional=True, initial_state="sample",
                       batch_first=True),
             lambda n: randn(n, N, 3)),
    rnn_case("gru-zeros-state-2-layers-bidirectional",
             recurrent(nn.GRU, initial_state="zeros", num_layers=2, bidirectional=True),
             lambda n: randn(n, N, 3)),
    rnn_case("rnn-learned-state-batch-first", recurrent(nn.RNN, initial_state="learned",
                                                        batch_first=True),
             lambda n: randn(n, 4, 3)),
    rnn_case("lstm-text-classifier", LSTMClassifier, lambda n: ids(13, n, 6), classes,
         cross_entropy),
    # nn.MultiheadAttention, both layouts, masks, separate key/value projections
    case("mha-sequence-first", lambda: Attention(False), lambda n: randn(n, N, 8),
         classes, cross_entropy),
    case("mha-sequence-first-kdim-padding-mask", lambda: Attention(False, kdim=5, mask="padding"),
         lambda n: randn(n, 4, 8)),
    case("mha-batch-first-kdim-causal", lambda: Attention(True, kdim=6, mask="causal"),
         lambda n: randn(n, 4, 8)),
    case("mha-3d-mask-weights-used", lambda: Attention(True, mask="heads", use_weights=True),
         lambda n: randn(n, 4, 8)),
    case("mha-sequence-first-3d-mask-bias-kv",
         lambda: Attention(False, mask="heads padding", add_bias_kv=True, add_zero_attn=True),
         lambda n: randn(n, N, 8)),
    case("mha-per-head-weights-bool-mask-eval-dropout",
         lambda: Attention(True, mask="bool", use_weights=True, average=False,
                           dropout=0.5).eval(),
         lambda n: randn(n, 4, 8)),
    case("mha-nobias", lambda: Attention(True, bias=False, mask="padding"),
         lambda n: randn(n, 4, 8)),
    # Transformer layers end to end
    case("transformer-encoder-sequence-first", lambda: Encoder(False), lambda n: randn(n, N, 8),
         classes, cross_entropy),
    case("transformer-encoder-batch-first-norm-first", lambda: Encoder(True, norm_first=True),
         lambda n: randn(n, 4, 8)),
    case("transformer-decoder-layer-sequence-first", lambda: Decoder(False),
         lambda n: randn(n, N, 8)),
    case("transformer-decoder-layer-batch-first", lambda: Decoder(True), lambda n: randn(n, 4, 8)),
    case("transformer-full-sequence-first", FullTransformer, lambda n: randn(n, N, 8)),
]

# The PackedSequence as the model's own input (``model(packed)``): tests that slice or
# measure a tensor input do not apply, so these are run by ``test_stock_layers.py``.
PACKED_INPUT_CASES: list[dict[str, Any]] = [
    rnn_case("lstm-packed-input-2-layers", lambda: PackedInput(nn.LSTM(3, 4, num_layers=2)),
             lambda n: packed_sequences(n, 3, longest_first=False)),
    rnn_case("gru-packed-input-sorted-bidirectional",
             lambda: PackedInput(nn.GRU(3, 4, bidirectional=True)),
             lambda n: packed_sequences(n, 3, longest_first=True)),
    rnn_case("rnn-packed-input-2-layers-bidirectional-nobias",
             lambda: PackedInput(nn.RNN(3, 4, num_layers=2, bidirectional=True, bias=False)),
             lambda n: packed_sequences(n, 3, longest_first=False), classes, cross_entropy),
]
