"""Stock layers in every configuration, exact on the rules against the loop.

Recurrent layers on packed sequences (sorted, unsorted, sorted by the model, given as
the model's own input), with zeros or per-sample initial states; ``F.instance_norm``
with running statistics made outside the model, or updated twice in one forward;
``nn.Transformer`` with several layers, masks, ``enable_nested_tensor``, eval mode;
``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``. Each through
``battery.check``: per-sample gradients, norms (total and per parameter) and the DP step
(noise 0) against the loop, the path ``supported`` reports for each parameter, and the
model left unchanged. Where PyTorch itself computes something a batch under the
capture cannot (the encoder's nested-tensor fast path for a sample alone), or where
samples are paired with other samples' states, the rules refuse and ``auto`` is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from battery import assert_grads_equal, check, module_paths
from cases import BY_ID, build, randn
from cases_recurrent import PACKED_INPUT_CASES, Recurrent, lengths_of
from persample import (
    LossNotPerSampleError,
    NeedsWholeModel,
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grads,
)
from persample.batch import Batched, Mixed
from persample.batch.layouts import indexed
from persample.capture import Capture
from persample.rules import module_front


def per_sample_loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).flatten(1).sum(1)


# ---------------------------------------------------------------------------
# recurrent layers


RECURRENT = [BY_ID[i] for i in (
    "gru-packed-sorted-batch-first", "rnn-packed-sorted-bidirectional",
    "lstm-packed-sorted-2-layers-zeros-state", "lstm-packed-by-hand-bidirectional-sample-state",
    "gru-zeros-state-2-layers-bidirectional")] + PACKED_INPUT_CASES


@pytest.mark.parametrize("c", RECURRENT, ids=[c["id"] for c in RECURRENT])
def test_recurrent_layers_on_their_module_rule(c):
    """Packed sequences sorted (the final states come in the packed order), sorted by
    the model, given as the model's input; zeros as the initial state: the recurrent
    layer on its module rule, its head on the linear rule, everything exact."""
    model, inputs, targets = build(c)
    check(model, inputs, targets, c["loss_fn"]("sum"),
          paths=module_paths(model, {"rnn": "module rule", "head": "rule"}))


@pytest.mark.parametrize("c", PACKED_INPUT_CASES[:2], ids=[c["id"] for c in
                                                           PACKED_INPUT_CASES[:2]])
def test_packed_input_param_jacobian_and_chunks(c):
    """The model's own PackedSequence: its samples are its sequences, in the order of
    ``sorted_indices``; two outputs per sample, and chunks of the batch."""
    model, inputs, targets = build(c, 4)
    assert_grads_equal(param_jacobian(model, inputs, method="rules"),
                       loop_param_jacobian(model, inputs))
    loss_fn = c["loss_fn"]("mean")
    want = loop_per_sample_grads(model, inputs, targets, loss_fn)
    assert_grads_equal(per_sample_grads(model, inputs, targets, loss_fn, method="rules",
                                        chunk_size=3), want)


def test_zeros_reordered_by_an_unsorted_packing_are_refused_then_exact():
    """Zeros given as the initial state of an unsorted packed sequence reach the kernel
    reordered by the layer (the sort's indices): the module rule cannot tell how the
    input it gets pairs with the samples, so the rules refuse, naming the layer, and
    ``auto`` takes an exact method."""
    torch.manual_seed(0)
    model = Recurrent(nn.GRU(3, 4, num_layers=2), packed="unsorted", initial_state="zeros")
    x, y = randn(3, 3, 3), randn(3, 3)
    want = loop_per_sample_grads(model, x, y, per_sample_loss)
    with pytest.raises(NeedsWholeModel, match="module 'rnn'"):
        per_sample_grads(model, x, y, per_sample_loss, method="rules")
    with pytest.warns(UserWarning, match="rules cannot"):
        got = per_sample_grads(model, x, y, per_sample_loss)
    assert_grads_equal(got, want)


class OtherSamplesStates(nn.Module):
    """Sorts the samples by length and packs them sorted, but gives the initial states
    in the samples' own order: sample ``order[j]`` runs from sample ``j``'s state."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.RNN(3, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        lengths = lengths_of(x)
        order = torch.argsort(lengths, descending=True, stable=True)
        h0 = torch.tanh(x[:, :1, :1]).reshape(1, -1, 1).expand(1, -1, 4)  # sample order
        packed = nn.utils.rnn.pack_padded_sequence(x.index_select(0, order), lengths[order],
                                                   batch_first=True)
        _, h_n = self.rnn(packed, h0)
        return self.head(h_n[0].index_select(0, torch.argsort(order)))


def test_initial_states_paired_with_other_samples_are_refused():
    """The kernel pairs packed column ``j`` (sample ``order[j]``) with state column ``j``
    (sample ``j``): samples mix, and the rules say so instead of differing silently."""
    torch.manual_seed(0)
    x = randn(4, 4, 3)
    assert not torch.equal(torch.argsort(lengths_of(x), descending=True, stable=True),
                           torch.arange(4))  # the pairing really is wrong
    with pytest.raises((LossNotPerSampleError, NeedsWholeModel),
                       match="pairs initial states with other samples"):
        per_sample_grads(OtherSamplesStates(), x, randn(4, 3), per_sample_loss, method="rules")


def test_a_permutation_that_is_the_identity_is_the_plain_layout():
    n = 4
    assert indexed(1, torch.arange(n), n) == Batched(1)
    assert indexed(1, torch.arange(n), n).index is None
    assert indexed(0, torch.tensor([1, 0, 2, 3]), n).index is not None
    assert indexed(0, torch.arange(3), n).index is not None  # three of four samples


def test_module_front_of_a_permuted_and_of_an_irregular_batch_dim():
    """Module rules get a permuted batch dim in sample order with the dim removed (a
    packed sequence's final states), irregular rows padded per sample (its outputs)."""
    g = torch.randn(5, 2, 3, 4)  # (v, L * D, batch, H)
    perm = torch.tensor([2, 0, 1])  # position j holds sample perm[j]
    got = module_front(g, Batched(1, index=perm), 3, 1)  # (n, v, L * D, H)
    assert got.shape == (3, 5, 2, 4)
    for j, i in enumerate(perm.tolist()):
        assert torch.equal(got[i], g[:, :, j])
    rows = torch.tensor([1, 0, 2, 1, 0, 1])  # a packed sequence's rows: 3, 2 and 1 steps
    data = torch.randn(5, 6, 4)  # (v, rows, H)
    got = module_front(data, Batched(0, index=rows), 3, 1)  # (n, v, T, H)
    assert got.shape == (3, 5, 3, 4)
    assert torch.equal(got[1], data[:, [0, 3, 5]])
    assert torch.equal(got[0, :, :2], data[:, [1, 4]]) and not got[0, :, 2].any()


# ---------------------------------------------------------------------------
# instance norm with running statistics


class InstanceNormStats(nn.Module):
    """``F.instance_norm`` with running statistics held outside the model (PyTorch's own
    samples pass plain tensors), or as buffers; affine parameters of the model."""

    def __init__(self, channels: int, use_input_stats: bool, buffers: bool = False, **kwargs):
        super().__init__()
        self.weight, self.bias = nn.Parameter(randn(channels)), nn.Parameter(randn(channels))
        stats = (torch.rand(channels), torch.rand(channels) + 0.5)
        if buffers:
            self.register_buffer("mean", stats[0])
            self.register_buffer("var", stats[1])
        self.stats = (lambda: (self.mean, self.var)) if buffers else (lambda: stats)
        self.use_input_stats, self.kwargs = use_input_stats, kwargs

    def forward(self, x: Tensor) -> Tensor:
        mean, var = self.stats()
        y = F.instance_norm(x, mean, var, self.weight, self.bias,
                            use_input_stats=self.use_input_stats, **self.kwargs)
        return y.flatten(1)


@pytest.mark.parametrize("shape, kwargs", [
    ((3, 3, 3), {"momentum": 0.5, "eps": 0.6}),  # B == C == L
    ((3, 2, 4), {"momentum": -1.2}),
    ((3, 2, 3, 4), {"momentum": -1.0, "eps": 0.5}),
])
def test_instance_norm_with_outside_statistics_it_only_updates(shape, kwargs):
    """``use_input_stats=True``: the running statistics are written, never read, so
    tensors the capture never saw made do not stop the rule."""
    torch.manual_seed(0)
    model, x = InstanceNormStats(shape[1], True, **kwargs), randn(*shape)
    y = randn(shape[0], x[0].numel())
    check(model, x, y, per_sample_loss, paths=module_paths(model, {"": "rule"}))


def test_instance_norm_reading_its_running_statistics():
    """``use_input_stats=False`` reads them: buffers are shared (the rule); tensors made
    outside the capture may hold anything, so the rules take them only if they are
    known to be shared, and ``auto`` is exact either way."""
    torch.manual_seed(0)
    x, y = randn(3, 3, 4), randn(3, 12)
    model = InstanceNormStats(3, False, buffers=True)
    check(model, x, y, per_sample_loss, paths=module_paths(model, {"": "rule"}))
    outside = InstanceNormStats(3, False)
    want = loop_per_sample_grads(outside, x, y, per_sample_loss)
    try:
        assert_grads_equal(per_sample_grads(outside, x, y, per_sample_loss, method="rules"),
                           want)
    except NeedsWholeModel as err:
        assert "made outside the captured ops" in str(err)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_grads_equal(per_sample_grads(outside, x, y, per_sample_loss), want)


class NormTwice(nn.Module):
    """One InstanceNorm with running statistics called twice in training mode: the second
    call updates the statistics the first one's op held."""

    def __init__(self):
        super().__init__()
        self.norm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head((self.norm(x) + self.norm(2 * x.flip(2))).mean(2))


def test_instance_norm_called_twice_updating_its_statistics():
    torch.manual_seed(0)
    model, x, y = NormTwice().double(), randn(3, 3, 3), randn(3, 2)
    check(model, x, y, per_sample_loss, paths=module_paths(model, {"norm": "rule",
                                                                   "head": "rule"}))


@pytest.mark.parametrize("op", ["instance_norm", "batch_norm"])
def test_running_statistics_updated_with_the_batch_are_mixed(op):
    """After a norm that updates its running statistics with the batch's statistics, they
    hold means over the samples: whatever reads them later is not one sample's."""
    weight = nn.Parameter(torch.ones(3))
    mean, var = torch.zeros(3), torch.ones(3)
    x = randn(4, 3, 5)
    with Capture(nn.Module(), {id(weight): weight}, 4, [x]) as cap:
        if op == "instance_norm":
            out = F.instance_norm(x, mean, var, weight, use_input_stats=True)
        else:
            out = F.batch_norm(x, mean, var, weight, training=True)
    assert isinstance(cap.layout(mean), Mixed) and isinstance(cap.layout(var), Mixed)
    if op == "instance_norm":  # each row's own statistics
        assert cap.layout(out) == Batched(0)
    else:  # training mode: the batch's statistics
        assert isinstance(cap.layout(out), Mixed)


# ---------------------------------------------------------------------------
# nn.Transformer


class Seq2Seq(nn.Module):
    """``nn.Transformer`` of 2 + 2 layers on ``(B, T, 4)``; the target is the source's
    first two positions; masks from each sample's own data."""

    def __init__(self, batch_first: bool, masks: bool, nested: bool = True,
                 causal: bool = False, **kwargs):
        super().__init__()
        self.t = nn.Transformer(4, 2, 2, 2, 6, dropout=0.0, batch_first=batch_first,
                                **kwargs)
        self.t.encoder.enable_nested_tensor = nested
        self.masks, self.causal = masks, causal
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        src, tgt = x, torch.tanh(2 * x[:, :2])
        kwargs = {}
        if self.masks:
            pad = x[:, :, 0].detach() > 0.3
            pad[:, 0] = False
            kwargs = {"src_key_padding_mask": pad, "memory_key_padding_mask": pad,
                      "tgt_mask": nn.Transformer.generate_square_subsequent_mask(2).to(x),
                      "tgt_is_causal": self.causal}
        if not self.t.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        y = self.t(src, tgt, **kwargs)
        y = y if self.t.batch_first else y.transpose(0, 1)
        return self.head(y.mean(1))


TRANSFORMERS = {
    "sequence-first-masks": lambda: Seq2Seq(False, True),
    "batch-first-masks-nested-eval": lambda: Seq2Seq(True, True).eval(),
    "norm-first-gelu-no-bias-causal": lambda: Seq2Seq(True, True, causal=True, norm_first=True,
                                                     activation="gelu", bias=False),
    "callable-activation-nested-off-eval": lambda: Seq2Seq(False, False, nested=False,
                                                          activation=F.silu).eval(),
}


@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_transformer_on_the_rules(name):
    """B == T == heads == 2: every parameter on the op rules, exact."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's notes on nested tensors and masks
        model = TRANSFORMERS[name]().double()
        check(model, randn(2, 2, 4), randn(2, 3), per_sample_loss, paths={"rule"})


class FrozenEncoder(nn.Module):
    """A frozen batch-first encoder in eval mode under a trainable head: PyTorch runs a
    sample alone through its nested-tensor fast path (zeros at padded positions)."""

    def __init__(self, nested: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.enc.requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        pad = x[:, :, 0].detach() > 0.5
        pad[:, 0] = False
        return self.head(self.enc(x, src_key_padding_mask=pad).mean(1))


def test_frozen_encoder_nested_fast_path_is_refused_then_exact():
    """The nested fast path zeros a batch's padded positions, not a lone sample's: the
    loop's answer is not the gradient of the batch's forward, so ``auto`` refuses (its
    certificate), naming the fix; the loop answers when asked for."""
    from persample.errors import CertificateError

    torch.manual_seed(0)
    x, y = randn(4, 4, 8), randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FrozenEncoder(nested=True).double()
        want = loop_per_sample_grads(model, x, y, per_sample_loss)
        with pytest.raises(NeedsWholeModel, match="enable_nested_tensor=False"):
            per_sample_grads(model, x, y, per_sample_loss, method="rules")
        with pytest.raises(CertificateError, match="enable_nested_tensor=False"):
            per_sample_grads(model, x, y, per_sample_loss)
        assert_grads_equal(per_sample_grads(model, x, y, per_sample_loss, method="loop"),
                           want)
        check(FrozenEncoder(nested=False).double(), x, y, per_sample_loss, paths={"rule"})


def test_trainable_encoder_in_eval_mode_stays_on_the_rules():
    """The fast path needs no tensor requiring grad: a trainable encoder never takes it."""
    torch.manual_seed(0)
    x, y = randn(4, 4, 8), randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FrozenEncoder(nested=True).double().requires_grad_(True)
        check(model, x, y, per_sample_loss, paths={"rule"})


# ---------------------------------------------------------------------------
# sparse embeddings


class Sparse(nn.Module):
    def __init__(self, table: nn.Module):
        super().__init__()
        self.table, self.head = table, nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        y = self.table(ids)
        return self.head(y if y.dim() == 2 else y.mean(1))


SPARSE = {
    "embedding": lambda: nn.Embedding(5, 4, sparse=True),
    "embedding-padding-idx": lambda: nn.Embedding(5, 4, sparse=True, padding_idx=0),
    "embedding-bag-sum": lambda: nn.EmbeddingBag(5, 4, mode="sum", sparse=True),
    "embedding-bag-mean": lambda: nn.EmbeddingBag(5, 4, mode="mean", sparse=True),
}


@pytest.mark.parametrize("name", list(SPARSE))
def test_sparse_embeddings_on_the_rules(name):
    torch.manual_seed(0)
    model = Sparse(SPARSE[name]()).double()
    ids, y = torch.tensor([[1, 2, 2], [0, 4, 1], [3, 3, 0]]), randn(3, 3)
    check(model, ids, y, per_sample_loss, jacobian=True,
          paths=module_paths(model, {"table": "rule", "head": "rule"}))
