"""Test cases as data (BackPACK style): one dict per model, turned into pytest ids.

A case is ``{"id", "module_fn", "input_fn", "target_fn", "loss_fn", "seed"}``:

- ``module_fn()`` builds the model (converted to float64 by :func:`build`);
- ``input_fn(n)`` returns the inputs of a batch of ``n`` samples: a tensor, or a
  tuple of tensors passed as ``model(*inputs)``;
- ``target_fn(output)`` draws targets fitting the model's output (``None``: the
  loss takes no targets);
- ``loss_fn(reduction)`` returns ``loss(output, targets)`` reduced over the batch
  as ``reduction`` (``"mean"`` / ``"sum"``) says, or a per-sample loss ``(B,)``
  that ignores it.

Adding a layer to the tests is one more dict in :data:`CASES`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

N = 3  # default batch size of a case

# ---------------------------------------------------------------------------
# inputs, targets, losses


def randn(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def ids(vocab: int, *shape: int) -> Tensor:
    return torch.randint(0, vocab, shape)


def regression(output: Tensor) -> Tensor:
    """A real target of the output's shape."""
    return torch.randn_like(output)


def classes(output: Tensor) -> Tensor:
    """Class indices for logits ``(B, C, *extra)``: shape ``(B, *extra)``."""
    return torch.randint(0, output.shape[1], (output.shape[0], *output.shape[2:]))


def cross_entropy(reduction: str) -> Callable:
    return nn.CrossEntropyLoss(reduction=reduction)


def mse(reduction: str) -> Callable:
    return nn.MSELoss(reduction=reduction)


def nll(reduction: str) -> Callable:
    return lambda out, y: F.nll_loss(F.log_softmax(out, dim=1), y, reduction=reduction)


def per_sample_squares(reduction: str) -> Callable:
    """``(B,)``: each sample's summed squared error; ``reduction`` does not apply."""
    return lambda out, y: ((out - y) ** 2).flatten(1).sum(1)


def per_sample_cross_entropy(reduction: str) -> Callable:
    """``(B,)``: each sample's cross-entropy summed over extra positions."""
    return lambda out, y: F.cross_entropy(out, y, reduction="none").reshape(len(y), -1).sum(1)


def no_target_loss(reduction: str) -> Callable:
    """``(B,)`` from the output alone (targets are ``None``)."""
    return lambda out, y: (torch.sin(out) * out).flatten(1).sum(1)


def mixed_loss(reduction: str) -> Callable:
    """Targets are a tuple ``(real (B, 2), class (B,))``: MSE on 2 outputs + CE on the rest."""
    mse_, ce_ = nn.MSELoss(reduction=reduction), nn.CrossEntropyLoss(reduction=reduction)
    return lambda out, y: mse_(out[:, :2], y[0]) + ce_(out[:, 2:], y[1])


def mixed_targets(output: Tensor) -> tuple[Tensor, Tensor]:
    return torch.randn(output.shape[0], 2), torch.randint(0, output.shape[1] - 2, (len(output),))


# ---------------------------------------------------------------------------
# small models


class Scale(nn.Module):
    """A learnable elementwise scale: no rule (the capture follows its weight op by op)."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class ParentWithParam(nn.Module):
    """A module with its own direct parameter and child Linear layers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.gain = nn.Parameter(torch.randn(5))
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.gain + self.gain**2)


class TiedLM(nn.Module):
    """Embedding and output Linear share one weight; logits ``(B, V, T)``."""

    def __init__(self, vocab: int = 11, dim: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(x)))  # (B, T, D)
        return self.out(h).transpose(1, 2)  # (B, V, T)


class LinearTwice(nn.Module):
    """One Linear called twice in a forward (RNN-style reuse)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.cell(torch.tanh(self.cell(x)))))


class ConvTwice(nn.Module):
    """One Conv2d called twice, on inputs of different spatial sizes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)  # (B, 2, 6, 6)
        z = self.conv(F.avg_pool2d(torch.tanh(y), 2))  # (B, 2, 3, 3)
        return y.flatten(1)[:, :18] + z.flatten(1)


class WithUnused(nn.Module):
    """A direct parameter and a child Linear that the forward never uses: zero rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.unused_param = nn.Parameter(torch.randn(2, 2))
        self.unused_layer = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class TwoInputs(nn.Module):
    """Takes a tuple of two inputs: ``model(a, b)``."""

    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(4, 3)
        self.fb = nn.Conv1d(2, 3, 3)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.fa(a) * self.fb(b).mean(-1)


class Attention(nn.Module):
    """nn.MultiheadAttention uses ``out_proj.weight`` without calling ``out_proj``."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.attn(x, x, x)  # (B, T, 8)
        return self.head(y.mean(1))


class SimpleCNN(nn.Module):
    """The SimpleCNN of PyTorch's per-sample-gradients tutorial, shrunk: conv, conv,
    maxpool, flatten, fc, fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 6, 3, 1)
        self.fc1 = nn.Linear(6 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


def frozen_mlp() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    net[0].weight.requires_grad_(False)
    net[2].bias.requires_grad_(False)
    return net


def batchnorm_eval() -> nn.Module:
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                        nn.Linear(12, 3))
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net.eval()


class AttentionWithMask(nn.Module):
    """nn.MultiheadAttention with a ``key_padding_mask`` keyword (a bool input)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        y, _ = self.attn(x, x, x, key_padding_mask=mask)  # (B, T, 8)
        return self.head(y.mean(1))


def masked_tokens(n: int) -> tuple[Tensor, Tensor]:
    mask = torch.zeros(n, 4, dtype=torch.bool)
    mask[:, 3] = torch.rand(n) < 0.5  # never all keys of a sample
    return randn(n, 4, 8), mask


class Encoder(nn.Module):
    """A whole nn.TransformerEncoderLayer (attention, LayerNorm, feed-forward)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                              batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x).mean(1))


class FunctionalWeight(nn.Module):
    """``fc``'s parameters are used through F.linear, ``fc`` itself is never called."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.out = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(F.linear(x, self.fc.weight, self.fc.bias)))


class SumScale(nn.Module):
    """Holds a reference to another module's weight (tying a rule and the fallback)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight.sum(0)


class TiedRuleAndFallback(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = SumScale(self.fc.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale(torch.tanh(self.fc(x)))


class Siamese(nn.Module):
    """One encoder applied to both inputs of a pair."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return (torch.tanh(self.enc(a)) - torch.tanh(self.enc(b))).pow(2).sum(1, keepdim=True)


class TwoHeads(nn.Module):
    """Returns a tuple of outputs; the loss uses both."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Conv1d(1, 2, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(x.unsqueeze(1))


def two_heads_targets(output: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return tuple(torch.randn_like(o) for o in output)


def two_heads_loss(reduction: str) -> Callable:
    mse_ = nn.MSELoss(reduction=reduction)
    return lambda out, y: mse_(out[0], y[0]) + 2 * mse_(out[1], y[1])


class KeywordCall(nn.Module):
    """Calls its Linear with a keyword argument: ``self.fc(input=x)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(input=x)


class TiedFunctional(nn.Module):
    """The embedding is called, and its weight is also used outside it (GPT-style head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(x)))  # (B, T, 4)
        return (h @ self.emb.weight.T).transpose(1, 2)  # (B, 7, T)


class BiasAlsoOutside(nn.Module):
    """``fc.bias`` is used by the called ``fc`` and again by the parent."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + x[:, :3] * self.fc.bias


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x * self.weight}


class UsesDictOutput(nn.Module):
    """A parameterised submodule (no rule) that returns a dict."""

    def __init__(self):
        super().__init__()
        self.inner = DictOutput()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.inner(x)["y"])


class NestedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return x, (x * self.weight, x)


class UsesNestedOutput(nn.Module):
    """A parameterised submodule (no rule) that returns a nested tuple."""

    def __init__(self):
        super().__init__()
        self.inner = NestedOutput()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.inner(x)[1][0])


def classes_some_ignored(output: Tensor) -> Tensor:
    """Class targets ``(B, T)`` with ``-100`` (ignored) at a different count per sample."""
    y = classes(output)
    for i in range(len(y)):
        y[i, : i % y.shape[1]] = -100
    return y


def frozen(module: nn.Module, *names: str) -> nn.Module:
    for name in names:
        module.get_parameter(name).requires_grad_(False)
    return module


def conv_channels_last() -> nn.Module:
    return nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------
# the cases


def case(
    id: str,
    module_fn: Callable[[], nn.Module],
    input_fn: Callable[[int], Any],
    target_fn: Callable[[Tensor], Any] | None = regression,
    loss_fn: Callable[[str], Callable] = mse,
    seed: int = 0,
    vmap: bool = True,
) -> dict[str, Any]:
    """One case; ``vmap=False``: torch.func cannot batch the model (an RNN), so
    ``method="vmap"`` must refuse it (tested once) instead of matching the loop."""
    return {"id": id, "module_fn": module_fn, "input_fn": input_fn,
            "target_fn": target_fn, "loss_fn": loss_fn, "seed": seed, "vmap": vmap}


CASES: list[dict[str, Any]] = [
    # nn.Linear
    case("linear-2d", lambda: nn.Linear(4, 3), lambda n: randn(n, 4), classes, cross_entropy),
    case("linear-seq", lambda: nn.Linear(4, 3), lambda n: randn(n, 5, 4)),
    case("linear-4d", lambda: nn.Linear(4, 3), lambda n: randn(n, 2, 3, 4)),
    case("linear-nobias", lambda: nn.Linear(4, 3, bias=False), lambda n: randn(n, 4),
         classes, cross_entropy),
    case("linear-seq-nobias-persample", lambda: nn.Linear(4, 3, bias=False),
         lambda n: randn(n, 5, 4), regression, per_sample_squares),
    case("mlp", lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
         lambda n: randn(n, 4), classes, cross_entropy),
    case("mlp-persample-ce", lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)),
         lambda n: randn(n, 4), classes, per_sample_cross_entropy),
    case("mlp-no-targets", lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
         lambda n: randn(n, 4), None, no_target_loss),
    case("mlp-tuple-targets", lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)),
         lambda n: randn(n, 4), mixed_targets, mixed_loss),
    # nn.Conv1d / 2d / 3d
    case("conv1d-stride2-pad1", lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1),
         lambda n: randn(n, 2, 9)),
    case("conv1d-same-even-kernel", lambda: nn.Conv1d(2, 3, 4, padding="same"),
         lambda n: randn(n, 2, 7)),
    case("conv1d-same-dilation", lambda: nn.Conv1d(2, 3, 3, padding="same", dilation=2),
         lambda n: randn(n, 2, 8)),
    case("conv1d-valid-nobias", lambda: nn.Conv1d(2, 3, 3, padding="valid", bias=False),
         lambda n: randn(n, 2, 6)),
    case("conv1d-groups2", lambda: nn.Conv1d(4, 6, 3, groups=2, padding=1),
         lambda n: randn(n, 4, 5)),
    case("conv1d-reflect", lambda: nn.Conv1d(2, 3, 3, padding=2, padding_mode="reflect"),
         lambda n: randn(n, 2, 6)),
    case("conv1d-circular-stride2",
         lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1, padding_mode="circular"),
         lambda n: randn(n, 2, 7)),
    case("conv1d-replicate-same-even",
         lambda: nn.Conv1d(2, 3, 2, padding="same", padding_mode="replicate"),
         lambda n: randn(n, 2, 5), regression, per_sample_squares),
    case("conv2d", lambda: nn.Conv2d(2, 3, 3), lambda n: randn(n, 2, 5, 5)),
    case("conv2d-tuple-stride-pad-dilation",
         lambda: nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
         lambda n: randn(n, 2, 6, 5)),
    case("conv2d-same-even-kernel", lambda: nn.Conv2d(2, 3, (4, 2), padding="same"),
         lambda n: randn(n, 2, 5, 6)),
    case("conv2d-same-dilation-nobias",
         lambda: nn.Conv2d(2, 3, 3, padding="same", dilation=(2, 1), bias=False),
         lambda n: randn(n, 2, 6, 5)),
    case("conv2d-groups3-nobias", lambda: nn.Conv2d(3, 6, 3, groups=3, bias=False, padding=1),
         lambda n: randn(n, 3, 4, 4)),
    case("conv2d-depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4), lambda n: randn(n, 4, 4, 5)),
    case("conv2d-reflect", lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
         lambda n: randn(n, 2, 4, 5)),
    case("conv2d-circular-stride2",
         lambda: nn.Conv2d(2, 3, 3, stride=2, padding=(1, 2), padding_mode="circular"),
         lambda n: randn(n, 2, 5, 6)),
    case("conv2d-replicate-same-even",
         lambda: nn.Conv2d(2, 3, 4, padding="same", padding_mode="replicate"),
         lambda n: randn(n, 2, 5, 5)),
    case("conv3d", lambda: nn.Conv3d(2, 3, 2), lambda n: randn(n, 2, 3, 4, 3)),
    case("conv3d-stride-pad-dilation-groups2",
         lambda: nn.Conv3d(2, 4, 3, stride=(1, 2, 1), padding=(1, 0, 2), dilation=(2, 1, 1),
                           groups=2),
         lambda n: randn(n, 2, 4, 5, 3)),
    case("conv3d-same-even-kernel", lambda: nn.Conv3d(1, 2, (2, 3, 4), padding="same"),
         lambda n: randn(n, 1, 3, 4, 5)),
    case("conv3d-valid-nobias", lambda: nn.Conv3d(2, 2, 2, padding="valid", bias=False),
         lambda n: randn(n, 2, 3, 3, 3)),
    case("conv3d-reflect", lambda: nn.Conv3d(1, 2, 3, padding=1, padding_mode="reflect"),
         lambda n: randn(n, 1, 3, 3, 4)),
    case("conv3d-circular", lambda: nn.Conv3d(1, 2, 2, padding=(1, 0, 1), padding_mode="circular"),
         lambda n: randn(n, 1, 3, 3, 3)),
    case("conv3d-replicate-same",
         lambda: nn.Conv3d(2, 2, 3, padding="same", padding_mode="replicate"),
         lambda n: randn(n, 2, 3, 3, 3)),
    case("conv2d-relu-linear-ce",
         lambda: nn.Sequential(nn.Conv2d(1, 3, 3, stride=2), nn.ReLU(), nn.Flatten(),
                               nn.Linear(3 * 3 * 3, 4)),
         lambda n: randn(n, 1, 7, 7), classes, cross_entropy),
    # nn.Embedding
    case("embedding-1d-ids", lambda: nn.Embedding(7, 3), lambda n: ids(7, n)),
    case("embedding-2d-ids", lambda: nn.Embedding(7, 3), lambda n: ids(7, n, 5)),
    case("embedding-repeated-ids-padding-idx", lambda: nn.Embedding(5, 3, padding_idx=0),
         lambda n: ids(3, n, 6)),  # 6 ids from {0, 1, 2}: repeats in every sample
    case("embedding-3d-ids", lambda: nn.Embedding(6, 2, padding_idx=4),
         lambda n: ids(6, n, 2, 3)),
    case("embedding-linear-ce",
         lambda: nn.Sequential(nn.Embedding(10, 4, padding_idx=2), nn.Flatten(),
                               nn.Linear(4 * 5, 3)),
         lambda n: ids(10, n, 5), classes, cross_entropy),
    case("embedding-scale-grad-by-freq", lambda: nn.Embedding(5, 3, scale_grad_by_freq=True),
         lambda n: ids(3, n, 4)),
    # nn.LayerNorm
    case("layernorm-last-dim", lambda: nn.LayerNorm(4), lambda n: randn(n, 5, 4)),
    case("layernorm-last-2-dims", lambda: nn.LayerNorm((3, 4)), lambda n: randn(n, 2, 3, 4)),
    case("layernorm-2d-input", lambda: nn.LayerNorm(4), lambda n: randn(n, 4)),
    case("layernorm-no-bias", lambda: nn.LayerNorm(4, bias=False), lambda n: randn(n, 3, 4),
         regression, per_sample_squares),
    case("layernorm-no-affine-mlp",
         lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, elementwise_affine=False),
                               nn.Linear(5, 3)),
         lambda n: randn(n, 4), classes, cross_entropy),
    # nn.GroupNorm
    case("groupnorm-0d-groups3", lambda: nn.GroupNorm(3, 6), lambda n: randn(n, 6)),
    case("groupnorm-1d-groups1", lambda: nn.GroupNorm(1, 4), lambda n: randn(n, 4, 5)),
    case("groupnorm-2d-groups2", lambda: nn.GroupNorm(2, 4), lambda n: randn(n, 4, 3, 3)),
    case("groupnorm-3d-groups4", lambda: nn.GroupNorm(4, 4), lambda n: randn(n, 4, 2, 2, 3)),
    case("conv-groupnorm-no-affine",
         lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4, affine=False),
                               nn.Tanh(), nn.Conv2d(4, 2, 2)),
         lambda n: randn(n, 2, 5, 5)),
    # the per-module torch.func fallback
    case("custom-scale",
         lambda: nn.Sequential(nn.Linear(4, 5), Scale(5), nn.Tanh(), nn.Linear(5, 3)),
         lambda n: randn(n, 4), classes, cross_entropy),
    case("parent-param-and-children", ParentWithParam, lambda n: randn(n, 4),
         classes, cross_entropy),
    case("batchnorm-eval", batchnorm_eval, lambda n: randn(n, 2, 4, 4), classes, cross_entropy),
    case("multihead-attention", Attention, lambda n: randn(n, 3, 8), classes, cross_entropy),
    # reuse, tying, frozen, unused, several inputs
    case("tied-embedding-output", TiedLM, lambda n: ids(11, n, 4), classes, cross_entropy),
    case("linear-called-twice", LinearTwice, lambda n: randn(n, 4), classes, cross_entropy),
    case("conv-called-twice", ConvTwice, lambda n: randn(n, 2, 6, 6)),
    case("frozen-params", frozen_mlp, lambda n: randn(n, 4), classes, cross_entropy),
    case("unused-params", WithUnused, lambda n: randn(n, 4), classes, cross_entropy),
    case("two-inputs", TwoInputs, lambda n: (randn(n, 4), randn(n, 2, 5))),
    case("simple-cnn", SimpleCNN, lambda n: randn(n, 1, 12, 12), classes, nll),
    # more layouts, frozen parts, functional use of weights, reuse, tuple outputs
    case("conv2d-channels-last", conv_channels_last,
         lambda n: randn(n, 3, 5, 5).to(memory_format=torch.channels_last)),
    case("conv2d-frozen-weight", lambda: frozen(nn.Conv2d(2, 3, 3), "weight"),
         lambda n: randn(n, 2, 5, 5)),
    case("layernorm-frozen-weight", lambda: frozen(nn.LayerNorm(4), "weight"),
         lambda n: randn(n, 5, 4)),
    case("linear-transposed-input", lambda: nn.Linear(4, 3),
         lambda n: randn(n, 4, 5).transpose(1, 2)),
    case("multihead-attention-key-padding-mask", AttentionWithMask, masked_tokens,
         classes, cross_entropy),
    case("transformer-encoder-layer", Encoder, lambda n: randn(n, 4, 8), classes,
         cross_entropy),
    case("weight-used-functionally", FunctionalWeight, lambda n: randn(n, 4)),
    case("tied-rule-and-fallback", TiedRuleAndFallback, lambda n: randn(n, 4)),
    case("siamese", Siamese, lambda n: (randn(n, 4), randn(n, 4))),
    case("model-returns-tuple", TwoHeads, lambda n: randn(n, 4), two_heads_targets,
         two_heads_loss),
]

# Cases that a careless engine gets silently wrong: kept apart so that a failure
# here reads as one precise bug, not as dozens of failures in every test.
EDGE_CASES: list[dict[str, Any]] = [
    case("linear-called-with-keyword-input", KeywordCall, lambda n: randn(n, 4)),
    case("param-used-inside-and-outside-its-module", TiedFunctional, lambda n: ids(7, n, 5),
         classes, cross_entropy),
    case("bias-used-inside-and-outside-its-module", BiasAlsoOutside, lambda n: randn(n, 4)),
    case("submodule-returns-dict", UsesDictOutput, lambda n: randn(n, 4)),
    case("submodule-returns-nested-tuple", UsesNestedOutput, lambda n: randn(n, 4)),
    case("cross-entropy-ignore-index", lambda: nn.Linear(4, 5),
         lambda n: randn(n, 3, 4), lambda out: classes_some_ignored(out.transpose(1, 2)),
         lambda reduction: (lambda out, y: F.cross_entropy(out.transpose(1, 2), y,
                                                           reduction=reduction))),
]

# More layer families, one file each (they import the helpers above).
from cases_layers import LAYER_CASES  # noqa: E402
from cases_ops import OP_CASES, OP_VJP_CASES  # noqa: E402
from cases_recurrent import RECURRENT_CASES  # noqa: E402

CASES += LAYER_CASES + RECURRENT_CASES + OP_CASES + OP_VJP_CASES
CASE_IDS = [c["id"] for c in CASES]
EDGE_CASE_IDS = [c["id"] for c in EDGE_CASES]
BY_ID = {c["id"]: c for c in CASES + EDGE_CASES}
assert len(BY_ID) == len(CASES) + len(EDGE_CASES), "case ids must be unique"


class _Gate(torch.autograd.Function):
    """``x * w`` as an old-style autograd.Function: torch.func refuses it (no setup_context)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum_to_size(w.shape)


class OpaqueGate(nn.Module):
    """A parameter used through a custom autograd.Function: no rule, and neither torch.func
    (the per-module fallback) nor the op's per-sample VJP can differentiate it per sample."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return _Gate.apply(x, self.weight)


def as_tuple(inputs: Any) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def build(c: dict[str, Any], n: int = N) -> tuple[nn.Module, Any, Any]:
    """``(model, inputs, targets)`` of case ``c`` with ``n`` samples, all in float64."""
    torch.manual_seed(c["seed"])
    model = c["module_fn"]().to(torch.float64)
    inputs = c["input_fn"](n)
    targets = None
    if c["target_fn"] is not None:
        with torch.no_grad():
            targets = c["target_fn"](model(*as_tuple(inputs)))
    return model, inputs, targets


@functools.cache
def jacobian_cases() -> list[dict[str, Any]]:
    """The cases of :data:`CASES` and :data:`EDGE_CASES` whose model returns one tensor
    with the batch in dim 0: those ``param_jacobian`` takes."""

    def single_tensor_output(c: dict[str, Any]) -> bool:
        model, inputs, _ = build(c, 2)
        with torch.no_grad():
            out = model(*as_tuple(inputs))
        return isinstance(out, Tensor) and out.dim() >= 1 and out.shape[0] == 2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # at collection: tiny models, and a busy machine (conftest.py)
    try:
        return [c for c in CASES + EDGE_CASES if single_tensor_output(c)]
    finally:
        torch.set_num_threads(threads)


# The comparisons and the DP step by hand live in battery.py; kept importable from here.
from battery import assert_exact as assert_exact  # noqa: E402
from battery import assert_grads_equal as assert_grads_equal  # noqa: E402
from battery import clipped_mean as clipped_mean  # noqa: E402
from battery import dp_grads as dp_grads  # noqa: E402
