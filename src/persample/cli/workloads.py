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


GRAD_WORKLOADS = ("cnn-grads", "deep-mlp-grads")
JACOBIAN_WORKLOADS = ("mlp-param-jac", "pinn-input-jac", "clf-input-jac")
DP_WORKLOADS = ("cnn-norms", "cnn-dp-step")
WORKLOADS = GRAD_WORKLOADS + JACOBIAN_WORKLOADS + DP_WORKLOADS
