"""The seed workloads of PERFORMANCE.md, on scikit-learn's digits."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..data import digits_features, digits_images


def simple_cnn() -> nn.Sequential:
    """Seed 001's SimpleCNN (conv 1->32 k3, conv 32->64 k3, maxpool 2, fc 9216->128->10)."""
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
    """Seed 004's benchmark MLP: ``depth`` ReLU layers of ``width`` units, then the classes."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class RowLSTM(nn.Module):
    """Reads a 28x28 image row by row: LSTM(28, 128) over 28 steps, Linear on the last state."""

    def __init__(self, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(28, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        _, (h, _) = self.lstm(x.flatten(1, 2))  # (B, 28, 28) -> h (1, B, hidden)
        return self.head(h[-1])


class TinyViT(nn.Module):
    """A small vision Transformer: 4x4 patches, a class token and a positional embedding
    (parameters of the model itself), 2 encoder layers of width 64, a Linear head."""

    def __init__(self, width: int = 64, depth: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Linear(16, width)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, 50, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        patches = x.unfold(2, 4, 4).unfold(3, 4, 4).flatten(1, 3).flatten(2)  # (B, 49, 16)
        h = self.patch(patches)
        h = torch.cat([self.cls.expand(len(x), -1, -1), h], 1) + self.pos  # (B, 50, width)
        return self.head(self.encoder(h)[:, 0])


@dataclass
class Workload:
    """A model, a batch of real data and a loss; all in float32 as PERFORMANCE.md says."""

    name: str
    seed: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor | None
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None
    description: str

    def __post_init__(self) -> None:
        self.model = self.model.float()  # whatever torch's default dtype is


def grads_workload(name: str, batch: int | None = None) -> Workload:
    """``cnn-grads`` (batch 64, digits 28x28) or ``deep-mlp-grads`` (batch 100, 300 features)."""
    torch.manual_seed(0)
    if name == "cnn-grads":
        x, y = digits_images()
        b = batch or 64
        return Workload(name, "001", simple_cnn().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"SimpleCNN, batch {b}, digits 1x28x28, cross-entropy")
    if name == "deep-mlp-grads":
        x, y = digits_features()
        b = batch or 100
        return Workload(name, "004", deep_mlp().eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"MLP 50x300 ReLU, batch {b}, digits projected to 300, 2 classes")
    if name in ("lstm-grads", "vit-grads"):
        x, y = digits_images()
        b = batch or 64
        model, what = (RowLSTM(), "LSTM(28, 128) over image rows") if name == "lstm-grads" \
            else (TinyViT(), "ViT: 4x4 patches, class token, 2 layers of width 64")
        return Workload(name, "issue 5", model.eval(), x[:b], y[:b], nn.CrossEntropyLoss(),
                        f"{what}, batch {b}, digits 1x28x28, cross-entropy")
    raise ValueError(f"unknown workload {name!r}; choose from {GRAD_WORKLOADS}")


def mlp(sizes: list[int], activation: type[nn.Module]) -> nn.Sequential:
    """Linear layers of the given sizes with ``activation`` between them."""
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


def jacobian_workload(name: str, batch: int | None = None) -> Workload:
    """``mlp-param-jac`` (seed 000), ``pinn-input-jac`` (seed 002), ``clf-input-jac`` (seed 003)."""
    torch.manual_seed(0)
    if name == "mlp-param-jac":
        x, _ = digits_images()
        b = batch or 256
        return Workload(name, "000", mlp([784, 20, 10], nn.ReLU), x[:b].flatten(1), None, None,
                        f"MLP 784-20-10 ReLU, batch {b}, digits 28x28 flattened, (B, Y, P)")
    if name == "pinn-input-jac":
        b = batch or 100
        t = torch.rand(b, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        return Workload(name, "002", mlp([1, 20, 20, 400], nn.Tanh), t, None, None,
                        f"MLP 1-20-20-400 tanh, batch {b}, t ~ U(0, 1), (B, 400, 1)")
    if name == "clf-input-jac":
        x, _ = digits_images()
        b = batch or 256
        return Workload(name, "003", mlp([784, 256, 256, 10], nn.ReLU), x[:b].flatten(1), None,
                        None, f"MLP 784-256-256-10 ReLU, batch {b}, digits 28x28, (B, 10, 784)")
    raise ValueError(f"unknown workload {name!r}; choose from {JACOBIAN_WORKLOADS}")


GRAD_WORKLOADS = ("cnn-grads", "deep-mlp-grads", "lstm-grads", "vit-grads")
JACOBIAN_WORKLOADS = ("mlp-param-jac", "pinn-input-jac", "clf-input-jac")
DP_WORKLOADS = ("cnn-norms", "cnn-dp-step")
WORKLOADS = GRAD_WORKLOADS + JACOBIAN_WORKLOADS + DP_WORKLOADS
