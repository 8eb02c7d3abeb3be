"""The benchmark's workloads: the models of the questions and tutorials persample
answers, on scikit-learn's digits,
and real models (torchvision resnet18, timm ViT, transformers GPT-2) on real data.

The real models' packages are imported only when their workload is built
(:mod:`persample.cli.real_models`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..data import ByteTokenizer, digits_features, digits_images, docstring_batch
from . import real_models


def simple_cnn() -> nn.Sequential:
    """Seed 001's SimpleCNN (conv 1->32 k3, conv 32->64 k3, maxpool 2, fc 9216->128->10).

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, 10)``; 1,199,882 parameters.

    Example:
        >>> simple_cnn()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, 32, 3, 1),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(32, 64, 3, 1),
            relu2=nn.ReLU(),
            pool=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
            fc1=nn.Linear(9216, 128),
            relu3=nn.ReLU(),
            fc2=nn.Linear(128, 10),
        )
    )


def deep_mlp(depth: int = 50, width: int = 300, classes: int = 2) -> nn.Sequential:
    """Seed 004's benchmark MLP: ``depth`` ReLU layers of ``width`` units, then the classes.

    Takes ``(B, width)``, returns logits ``(B, classes)``.

    Example:
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

    Example:
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
    """

    name: str
    source: str
    model: nn.Module
    inputs: Any
    targets: Tensor | None
    loss_fn: Callable[[Any, Tensor], Tensor] | None
    description: str

    def __post_init__(self) -> None:
        self.model = self.model.float()  # whatever torch's default dtype is

    @property
    def n(self) -> int:
        """The batch size ``B``: dim 0 of the (first) input tensor."""
        first = next(iter(self.inputs.values())) if isinstance(self.inputs, dict) else self.inputs
        return first.shape[0]

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (float32), hence of every result."""
        return next(self.model.parameters()).dtype

    def call(self, model: nn.Module | None = None) -> Any:
        """``model(inputs)`` or ``model(**inputs)`` (default: the workload's model)."""
        model = self.model if model is None else model
        return model(**self.inputs) if isinstance(self.inputs, dict) else model(self.inputs)

    def to(self, device: torch.device | str) -> Workload:
        """Move the model, inputs and targets to ``device`` (in place); returns ``self``.

        Example:
            >>> w = grads_workload("cnn-grads", 2).to("cpu")
            >>> w.n, w.device.type
            (2, 'cpu')
        """
        self.model = self.model.to(device)
        self.inputs = tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t,
                               self.inputs)
        if self.targets is not None:
            self.targets = self.targets.to(device)
        return self


def grads_workload(name: str, batch: int | None = None) -> Workload:
    """A per-sample gradients workload on the CPU (see :data:`GRAD_WORKLOADS`).

    ``cnn-grads`` (the SimpleCNN of torch.func's "Per-sample-gradients" tutorial, B=64,
    digits 28x28), ``deep-mlp-grads`` (the 50x300 MLP of the benchmark of Goodfellow's
    trick in "fast-individual-gradients-with-autodiff", B=100, digits projected to 300
    features, 2 classes),
    ``lstm-grads`` (:class:`RowLSTM`, B=64), ``vit-grads`` (timm ``VisionTransformer``,
    4x4 patches of the 28x28 digits, 2 layers of width 64, B=64), ``resnet18-grads``
    (torchvision ``resnet18(num_classes=10)``, digits 32x32 repeated to 3 channels,
    B=32), all with ``nn.CrossEntropyLoss()`` (mean); ``gpt2-grads`` (transformers
    ``GPT2LMHeadModel``, 4 layers x 256, 4 heads, byte vocabulary of 257, T=64, B=16,
    on the standard library's docstrings, inputs ``{"input_ids", "attention_mask"}``,
    per-sample next-token cross-entropy ``(B,)``). Models in eval mode, float32,
    ``torch.manual_seed(0)``.

    Args:
        name: one of :data:`GRAD_WORKLOADS`.
        batch: overrides the batch size ``B``.

    Raises:
        ValueError: an unknown name.
        persample.cli.real_models.NotInstalled: timm, torchvision or transformers is
            needed and missing.

    Example:
        >>> w = grads_workload("cnn-grads", batch=4)
        >>> w.inputs.shape, w.targets.shape
        (torch.Size([4, 1, 28, 28]), torch.Size([4]))
    """
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
        return Workload(name, "rnn", RowLSTM().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"LSTM(28, 128) over image rows, batch {b}, digits 1x28x28, "
                        "cross-entropy")
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


def mlp(sizes: list[int], activation: type[nn.Module]) -> nn.Sequential:
    """Linear layers of the given sizes with ``activation`` between them (not after the last).

    Example:
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

    Example:
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


def dp_workload(name: str, batch: int | None = None) -> Workload:
    """``cnn-norms`` (per-sample gradient norms of ``cnn-grads``) or one DP-SGD step
    (``X-dp-step``) on the per-sample gradients workload ``X-grads``.

    Raises:
        ValueError: an unknown name.
        persample.cli.real_models.NotInstalled: as :func:`grads_workload`.

    Example:
        >>> dp_workload("deep-mlp-dp-step", 4).description.split("; ")[-1]
        'one DP-SGD step (C = 1.0, sigma = 1)'
    """
    if name == "cnn-norms":
        w = grads_workload("cnn-grads", batch)
        what = "per-sample gradient norms"
    elif name in DP_WORKLOADS:
        w = grads_workload(name.replace("-dp-step", "-grads"), batch)
        what = f"one DP-SGD step (C = {DP_MAX_GRAD_NORM}, sigma = 1)"
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {DP_WORKLOADS}")
    return replace(w, name=name, description=f"{w.description}; {what}")


GRAD_WORKLOADS = ("cnn-grads", "deep-mlp-grads", "lstm-grads", "vit-grads", "resnet18-grads",
                  "gpt2-grads")
JACOBIAN_WORKLOADS = ("mlp-param-jac", "pinn-input-jac", "clf-input-jac")
DP_WORKLOADS = ("cnn-norms", "cnn-dp-step", "deep-mlp-dp-step", "resnet18-dp-step",
                "gpt2-dp-step", "gpt2-lora-dp-step")
WORKLOADS = GRAD_WORKLOADS + JACOBIAN_WORKLOADS + DP_WORKLOADS
