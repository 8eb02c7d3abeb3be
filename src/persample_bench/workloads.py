"""The benchmark's workloads: the models of the questions and tutorials persample
answers, on scikit-learn's digits, real models (torchvision resnet18, timm ViT,
transformers GPT-2) on real data, and real-size transformers with their real
vocabularies (:data:`REAL_WORKLOADS`: GPT-2 small, BERT with LoRA, Llama with
grouped-query attention and LoRA) on the standard library's docstrings, each
piece of text hashed into the model's vocabulary (:func:`hashed_ids`).

The real models' packages are imported only when their workload is built
(:mod:`persample_bench.real_models`). The real-size workloads also build at a
tiny test size (``size="tiny"``: same vocabulary, data, loss and trainable
parameters).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils._pytree import tree_map

from persample.cli.data import (
    ByteTokenizer,
    digits_features,
    digits_images,
    docstring_batch,
    docstring_examples,
    stdlib_docstrings,
)
from persample.cli.dp_train import simple_cnn  # the model dp-train and audit train too
from persample.inputs import as_batch

from . import real_models


def deep_mlp(depth: int = 50, width: int = 300, classes: int = 2) -> nn.Sequential:
    """The MLP of the "fast-individual-gradients-with-autodiff" benchmark: ``depth`` ReLU
    layers of ``width`` units, then the classes.

    Takes ``(B, width)``, returns logits ``(B, classes)``.

    Examples:
        >>> deep_mlp(depth=2, width=3)(torch.zeros(4, 3)).shape
        torch.Size([4, 2])
    """
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class RowLSTM(nn.Module):
    """Reads a 28x28 image row by row: LSTM(28, 128) over 28 steps, Linear on the last state.

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, classes)``.

    Examples:
        >>> RowLSTM()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(28, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        _, (h, _) = self.lstm(x.flatten(1, 2))  # (B, 28, 28) -> h (1, B, hidden)
        return self.head(h[-1])


class RowLSTMCell(nn.Module):
    """An ``nn.LSTMCell(28, hidden)`` stepped over the 28 rows of a digit in a Python
    loop from a state of zeros, as a decoder's loop calls a cell, then a linear head:
    the cell's weights are read at every step.

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, classes)``.

    Examples:
        >>> RowLSTMCell()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.cell = nn.LSTMCell(28, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.flatten(1, 2)  # (B, 28, 28)
        h = rows.new_zeros(rows.shape[0], self.cell.hidden_size)
        c = h
        for t in range(rows.shape[1]):
            h, c = self.cell(rows[:, t], (h, c))
        return self.head(h)


class ParametrizedRows(nn.Module):
    """A recurrent layer over a digit's 28 rows whose recurrent weight is rewritten by a
    parametrization before each use, then a linear head on the last output:
    ``"weight-norm"``, an ``nn.LSTM(28, hidden)`` with ``parametrizations.weight_norm``
    on ``weight_hh_l0`` (Salimans & Kingma 2016); ``"orthogonal"``, an ``nn.RNN(28,
    hidden)`` with ``parametrizations.orthogonal`` (``exp`` of a skew-symmetric ``A``),
    its ``A`` drawn small and nonzero as after some training steps (at ``A = 0``, where
    the trivialization starts, the exponential's derivative is the identity);
    ``"householder"``, an ``nn.LSTM(28, hidden)`` with ``orthogonal`` on its ``(4 hidden,
    hidden)`` recurrent weight (Householder reflections, the map of a weight that is not
    square), its reflectors moved as after some steps.

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, classes)``.

    Examples:
        >>> ParametrizedRows("orthogonal")(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, kind: str, hidden: int = 128, classes: int = 10):
        super().__init__()
        if kind == "weight-norm":
            self.rnn = parametrizations.weight_norm(nn.LSTM(28, hidden, batch_first=True),
                                                    "weight_hh_l0")
        elif kind == "householder":
            self.rnn = parametrizations.orthogonal(nn.LSTM(28, hidden, batch_first=True),
                                                   "weight_hh_l0")
            with torch.no_grad():  # (below the diagonal: its signs stay)
                original = self.rnn.parametrizations.weight_hh_l0.original
                original.add_(torch.randn_like(original).tril(-1) * 0.05)
        else:
            self.rnn = parametrizations.orthogonal(nn.RNN(28, hidden, batch_first=True),
                                                   "weight_hh_l0")
            with torch.no_grad():
                self.rnn.parametrizations.weight_hh_l0.original.normal_(0, 0.05)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.rnn(x.flatten(1, 2))[0]  # (B, 28, hidden)
        return self.head(out[:, -1])


class StepDecoder(nn.Module):
    """The decoder of PyTorch's "NLP From Scratch: Translation with a Sequence to
    Sequence Network" tutorial (``DecoderRNN``: an embedding, a ReLU, an ``nn.GRU``
    called one token at a time from the state the step before left, a linear output),
    run with teacher forcing over the given ids; ``.logits`` as a language model's.

    Takes ``{"input_ids": (B, T)}`` (other keys ignored), returns an object with
    ``.logits (B, T, vocab)``.

    Examples:
        >>> StepDecoder(10, 8)(input_ids=torch.zeros(2, 3, dtype=torch.long)).logits.shape
        torch.Size([2, 3, 10])
    """

    def __init__(self, vocab: int, hidden: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, input_ids: Tensor, **_: Any) -> Any:
        state, steps = None, []
        for t in range(input_ids.shape[1]):  # (B, 1) at a time, as the tutorial decodes
            output, state = self.gru(F.relu(self.embedding(input_ids[:, t:t + 1])), state)
            steps.append(self.out(output))
        return SimpleNamespace(logits=torch.cat(steps, 1))


class RowEncoder(nn.Module):
    """The stock ``nn.TransformerEncoder`` reading a 28x28 image row by row: rows
    projected to ``width``, learned positions, ``layers`` layers of ``heads`` heads
    (``batch_first``, MLP of ``4 * width``, PyTorch's default ``dropout=0.1``), the mean
    over rows to ``classes`` logits. Built in training mode.

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, classes)``.

    Examples:
        >>> RowEncoder()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 128, heads: int = 4, layers: int = 2, classes: int = 10):
        super().__init__()
        self.rows = nn.Linear(28, width)
        self.positions = nn.Parameter(0.02 * torch.randn(28, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)
        self.train()

    def forward(self, x: Tensor) -> Tensor:
        h = self.rows(x.flatten(1, 2)) + self.positions  # (B, 28, width)
        return self.head(self.encoder(h).mean(1))


@dataclass
class Workload:
    """A model, a batch of real data and a loss, as the benchmark times them.

    Attributes:
        name: the workload's name on the command line (``cnn-grads``, ...).
        source: where it comes from (a tutorial, a question, a library).
        model: the ``nn.Module``, converted to float32 (parameters and buffers).
        inputs: what the model is called with as its users call it: a tensor
            ``(B, ...)`` (``model(inputs)``) or a dict of ``(B, ...)`` tensors such as a
            tokenizer's output (``model(**inputs)``).
        targets: ``(B, ...)`` tensor passed to ``loss_fn`` as its second argument,
            or ``None`` (Jacobian workloads).
        loss_fn: ``loss_fn(model_output, targets)``: a scalar (mean over the batch) or
            ``(B,)`` per-sample losses; ``None`` for Jacobian workloads.
        description: one line for the table.
        opacus_inputs: the same batch as Opacus's users pass it, or ``None`` (then
            ``inputs``): a dict with ``position_ids`` (and ``token_type_ids``) spelled
            out per sample, ``(B, T)``, so that Opacus's embedding grad samplers see
            batch-first ids.
        opacus_ce: for a loss that is a per-sample mean cross-entropy written from the
            logits: ``opacus_ce(model_output, targets) -> (logits (N, C), labels (N,),
            shape)``, where ``nn.CrossEntropyLoss(reduction="none")`` of the first two,
            viewed as ``shape = (B, L)`` and averaged over its non-ignored entries per
            row (Opacus's ``DPLossFastGradientClipping(..., shape=...)``), gives
            ``loss_fn``'s ``(B,)``; ``shape`` is ``None`` where ``N = B``. How Opacus's
            ghost clipping, which takes an ``nn.CrossEntropyLoss`` only, is given the
            loss; ``None``: ``loss_fn`` is an ``nn.CrossEntropyLoss`` or it cannot be.
        layout_rows: whether the per-sample gradients table has persample's
            ``flat=True`` and ``out=`` rows, the same call with the result in another
            layout; left out where the result is a few MB of LoRA adapters beside
            seconds of compute, so that they would time the default call again.
        autocast: every method (and the plain step) runs under ``torch.autocast`` with
            this dtype (``None``: float32 throughout).
        seed: for a model in training mode that draws random numbers (dropout): the
            reference's and every method's checked first call run under
            ``torch.manual_seed(seed)``, so that they differentiate the same forward
            (``None``: the model draws nothing).
        other_batches: ``(inputs, targets)`` of further batches of ``B`` samples whose
            shapes differ from ``inputs``'s, as a training loop feeds them (graph batches
            of other graphs: other node and edge counts); where there are any, the
            plain step and persample's default call are also timed on them in turn
            (the report's "a new batch at each call" line), as such a loop calls them.
    """

    name: str
    source: str
    model: nn.Module
    inputs: Any
    targets: Tensor | None
    loss_fn: Callable[[Any, Tensor], Tensor] | None
    description: str
    opacus_inputs: Any = None
    opacus_ce: Callable[[Any, Tensor], tuple[Tensor, Tensor, tuple | None]] | None = None
    layout_rows: bool = True
    autocast: torch.dtype | None = None
    seed: int | None = None
    other_batches: list[tuple[Any, Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = self.model.float()  # whatever torch's default dtype is

    @property
    def n(self) -> int:
        """The batch size ``B``: dim 0 of the (first) input tensor, or the samples of a
        packed form (the graphs of a torch_geometric ``Batch``)."""
        return as_batch(self.inputs).n

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (float32), hence of every result."""
        return next(self.model.parameters()).dtype

    def call(self, model: nn.Module | None = None, inputs: Any = None) -> Any:
        """``model(inputs)`` or ``model(**inputs)`` (default: the workload's model and
        inputs)."""
        model = self.model if model is None else model
        inputs = self.inputs if inputs is None else inputs
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)

    def opacus_call(self, model: nn.Module) -> Any:
        """``model`` called with the inputs as Opacus's users pass them
        (:attr:`opacus_inputs`, else :attr:`inputs`)."""
        return self.call(model, self.opacus_inputs)

    def to(self, device: torch.device | str) -> Workload:
        """Move the model, inputs and targets to ``device`` (in place); returns ``self``.

        Examples:
            >>> w = grads_workload("cnn-grads", 2).to("cpu")
            >>> w.n, w.device.type
            (2, 'cpu')
        """
        self.model = self.model.to(device)
        # (a tensor, or an object that moves its own tensors: torch_geometric's Batch)
        move = lambda t: t.to(device) if callable(getattr(t, "to", None)) else t  # noqa: E731
        self.inputs, self.opacus_inputs = tree_map(move, self.inputs), tree_map(
            move, self.opacus_inputs)
        if self.targets is not None:
            self.targets = self.targets.to(device)
        self.other_batches = [(tree_map(move, x), y.to(device)) for x, y in self.other_batches]
        return self


def masked_reconstruction(out, patches: Tensor) -> Tensor:
    """ViTMAE's loss per sample ``(B,)``: the squared error of the reconstructed patches
    ``out.logits (B, L, p*p*C)`` against the image's ``patches``, averaged over each
    sample's masked patches (``out.mask (B, L)``, 1 where masked; He et al. 2022)."""
    error = (out.logits - patches).pow(2).mean(-1)  # (B, L)
    return (error * out.mask).sum(1) / out.mask.sum(1)


_OTHER_GRAPH_BATCHES = 12  # more than the bench's calls of each method: each call of the
# "a new batch at each call" line gets a batch of shapes it has not seen, as in an epoch


def _other_graph_batches(batch: int, first: Any) -> list[tuple[Any, Tensor]]:
    """Up to :data:`_OTHER_GRAPH_BATCHES` more batches of ``batch`` digits as graphs (the
    digits after ``first``'s), each of a node and edge count no batch before it has."""
    seen, found = {(first.num_nodes, first.num_edges)}, []
    start, total = batch, len(digits_images(8)[1])
    while len(found) < _OTHER_GRAPH_BATCHES and start + batch <= total:
        graphs, labels = graph_batch(batch, start)
        start += batch
        if (graphs.num_nodes, graphs.num_edges) not in seen:
            seen.add((graphs.num_nodes, graphs.num_edges))
            found.append((graphs, labels))
    return found


def graph_batch(batch: int, start: int = 0) -> tuple[Any, Tensor]:
    """``batch`` of the digits (from the ``start``-th on) as graphs, a torch_geometric
    ``Batch``: the pixels of each 8x8 image above its median brightness are the nodes (16
    to 64 of them; features: the brightness and the position, one-hot, 17 in all), each
    joined to the 4 nodes nearest in brightness; label 1 for the digits 5 to 9. Returns
    ``(Batch, labels (batch,))``.

    Raises:
        NotInstalled: torch_geometric is missing."""
    geometric = real_models.require("torch_geometric")
    x, y = digits_images(8)  # (N, 1, 8, 8)
    graphs = []
    for image in x[start:start + batch]:
        values = image.reshape(64)
        kept = torch.nonzero(values >= values.median()).reshape(-1)  # (m,)
        features = torch.cat([values[kept, None], F.one_hot(kept % 16, 16).float()], 1)
        near = (values[kept, None] - values[None, kept]).abs().fill_diagonal_(float("inf"))
        k = min(4, len(kept) - 1)
        targets = near.topk(k, largest=False).indices  # (m, k)
        edges = torch.stack([torch.arange(len(kept)).repeat_interleave(k), targets.reshape(-1)])
        graphs.append(geometric.data.Data(x=features, edge_index=edges))
    return geometric.data.Batch.from_data_list(graphs), (y[start:start + batch] >= 5).long()


def grads_workload(name: str, batch: int | None = None, size: str = "full",
                   device: torch.device | str = "cpu") -> Workload:
    """A per-sample gradients workload on the CPU (see :data:`GRAD_WORKLOADS`).

    ``cnn-grads`` (the SimpleCNN of torch.func's "Per-sample-gradients" tutorial, B=64,
    digits 28x28), ``deep-mlp-grads`` (the 50x300 MLP of the benchmark of Goodfellow's
    trick in "fast-individual-gradients-with-autodiff", B=100, digits projected to 300
    features, 2 classes),
    ``lstm-grads`` (:class:`RowLSTM`, B=64), ``lstm-cell-grads`` (:class:`RowLSTMCell`,
    B=64), ``weight-norm-lstm-grads``, ``orthogonal-rnn-grads`` and
    ``orthogonal-lstm-grads`` (:class:`ParametrizedRows`, B=64),
    ``seq2seq-decoder-grads`` (:class:`StepDecoder` over 16 bytes of the standard
    library's docstrings, B=32, per-sample next-token cross-entropy), ``vit-grads``
    (timm ``VisionTransformer``, 4x4 patches of the 28x28 digits, 2 layers of width 64,
    B=64), ``resnet18-grads``
    (torchvision ``resnet18(num_classes=10)``, digits 32x32 repeated to 3 channels,
    B=32), all with ``nn.CrossEntropyLoss()`` (mean); ``gpt2-grads`` (transformers
    ``GPT2LMHeadModel``, 4 layers x 256, 4 heads, byte vocabulary of 257, T=64, B=16,
    on the standard library's docstrings, inputs ``{"input_ids", "attention_mask"}``,
    per-sample next-token cross-entropy ``(B,)``). Models in eval mode, float32,
    ``torch.manual_seed(0)``. Small models as people train them, timed for the first
    call and the steady state: ``bert-small-grads`` (transformers
    ``BertForSequenceClassification`` 4x128, 4 heads, T=64, B=32, which of 4 standard
    library modules a docstring documents, per-sample cross-entropy ``(B,)``),
    ``vit-tiny-grads`` (timm ViT-Tiny, 4x4 patches of the digits 3x32x32, B=16),
    ``gnn-mlp-grads`` (MLP 64-64-64-2, B=256). The families of 2025-26:
    ``gpt-oss-grads`` (transformers gpt-oss 2x128, 4 experts with biases top-2 in the
    grouped kernel, T=64, B=16, next-token cross-entropy), ``qwen-moe-grads``
    (transformers Qwen2-MoE 2x128, 4 experts top-2 in the grouped kernel beside a gated
    shared expert, T=64, B=16, next-token cross-entropy), ``switch-moe-grads``
    (transformers Switch Transformers 2x128, 4 experts top-1 with a capacity of 16
    tokens of 64, T=64, B=16, the decoder's next-token cross-entropy), ``vit-mae-grads``
    (transformers ViTMAE pretraining, the learned mask token repeated into the batch,
    B=16, :func:`masked_reconstruction`), ``llava-grads`` (transformers LLaVA, CLIP 2x128
    and Llama 2x128, each image's 16 features written into its sample's image tokens,
    T=64, B=16, next-token cross-entropy), ``gcn-batch-grads`` (torch_geometric GCN on a
    ``Batch`` of 32 graphs, :func:`graph_batch`). The proxies of a GPU's short kernels
    (:data:`PROXY_WORKLOADS`, with ``vit-grads`` and ``lstm-grads``): ``bert-tiny-grads``
    (BERT 2x64, 2 heads, T=16, B=16, as ``bert-small-grads``), ``gpt2-tiny-grads``
    (GPT-2 2x64, 2 heads, T=16, B=16, as ``gpt2-grads``), ``mlp-tiny-grads`` (MLP 8x64,
    B=64, as ``gnn-mlp-grads``). The real-size transformers
    (:data:`REAL_GRAD_WORKLOADS`) are :func:`real_workload`'s.

    Args:
        name: one of :data:`GRAD_WORKLOADS`.
        batch: overrides the batch size ``B``.
        size: ``"tiny"`` builds a real-size workload at test size (:func:`real_workload`);
            the other workloads have one size, ``"full"``.
        device: where the workload will run (GPT-2 768 has 12 layers on a GPU); it is
            built on the CPU.

    Raises:
        ValueError: an unknown name, or ``size="tiny"`` for a workload of one size.
        persample.cli.real_models.NotInstalled: timm, torchvision or transformers is
            needed and missing.

    Examples:
        >>> w = grads_workload("cnn-grads", batch=4)
        >>> w.inputs.shape, w.targets.shape
        (torch.Size([4, 1, 28, 28]), torch.Size([4]))
    """
    if name in REAL_GRAD_WORKLOADS:
        return real_workload(name, batch, size, device)
    if size != "full":
        raise ValueError(f"{name} has one size, 'full'; size={size!r} exists for "
                         f"{REAL_GRAD_WORKLOADS}")
    torch.manual_seed(0)
    if name == "cnn-grads":
        x, y = digits_images()
        b = batch or 64
        return Workload(name, "tutorial", simple_cnn().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"SimpleCNN, batch {b}, digits 1x28x28, cross-entropy")
    if name == "deep-mlp-grads":
        x, y = digits_features()
        b = batch or 100
        return Workload(name, "goodfellow", deep_mlp().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"MLP 50x300 ReLU, batch {b}, digits projected to 300, 2 classes")
    if name == "lstm-grads":
        x, y = digits_images()
        b = batch or 64
        # training mode: cuDNN runs an RNN's backward only there, and an LSTM without
        # dropout computes the same in both modes
        return Workload(name, "rnn", RowLSTM().train(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"LSTM(28, 128) over image rows, batch {b}, digits 1x28x28, "
                        "cross-entropy")
    if name == "lstm-cell-grads":
        x, y = digits_images()
        b = batch or 64
        return Workload(name, "rnn", RowLSTMCell().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"LSTMCell(28, 128) stepped over image rows, batch {b}, digits "
                        "1x28x28, cross-entropy")
    if name in ("weight-norm-lstm-grads", "orthogonal-rnn-grads", "orthogonal-lstm-grads"):
        x, y = digits_images()
        b = batch or 64
        kind = {"weight-norm-lstm-grads": "weight-norm", "orthogonal-rnn-grads": "orthogonal",
                "orthogonal-lstm-grads": "householder"}[name]
        model = ParametrizedRows(kind).eval()
        layer = {"weight-norm": "LSTM(28, 128), weight_norm", "orthogonal": "RNN(28, 128), "
                 "orthogonal", "householder": "LSTM(28, 128), orthogonal (Householder)"}[kind]
        return Workload(name, "rnn", model, x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"{layer} on the recurrent weight, over image rows, batch {b}, "
                        "digits 1x28x28, cross-entropy")
    if name == "vit-grads":
        model = real_models.timm_vit(img_size=28, in_chans=1)
        x, y = digits_images()
        b = batch or 64
        return Workload(name, "timm", model, x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"timm ViT: 4x4 patches, 2 layers of width 64, 4 heads, batch {b}, "
                        "digits 1x28x28, cross-entropy")
    if name == "resnet18-grads":
        model = real_models.resnet18(classes=10)
        x, y = digits_images(32, channels=3)
        b = batch or 32
        return Workload(name, "torchvision", model, x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"torchvision resnet18 (eval), batch {b}, digits 3x32x32, "
                        "cross-entropy")
    if name == "encoder-grads":
        x, y = digits_images()
        b = batch or 64
        return Workload(name, "torch.nn", RowEncoder(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"nn.TransformerEncoder over image rows, 2 layers of width 128, 4 "
                        f"heads, training mode (dropout 0.1), batch {b}, digits 1x28x28, "
                        "cross-entropy", seed=0)
    if name in _MIXTURES:
        return _mixture_workload(name, batch)
    if name == "bert-small-grads":
        b, t = batch or 32, 64
        model = real_models.bert_classifier(ByteTokenizer.vocab_size, layers=4, width=128,
                                            heads=4, intermediate=512, classes=4,
                                            max_positions=t)
        examples = docstring_examples("module", seq_len=t)
        picked = [examples[k * len(examples) // b] for k in range(b)]  # every module's
        inputs = {key: torch.stack([e[key] for e in picked])
                  for key in ("input_ids", "attention_mask")}
        labels = torch.stack([e["labels"] for e in picked])
        return Workload(name, "transformers", model, inputs, labels, logits_cross_entropy,
                        f"transformers BERT 4x128 for sequence classification (eval), batch "
                        f"{b}, T={t}, which of 4 stdlib modules a docstring documents, "
                        "per-sample cross-entropy", opacus_ce=classifier_ce)
    if name == "vit-tiny-grads":
        model = real_models.timm_vit(img_size=32, in_chans=3, width=192, depth=12, heads=3)
        x, y = digits_images(32, channels=3)
        b = batch or 16
        return Workload(name, "timm", model, x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"timm ViT-Tiny (12 layers of width 192, 3 heads), 4x4 patches, "
                        f"batch {b}, digits 3x32x32, cross-entropy")
    if name == "gnn-mlp-grads":
        x, y = digits_features(64)
        b = batch or 256
        return Workload(name, "gnn", mlp([64, 64, 64, 2], nn.ReLU).eval(), x[:b], y[:b],
                        nn.CrossEntropyLoss(),
                        f"MLP 64-64-64-2 ReLU (the size of a GNN's node MLP), batch {b}, "
                        "digits projected to 64, 2 classes, cross-entropy")
    if name in PROXY_WORKLOADS[:3]:
        return _proxy_workload(name, batch)
    if name == "vit-mae-grads":
        model = real_models.vit_mae(img_size=32)
        x, _ = digits_images(32, channels=3)
        b = batch or 16
        noise = torch.rand(b, 64, generator=torch.Generator().manual_seed(0))
        pixels = x[:b]
        return Workload(name, "transformers", model, {"pixel_values": pixels, "noise": noise},
                        model.patchify(pixels).detach(), masked_reconstruction,
                        f"transformers ViTMAE pretraining 2x64 (the mask token repeated "
                        f"into the batch), 75% of 4x4 patches masked, batch {b}, digits "
                        "3x32x32, per-sample masked reconstruction error")
    if name == "llava-grads":
        return _llava_workload(batch)
    if name == "gcn-batch-grads":
        b = batch or 32
        graphs, labels = graph_batch(b)
        others = _other_graph_batches(b, graphs)
        return Workload(name, "torch_geometric", real_models.gcn(graphs.x.shape[1]), graphs,
                        labels, nn.CrossEntropyLoss(),
                        f"torch_geometric GCN 2x64 and mean pool on a Batch of {b} graphs "
                        "(the digits' 8x8 pixels as nodes joined to their 4 nearest in value, "
                        "16 to 64 nodes), 2 classes, cross-entropy", other_batches=others)
    if name == "seq2seq-decoder-grads":
        b, t = batch or 32, 16
        inputs, labels = docstring_batch(b, t)
        return Workload(name, "tutorial", StepDecoder(ByteTokenizer.vocab_size).eval(),
                        {"input_ids": inputs["input_ids"]}, labels,
                        real_models.causal_lm_loss,
                        f"the sequence-to-sequence tutorial's GRU decoder (128 wide) stepped "
                        f"one token at a time, batch {b}, T={t}, stdlib docstrings as bytes, "
                        "per-sample next-token cross-entropy")
    if name in ("gpt2-grads", "gpt2-lora-grads"):
        b, t = batch or 16, 64
        model = real_models.gpt2(ByteTokenizer.vocab_size, seq_len=t)
        what = "GPT-2 4x256 (eval)"
        if name == "gpt2-lora-grads":  # LoRA adapters (peft) only are trained
            model, what = real_models.with_lora(model, 8), "GPT-2 4x256 + LoRA r=8 (eval)"
        inputs, labels = docstring_batch(b, t)
        return Workload(name, "transformers", model, inputs, labels, real_models.causal_lm_loss,
                        f"transformers {what}, batch {b}, T={t}, stdlib docstrings "
                        "as bytes, per-sample next-token cross-entropy")
    raise ValueError(f"unknown workload {name!r}; choose from {GRAD_WORKLOADS}")


_MIXTURES = {  # name -> (the model for sequences of T tokens, what it is)
    "moe-grads": (lambda t: real_models.mixtral(ByteTokenizer.vocab_size, seq_len=t),
                  "Mixtral 2x128, 4 experts top-2 (training mode)"),
    "gpt-oss-grads": (lambda t: real_models.gpt_oss(ByteTokenizer.vocab_size, seq_len=t),
                      "gpt-oss 2x128, 4 experts with biases top-2 (grouped), attention sinks, "
                      "sliding and full layers (eval)"),
    "qwen-moe-grads": (lambda t: real_models.qwen2_moe(ByteTokenizer.vocab_size, seq_len=t),
                       "Qwen2-MoE 2x128, 4 experts top-2 (grouped) and a gated shared expert "
                       "(eval)"),
    "switch-moe-grads": (lambda t: real_models.switch(ByteTokenizer.vocab_size, capacity=t // 4),
                         "Switch Transformers 2x128 encoder-decoder (the decoder fed the same "
                         "ids), 4 experts top-1 with a capacity of a quarter of the tokens "
                         "(the rest dropped), eval"),
}


def _mixture_workload(name: str, batch: int | None) -> Workload:
    """A mixture of experts of :data:`_MIXTURES` on the standard library's docstrings as
    bytes (``B`` = ``batch`` or 16, T=64), per-sample next-token cross-entropy."""
    b, t = batch or 16, 64
    make, what = _MIXTURES[name]
    inputs, labels = docstring_batch(b, t)
    if name == "switch-moe-grads":  # (an encoder-decoder: the ids in and out)
        inputs = {"input_ids": inputs["input_ids"], "decoder_input_ids": inputs["input_ids"]}
    return Workload(name, "transformers", make(t), inputs, labels, real_models.causal_lm_loss,
                    f"transformers {what}, batch {b}, T={t}, stdlib docstrings as bytes, "
                    "per-sample next-token cross-entropy")


def _llava_workload(batch: int | None) -> Workload:
    """LLaVA (:func:`real_models.llava`) on the digits as images and the standard
    library's docstrings as bytes (``B`` = ``batch`` or 16, T=64): each sample's 16
    image tokens after its first byte, then 47 bytes; per-sample next-token
    cross-entropy over the bytes."""
    b, t, rows = batch or 16, 64, 16
    x, _ = digits_images(32, channels=3)
    inputs, labels = docstring_batch(b, t - rows)
    vocab = ByteTokenizer.vocab_size
    text = inputs["input_ids"]
    ids = torch.cat([text[:, :1], torch.full((b, rows), vocab), text[:, 1:]], 1)  # (b, t)
    labels = torch.cat([labels[:, :1], torch.full((b, rows), -100), labels[:, 1:]], 1)
    return Workload("llava-grads", "transformers", real_models.llava(vocab, seq_len=t),
                    {"input_ids": ids, "pixel_values": x[:b]}, labels,
                    real_models.causal_lm_loss,
                    f"transformers LLaVA (CLIP 2x128 on the digits 3x32x32 in 8x8 patches, "
                    f"Llama 2x128), 16 image tokens per sample, batch {b}, T={t}, stdlib "
                    "docstrings as bytes, per-sample next-token cross-entropy")


# --- real-size transformers: word ids hashed into a real vocabulary ----------------------

GPT2_PIECES = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")
"""GPT-2's pre-tokenizer pattern (contractions, words and numbers with their leading
space, runs of punctuation, whitespace) in the standard library's ``re``: ``\\p{L}``
as ``[^\\W\\d_]``, ``\\p{N}`` as ``\\d``."""

BERT_PIECES = re.compile(r"\w+|[^\w\s]")
"""BERT's basic tokenizer on lowercased text: runs of word characters, and each
punctuation mark on its own."""


def hashed_ids(text: str, pieces: re.Pattern, first: int, stop: int) -> list[int]:
    """``text`` cut into pieces as a tokenizer's pre-tokenizer cuts it, each piece's id
    ``first + crc32(piece's UTF-8 bytes) mod (stop - first)``: a word-level vocabulary
    of ``stop - first`` ids without a table (the hashing trick), the same piece always
    the same id, the ids spread over ``first..stop-1``. Stands in for a trained BPE or
    WordPiece vocabulary, which would need a download.

    Examples:
        >>> ids = hashed_ids("the cat, the hat", GPT2_PIECES, 0, 50256)
        >>> len(ids), ids[0] == ids[3], ids[1] != ids[4], all(0 <= i < 50256 for i in ids)
        (5, False, True, True)
        >>> ids[2] == hashed_ids(",", GPT2_PIECES, 0, 50256)[0]
        True

    Source: Weinberger et al. 2009 (feature hashing); GPT-2's pre-tokenization pattern
    (Radford et al. 2019).
    """
    span = stop - first
    return [first + zlib.crc32(piece.encode("utf-8")) % span for piece in pieces.findall(text)]


def hashed_text_batch(batch: int, seq_len: int, first: int, stop: int, eos: int,
                      bos: int | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Consecutive windows of the standard library's docstrings for a causal LM whose
    vocabulary has ``stop`` ids: each docstring's pieces (:data:`GPT2_PIECES`) hashed
    into ``first..stop-1`` (:func:`hashed_ids`), after ``bos`` (if given) and before
    ``eos``, joined and cut into windows of ``seq_len``; the first ``batch`` windows.
    Nothing is padded (the attention mask is all ones).

    Returns:
        ``({"input_ids": (B, T) int64, "attention_mask": (B, T) int64}, labels)``,
        ``labels`` a copy of ``input_ids``.

    Raises:
        ValueError: the corpus has fewer than ``batch * seq_len`` tokens.

    Examples:
        >>> inputs, labels = hashed_text_batch(2, 8, 0, 50256, eos=50256)
        >>> inputs["input_ids"].shape, bool((labels == inputs["input_ids"]).all())
        (torch.Size([2, 8]), True)
    """
    ids: list[int] = []
    for text in stdlib_docstrings():
        ids += ([] if bos is None else [bos]) + hashed_ids(text, GPT2_PIECES, first, stop)
        ids.append(eos)
        if len(ids) >= batch * seq_len:
            break
    if len(ids) < batch * seq_len:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than "
                         f"batch * seq_len = {batch * seq_len}")
    input_ids = torch.tensor(ids[: batch * seq_len], dtype=torch.int64, device="cpu")
    input_ids = input_ids.view(batch, seq_len)
    mask = torch.ones_like(input_ids)
    return {"input_ids": input_ids, "attention_mask": mask}, input_ids.clone()


BERT_PAD, BERT_CLS, BERT_SEP, BERT_FIRST_WORD = 0, 101, 102, 999  # bert-base-uncased's ids


def padded_docstring_batch(batch: int, seq_len: int, vocab: int
                           ) -> tuple[dict[str, Tensor], Tensor]:
    """The first ``batch`` docstrings of the standard library as a BERT tokenizer pads
    them: ``[CLS]``, the lowercased pieces (:data:`BERT_PIECES`) hashed into
    ``999..vocab-1`` (:func:`hashed_ids`; below 999 are bert-base-uncased's special and
    unused ids), ``[SEP]``, truncated to ``seq_len`` and right-padded with ``[PAD]``
    (id 0): each sample its own length. Label: 1 where the docstring has more than one
    paragraph (a summary line and a body), else 0.

    Returns:
        ``({"input_ids", "token_type_ids" (zeros: one segment), "attention_mask" (1 on
        each sample's own tokens)}, labels (B,))``, all int64.

    Examples:
        >>> inputs, labels = padded_docstring_batch(4, 16, 30522)
        >>> inputs["attention_mask"].sum(1).tolist(), labels.tolist()
        ([13, 16, 16, 11], [0, 0, 1, 0])
    """
    texts = stdlib_docstrings()[:batch]
    ids = torch.zeros(batch, seq_len, dtype=torch.int64, device="cpu")  # [PAD] everywhere
    mask = torch.zeros_like(ids)
    for i, text in enumerate(texts):
        words = hashed_ids(text.lower(), BERT_PIECES, BERT_FIRST_WORD, vocab)[: seq_len - 2]
        row = [BERT_CLS, *words, BERT_SEP]
        ids[i, : len(row)] = torch.tensor(row, device="cpu")
        mask[i, : len(row)] = 1
    labels = torch.tensor([int("\n\n" in text) for text in texts], dtype=torch.int64,
                          device="cpu")
    inputs = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}
    return inputs, labels


def logits_cross_entropy(out: Any, labels: Tensor) -> Tensor:
    """``(B,)`` cross-entropies of a classifier's ``out.logits (B, C)`` against ``labels``.

    Examples:
        >>> out = type("Out", (), {"logits": torch.zeros(2, 4)})()
        >>> logits_cross_entropy(out, torch.tensor([0, 3]))  # log(4) each
        tensor([1.3863, 1.3863])
    """
    return F.cross_entropy(out.logits, labels, reduction="none")


def classifier_ce(out: Any, labels: Tensor) -> tuple[Tensor, Tensor, None]:
    """:func:`logits_cross_entropy` as Opacus's ghost clipping takes it: the logits
    ``(B, C)`` and the labels for ``nn.CrossEntropyLoss``."""
    return out.logits, labels, None


def causal_lm_ce(out: Any, labels: Tensor) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """:func:`~persample.cli.real_models.causal_lm_loss` as Opacus's ghost clipping
    takes it: the shifted logits flattened to ``(B * (T-1), V)``, the next tokens
    ``(B * (T-1),)`` and ``shape = (B, T-1)`` (Opacus's per-sequence mean).

    Examples:
        >>> out = type("Out", (), {"logits": torch.zeros(2, 5, 7)})()
        >>> [tuple(t.shape) if isinstance(t, Tensor) else t
        ...  for t in causal_lm_ce(out, torch.ones(2, 5, dtype=torch.long))]
        [(8, 7), (8,), (2, 4)]
    """
    logits, labels = out.logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), tuple(labels.shape)


def per_sample_positions(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """``inputs`` with ``position_ids = 0..T-1`` for every sample, ``(B, T)``: how
    Opacus's users pass a batch, so that its embedding grad samplers see batch-first
    ids (a model builds ``(1, T)`` positions itself otherwise). Right-padded samples
    keep positions counted from their first token, as the model counts them.

    Examples:
        >>> per_sample_positions({"input_ids": torch.zeros(2, 3)})["position_ids"]
        tensor([[0, 1, 2],
                [0, 1, 2]])
    """
    ids = inputs["input_ids"]  # (B, T)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
    return {**inputs, "position_ids": positions}


GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary; its last id is <|endoftext|>
BERT_VOCAB = 30522  # bert-base-uncased's WordPiece vocabulary
LLAMA_VOCAB, LLAMA_BOS, LLAMA_EOS = 32000, 1, 2  # Llama's SentencePiece vocabulary

REAL_GRAD_WORKLOADS = ("gpt2-768-grads", "bert-lora-grads", "llama-lora-grads")
SIZES = ("full", "tiny")


def real_workload(name: str, batch: int | None = None, size: str = "full",
                  device: torch.device | str = "cpu") -> Workload:
    """A real-size transformer with its real vocabulary, on the CPU (see
    :data:`REAL_GRAD_WORKLOADS`); random weights (``torch.manual_seed(0)``), eval mode,
    nothing downloaded; the text is the standard library's docstrings, each piece of it
    hashed into the model's vocabulary (:func:`hashed_ids`).

    ``gpt2-768-grads``: transformers ``GPT2LMHeadModel`` as ``GPT2Config()`` ships it
    (vocabulary 50257, width 768, 12 heads, 1024 positions, the output layer tied to
    the token embedding) with 4 layers, or the full 12 when ``device`` is a GPU; every
    parameter trained; B=8, T=128, per-sample next-token cross-entropy.
    ``bert-lora-grads``: ``BertForSequenceClassification``, vocabulary 30522, width
    768, 12 heads, 4 layers, 2 classes; peft LoRA r=8 on ``query``/``value`` with the
    classifier trained in full (``modules_to_save``), nothing else; B=16, T=128, each
    docstring padded to 128 (:func:`padded_docstring_batch`), cross-entropy per sample.
    ``llama-lora-grads``: ``LlamaForCausalLM``, vocabulary 32000, width 1024, 16 query
    heads sharing 4 key/value heads, 4 layers, MLP 2816, rotary positions, RMSNorm;
    peft LoRA r=16 on ``q_proj``/``k_proj``/``v_proj``/``o_proj``; B=8, T=128,
    per-sample next-token cross-entropy. The LoRA ``lora_B`` are drawn ``N(0, 0.02^2)``
    (as after some fine-tuning) instead of peft's zeros, so that every adapter's
    gradient is nonzero.

    ``size="tiny"`` builds the same workload (same vocabulary, data, loss, adapters
    and trainable parameters) at width 16, 2 layers, 4 heads (2 key/value heads for
    Llama), B = T = 4 (T = 16 for BERT, so that its samples have their own lengths),
    LoRA r=2: for tests.

    Args:
        name: one of :data:`REAL_GRAD_WORKLOADS`.
        batch: overrides the batch size ``B``.
        size: ``"full"`` or ``"tiny"``.
        device: where the workload will run: GPT-2 has 12 layers on a GPU, 4 elsewhere
            (the model is built on the CPU; :meth:`Workload.to` moves it).

    Raises:
        ValueError: an unknown name or size.
        persample.cli.real_models.NotInstalled: transformers or peft is missing.

    Examples:
        >>> w = real_workload("llama-lora-grads", size="tiny")
        >>> w.n, w.inputs["input_ids"].shape[1], int(w.inputs["input_ids"].max()) < 32000
        (4, 4, True)
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {SIZES}")
    tiny = size == "tiny"
    dims = dict(width=16, heads=4, layers=2) if tiny else None
    torch.manual_seed(0)
    if name == "gpt2-768-grads":
        gpu = torch.device(device).type == "cuda"
        b, t = batch or (4 if tiny else 8), 4 if tiny else 128
        layers = 2 if tiny else (12 if gpu else 4)
        model = real_models.gpt2(GPT2_VOCAB, seq_len=1024, **(dims or dict(
            width=768, heads=12, layers=layers)))
        inputs, labels = hashed_text_batch(b, t, 0, GPT2_VOCAB - 1, eos=GPT2_VOCAB - 1)
        depth = ("tiny test size" if tiny else "12 layers x 768" if gpu else
                 "4 layers x 768 (12 with --device cuda)")
        what = (f"GPT-2 small, {depth}, 12 heads, vocabulary 50257 tied to the output layer, "
                "every parameter trained")
        return Workload(name, "transformers", model, inputs, labels, real_models.causal_lm_loss,
                        f"transformers {what}, batch {b}, T={t}, stdlib docstrings hashed "
                        "to GPT-2's vocabulary, per-sample next-token cross-entropy",
                        per_sample_positions(inputs), causal_lm_ce)
    if name == "bert-lora-grads":
        b, t, rank = batch or (4 if tiny else 16), 16 if tiny else 128, 2 if tiny else 8
        model = real_models.bert_classifier(BERT_VOCAB, **(dict(dims, intermediate=32) if tiny
                                                         else {}))
        model = real_models.lora(model, rank, ["query", "value"], modules_to_save=["classifier"],
                                 task_type="SEQ_CLS", b_std=0.02)
        inputs, labels = padded_docstring_batch(b, t, BERT_VOCAB)
        lengths = inputs["attention_mask"].sum(1)
        return Workload(name, "peft", model, inputs, labels, logits_cross_entropy,
                        f"transformers BERT {'tiny' if tiny else '4x768, 12 heads'}, "
                        f"vocabulary 30522 + peft LoRA r={rank} on query/value, classifier "
                        f"trained, batch {b}, T={t} padded (lengths {int(lengths.min())}-"
                        f"{int(lengths.max())}), stdlib docstrings, 2 classes, cross-entropy",
                        per_sample_positions(inputs), classifier_ce, layout_rows=False)
    if name == "llama-lora-grads":
        b, t, rank = batch or (4 if tiny else 8), 4 if tiny else 128, 2 if tiny else 16
        model = real_models.llama(LLAMA_VOCAB, **(dict(dims, kv_heads=2, intermediate=32)
                                                  if tiny else {}))
        model = real_models.lora(model, rank, ["q_proj", "k_proj", "v_proj", "o_proj"],
                                 task_type="CAUSAL_LM", b_std=0.02)
        inputs, labels = hashed_text_batch(b, t, 3, LLAMA_VOCAB, eos=LLAMA_EOS, bos=LLAMA_BOS)
        return Workload(name, "peft", model, inputs, labels, real_models.causal_lm_loss,
                        f"transformers Llama {'tiny' if tiny else '4x1024, 16 heads / 4 kv'}"
                        f", vocabulary 32000 + peft LoRA r={rank} on q/k/v/o_proj, batch {b}, "
                        f"T={t}, stdlib docstrings hashed to the vocabulary, per-sample "
                        "next-token cross-entropy", per_sample_positions(inputs), causal_lm_ce,
                        layout_rows=False)
    raise ValueError(f"unknown workload {name!r}; choose from {REAL_GRAD_WORKLOADS}")


def _proxy_workload(name: str, batch: int | None) -> Workload:
    """The tiny configurations whose kernels are as short as a real model's on a GPU."""
    if name == "mlp-tiny-grads":
        x, y = digits_features(64)
        b = batch or 64
        return Workload(name, "gpu proxy", mlp([64] * 9 + [2], nn.ReLU).eval(), x[:b], y[:b],
                        nn.CrossEntropyLoss(), f"MLP 8x64 ReLU, batch {b}, digits projected "
                        "to 64, 2 classes, cross-entropy")
    b, t = batch or 16, 16
    if name == "gpt2-tiny-grads":
        model = real_models.gpt2(ByteTokenizer.vocab_size, seq_len=t, layers=2, width=64,
                                 heads=2)
        inputs, labels = docstring_batch(b, t)
        return Workload(name, "gpu proxy", model, inputs, labels, real_models.causal_lm_loss,
                        f"transformers GPT-2 2x64, 2 heads (eval), batch {b}, T={t}, stdlib "
                        "docstrings as bytes, per-sample next-token cross-entropy",
                        per_sample_positions(inputs), causal_lm_ce)
    model = real_models.bert_classifier(ByteTokenizer.vocab_size, layers=2, width=64, heads=2,
                                        intermediate=256, classes=4, max_positions=t)
    examples = docstring_examples("module", seq_len=t)
    picked = [examples[k * len(examples) // b] for k in range(b)]
    inputs = {key: torch.stack([e[key] for e in picked]) for key in ("input_ids", "attention_mask")}
    labels = torch.stack([e["labels"] for e in picked])
    types = torch.zeros_like(inputs["input_ids"])  # (B, T): per sample, as Opacus needs
    opacus_inputs = {**per_sample_positions(inputs), "token_type_ids": types}
    return Workload(name, "gpu proxy", model, inputs, labels, logits_cross_entropy,
                    f"transformers BERT 2x64, 2 heads, for sequence classification (eval), "
                    f"batch {b}, T={t}, which of 4 stdlib modules a docstring documents, "
                    "per-sample cross-entropy", opacus_inputs, classifier_ce)


def mlp(sizes: list[int], activation: type[nn.Module]) -> nn.Sequential:
    """Linear layers of the given sizes with ``activation`` between them (not after the last).

    Examples:
        >>> mlp([3, 4, 2], nn.ReLU)(torch.zeros(5, 3)).shape
        torch.Size([5, 2])
    """
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


def jacobian_workload(name: str, batch: int | None = None) -> Workload:
    """A Jacobian workload on the CPU (see :data:`JACOBIAN_WORKLOADS`); no targets, no loss.

    ``mlp-param-jac`` (the question on the gradients of all outputs: MLP 784-20-10,
    B=256, per-sample parameter Jacobian ``(B, 10, P)``), ``pinn-input-jac`` (the
    question on a Jacobian's diagonals: MLP 1-20-20-400 tanh, B=100, input Jacobian
    ``(B, 400, 1)``), ``clf-input-jac`` (the question on the derivative of a matrix
    output: MLP 784-256-256-10, B=256, input Jacobian ``(B, 10, 784)``). float32,
    ``torch.manual_seed(0)``.

    Raises:
        ValueError: an unknown name.

    Examples:
        >>> jacobian_workload("clf-input-jac", 8).inputs.shape
        torch.Size([8, 784])
    """
    torch.manual_seed(0)
    if name == "mlp-param-jac":
        x, _ = digits_images()
        b = batch or 256
        return Workload(name, "forum", mlp([784, 20, 10], nn.ReLU), x[:b].flatten(1), None, None,
                        f"MLP 784-20-10 ReLU, batch {b}, digits 28x28 flattened, (B, Y, P)")
    if name == "pinn-input-jac":
        b = batch or 100
        t = torch.rand(b, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        return Workload(name, "forum", mlp([1, 20, 20, 400], nn.Tanh), t, None, None,
                        f"MLP 1-20-20-400 tanh, batch {b}, t ~ U(0, 1), (B, 400, 1)")
    if name == "clf-input-jac":
        x, _ = digits_images()
        b = batch or 256
        return Workload(name, "forum", mlp([784, 256, 256, 10], nn.ReLU), x[:b].flatten(1), None,
                        None, f"MLP 784-256-256-10 ReLU, batch {b}, digits 28x28, (B, 10, 784)")
    raise ValueError(f"unknown workload {name!r}; choose from {JACOBIAN_WORKLOADS}")


DP_MAX_GRAD_NORM = 1.0  # C of the DP-SGD step workloads; sigma = 1


def dp_workload(name: str, batch: int | None = None, size: str = "full",
                device: torch.device | str = "cpu") -> Workload:
    """``cnn-norms`` (per-sample gradient norms of ``cnn-grads``) or one DP-SGD step
    (``X-dp-step``) on the per-sample gradients workload ``X-grads`` (``size`` and
    ``device`` as :func:`grads_workload` takes them).

    Raises:
        ValueError: an unknown name or size.
        persample.cli.real_models.NotInstalled: as :func:`grads_workload`.

    Examples:
        >>> dp_workload("deep-mlp-dp-step", 4).description.split("; ")[-1]
        'one DP-SGD step (C = 1.0, sigma = 1)'
    """
    if name == "cnn-norms":
        w = grads_workload("cnn-grads", batch, size, device)
        what = "per-sample gradient norms"
    elif name in BF16_DP_WORKLOADS:
        w = grads_workload(name.replace("-bf16-dp-step", "-grads"), batch, size, device)
        w.autocast = torch.bfloat16
        what = (f"one DP-SGD step (C = {DP_MAX_GRAD_NORM}, sigma = 1), every method and the "
                "plain step under torch.autocast(bfloat16)")
    elif name in DP_WORKLOADS:
        w = grads_workload(name.replace("-dp-step", "-grads"), batch, size, device)
        what = f"one DP-SGD step (C = {DP_MAX_GRAD_NORM}, sigma = 1)"
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {DP_WORKLOADS}")
    return replace(w, name=name, description=f"{w.description}; {what}")


PROJECTED_DIM = 1024
"""The projected dimensions of the ``-project`` workloads of small models."""
REAL_PROJECTED_DIM = 4096
"""... and of the real-size ones (LoGra's 64 x 64 per layer)."""


def projected_dim(name: str) -> int:
    """The projected dimensions of the workload ``name``.

    Examples:
        >>> projected_dim("gpt2-project"), projected_dim("gpt2-768-project")
        (1024, 4096)
    """
    return REAL_PROJECTED_DIM if name in REAL_WORKLOADS else PROJECTED_DIM


def attribution_workload(name: str, batch: int | None = None, size: str = "full",
                         device: torch.device | str = "cpu") -> Workload:
    """``X-gram``: the ``(B, B)`` Gram matrix of the per-sample gradients of the
    workload ``X-grads`` (TracIn's inner products), at B = 100 unless ``batch``;
    ``X-project``: those gradients projected to :func:`projected_dim` numbers each
    (LoGra's Kronecker map), at ``X-grads``' own batch size (and ``size``, ``device``).

    Raises:
        ValueError: an unknown name.

    Examples:
        >>> attribution_workload("deep-mlp-gram", 4).description.split("; ")[-1]
        'the (B, B) Gram matrix of the per-sample gradients'
    """
    if name not in ATTRIBUTION_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {ATTRIBUTION_WORKLOADS}")
    if name.endswith("-gram"):
        w = grads_workload(name.replace("-gram", "-grads"), batch or 100, size, device)
        what = "the (B, B) Gram matrix of the per-sample gradients"
    else:
        w = grads_workload(name.replace("-project", "-grads"), batch, size, device)
        what = f"the per-sample gradients projected to {projected_dim(name)} numbers (Kronecker)"
    return replace(w, name=name, description=f"{w.description}; {what}")


CURVATURE_WORKLOADS = ("ggn-diag", "ggn-diag-mc", "kfac-factors", "ekfac-influence")


def curvature_workload(name: str, batch: int | None = None, device: torch.device | str = "cpu"
                       ) -> Workload:
    """The curvature workloads on the seed CNN (``cnn-grads``'s model and digits):
    ``ggn-diag`` its per-sample GGN diagonal (exact), ``ggn-diag-mc`` the Monte Carlo one,
    ``kfac-factors`` K-FAC's factors (Monte Carlo Fisher).

    Raises:
        ValueError: an unknown name.

    Examples:
        >>> curvature_workload("ggn-diag", 2).description.split("; ")[-1]
        "each sample's GGN diagonal, exact"
    """
    what = {"ggn-diag": "each sample's GGN diagonal, exact",
            "ggn-diag-mc": "each sample's GGN diagonal, Monte Carlo (one label each)",
            "kfac-factors": "K-FAC's factors of every weight (Monte Carlo Fisher, expand)"}
    if name == "ekfac-influence":
        return _influence_workload(batch or 1100, device)
    if name not in what:
        raise ValueError(f"unknown workload {name!r}; choose from {CURVATURE_WORKLOADS}")
    w = grads_workload("cnn-grads", batch, "full", device)
    return replace(w, name=name, description=f"{w.description}; {what[name]}")


def influence_train(n: int) -> int:
    """How many of ``ekfac-influence``'s ``n`` samples are the training set: 1,000, and
    at least one query (a smaller batch: all but the last).

    Examples:
        >>> influence_train(1100), influence_train(4)
        (1000, 3)
    """
    return min(1000, n - 1)


def _influence_workload(n: int, device: torch.device | str) -> Workload:
    """``ekfac-influence``: a small CNN without biases (kronfluence joins biases to the
    weights) on the 16x16 digits, ``n`` samples (:func:`influence_train` of them the
    training set, the rest queries)."""
    from persample.cli.data import digits_images

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, bias=False), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, bias=False), nn.ReLU(), nn.Flatten(),
                          nn.Linear(800, 10, bias=False))
    x, y = digits_images(size=16)
    return Workload("ekfac-influence", "kronfluence's EK-FAC influence", model,
                    x[:n].to(device), y[:n].to(device), nn.CrossEntropyLoss(),
                    "CNN (2 conv, linear; no biases) on digits 1x16x16, "
                    f"{influence_train(n)} training samples x {n - influence_train(n)} "
                    "queries; "
                    "EK-FAC influence scores (empirical Fisher)").to(device)


REAL_ATTRIBUTION_WORKLOADS = ("gpt2-768-project",)
REAL_CURVATURE_WORKLOADS = ("gpt2-768-kfac-factors",)
"""GPT-2 4x768's K-FAC factors (:func:`~persample_bench.anchors.curvature_rows.gpt2_kfac_case`)
on ``gpt2-768-grads``'s model and text."""
ATTRIBUTION_WORKLOADS = ("deep-mlp-gram", "cnn-gram", "deep-mlp-project", "gpt2-project"
                         ) + REAL_ATTRIBUTION_WORKLOADS
BF16_DP_WORKLOADS = ("gpt2-768-bf16-dp-step",)
REAL_DP_WORKLOADS = tuple(name.replace("-grads", "-dp-step") for name in REAL_GRAD_WORKLOADS
                          ) + BF16_DP_WORKLOADS
REAL_WORKLOADS = tuple(w for pair in zip(REAL_GRAD_WORKLOADS, REAL_DP_WORKLOADS) for w in pair
                       ) + BF16_DP_WORKLOADS + REAL_ATTRIBUTION_WORKLOADS + REAL_CURVATURE_WORKLOADS
"""The real-size transformers with their real vocabularies (``persample bench --real``)."""
PROXY_WORKLOADS = ("bert-tiny-grads", "gpt2-tiny-grads", "mlp-tiny-grads", "vit-grads",
                   "lstm-grads")
"""Tiny configurations whose kernels are as short as a real model's on a GPU, where the
fixed cost per op decides the step (``persample bench --proxy``)."""
GRAD_WORKLOADS = ("cnn-grads", "deep-mlp-grads", "lstm-grads", "lstm-cell-grads",
                  "weight-norm-lstm-grads", "orthogonal-rnn-grads", "orthogonal-lstm-grads",
                  "seq2seq-decoder-grads",
                  "vit-grads", "resnet18-grads",
                  "gpt2-grads", "encoder-grads", "moe-grads", "bert-small-grads",
                  "vit-tiny-grads", "gnn-mlp-grads", "gpt-oss-grads", "qwen-moe-grads",
                  "switch-moe-grads", "vit-mae-grads", "llava-grads", "gcn-batch-grads"
                  ) + PROXY_WORKLOADS[:3] + REAL_GRAD_WORKLOADS
JACOBIAN_WORKLOADS = ("mlp-param-jac", "pinn-input-jac", "clf-input-jac")
DP_WORKLOADS = ("cnn-norms", "cnn-dp-step", "deep-mlp-dp-step", "resnet18-dp-step",
                "gpt2-dp-step", "gpt2-lora-dp-step", "encoder-dp-step") + REAL_DP_WORKLOADS
SMALL_WORKLOADS = tuple(w for w in GRAD_WORKLOADS + JACOBIAN_WORKLOADS + DP_WORKLOADS
                        + ATTRIBUTION_WORKLOADS + CURVATURE_WORKLOADS if w not in REAL_WORKLOADS)
"""The workloads of small models (seconds each; ``persample bench --no-real``)."""
WORKLOADS = SMALL_WORKLOADS + REAL_WORKLOADS
QUICK_WORKLOADS = ("cnn-grads", "cnn-dp-step", "ggn-diag", "ekfac-influence")
"""``persample bench --quick``: the README's headline rows that fit in two minutes on a
2-core CPU (about 2.5 GB), each at its own size (the tutorial's CNN: per-sample gradients,
a DP-SGD step, the exact GGN diagonal; EK-FAC influence, 1,000 x 100). Left out: the
50-layer MLP (a 1.8 GB result), ResNet-18 (torchvision) and the real-size GPT-2."""
