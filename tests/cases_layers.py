"""Cases (see ``cases.py``) for more stock layers.

ConvTranspose, InstanceNorm, RMSNorm, BatchNorm (eval), EmbeddingBag, PReLU and
Bilinear, alone and in small models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from cases import case, classes, cross_entropy, ids, per_sample_squares, randn, regression


class ConvTransposeOutputSize(nn.Module):
    """``ConvTranspose2d`` called with ``output_size=``: the largest size, not output_padding."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(x, output_size=(2 * x.shape[2], 2 * x.shape[3]))


class ConvUpDown(nn.Module):
    """A tiny encoder-decoder: Conv2d down, ConvTranspose2d back up, then a head."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Conv2d(2, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.up(self.down(x).tanh()).tanh())  # (B, 3, H, W)


def with_running_stats(norm: nn.Module) -> nn.Module:
    """``norm`` in eval mode with drawn running statistics (and affine parameters)."""
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        if norm.affine:
            norm.weight.normal_()
            norm.bias.normal_()
    return norm.eval()


def conv_instancenorm_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.ReLU(),
                         nn.Conv2d(4, 3, 2, stride=2), nn.Flatten(), nn.Linear(3 * 2 * 2, 4))


def mlp_batchnorm1d_eval() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))
    with_running_stats(net[1])
    return net.eval()


def conv3d_batchnorm_eval() -> nn.Module:
    net = nn.Sequential(nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2), nn.Tanh(), nn.Flatten(),
                        nn.Linear(2 * 2 * 2 * 2, 3))
    with_running_stats(net[1])
    return net.eval()


class BilinearPair(nn.Module):
    """Two inputs ``model(a, b)`` through their own Linear layers into one Bilinear."""

    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(4, 3)
        self.fb = nn.Linear(2, 2)
        self.mix = nn.Bilinear(3, 2, 4)
        self.act = nn.PReLU(4)
        self.head = nn.Linear(4, 3)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.head(self.act(self.mix(torch.tanh(self.fa(a)), torch.tanh(self.fb(b)))))


class BilinearSelf(nn.Module):
    """Bilinear over extra dims, both inputs from one tensor: ``x[..., :3]``, ``x[..., 3:]``."""

    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(3, 2, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.bil(x[..., :3], x[..., 3:])  # (B, T, 3)


class BilinearKeywords(nn.Module):
    """Bilinear called with keyword inputs: ``bil(input1=a, input2=b)``."""

    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(2, 3, 2)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.bil(input1=a, input2=b)


class BagWeights(nn.Module):
    """EmbeddingBag (sum) with per-sample weights, passed positionally or by keyword."""

    def __init__(self, keyword: bool = False, padding_idx: int | None = None):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode="sum", padding_idx=padding_idx)
        self.keyword = keyword

    def forward(self, ids: Tensor, weights: Tensor) -> Tensor:
        if self.keyword:
            return self.bag(ids, per_sample_weights=weights)
        return self.bag(ids, None, weights)


class BagOffsets(nn.Module):
    """EmbeddingBag on the 1-d form: ``(B, L)`` ids -> flat ids ``(B*L,)`` and offsets.

    ``lengths (B,)`` (optional) cut each bag short by filling its tail with
    ``padding_idx``, so bags differ in length while the shapes stay fixed (as
    ``method="vmap"`` needs). ``include_last_offset`` adds the end offset.
    """

    def __init__(self, mode: str, include_last_offset: bool = False,
                 padding_idx: int | None = None):
        super().__init__()
        self.bag = nn.EmbeddingBag(8, 3, mode=mode, include_last_offset=include_last_offset,
                                   padding_idx=padding_idx)
        self.head = nn.Linear(3, 3)

    def forward(self, ids: Tensor, lengths: Tensor | None = None) -> Tensor:
        n, length = ids.shape
        if lengths is not None:
            tail = torch.arange(length, device=ids.device) >= lengths.unsqueeze(1)  # (B, L)
            ids = ids.masked_fill(tail, self.bag.padding_idx)
        end = n * length + (length if self.bag.include_last_offset else 0)
        offsets = torch.arange(0, end, length, device=ids.device)
        return self.head(torch.tanh(self.bag(ids.reshape(-1), offsets=offsets)))


def ids_and_lengths(vocab: int, length: int) -> Any:
    """``n -> (ids (n, length), lengths (n,))`` with lengths from 0 to ``length``."""
    return lambda n: (ids(vocab, n, length), torch.randint(0, length + 1, (n,)))


def no_vmap_jacobian(c: dict[str, Any]) -> dict[str, Any]:
    """Mark a case whose model torch.func cannot ``vmap(jacrev(...))`` (``F.prelu``):
    ``param_jacobian(method="vmap")`` is then expected to fail (test_battery.py)."""
    return {**c, "vmap_jacobian": False}


def prelu_case(*args: Any) -> dict[str, Any]:
    """A :func:`case` whose model has a PReLU."""
    return no_vmap_jacobian(case(*args))


LAYER_CASES: list[dict[str, Any]] = [
    # nn.ConvTranspose1d / 2d / 3d
    case("convT1d", lambda: nn.ConvTranspose1d(2, 3, 3), lambda n: randn(n, 2, 4)),
    case("convT1d-stride2-pad1-outpad1-groups2",
         lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
         lambda n: randn(n, 4, 5)),
    case("convT1d-dilation2-outpad1-nobias",
         lambda: nn.ConvTranspose1d(2, 3, 3, dilation=2, output_padding=1, bias=False),
         lambda n: randn(n, 2, 4)),
    case("convT2d-tuple-config",
         lambda: nn.ConvTranspose2d(2, 3, (3, 2), stride=(2, 3), padding=(1, 0),
                                    output_padding=(1, 2), dilation=(1, 2)),
         lambda n: randn(n, 2, 3, 3)),
    case("convT2d-depthwise-nobias",
         lambda: nn.ConvTranspose2d(3, 3, 2, stride=2, groups=3, bias=False),
         lambda n: randn(n, 3, 2, 3)),
    case("convT2d-output-size", ConvTransposeOutputSize, lambda n: randn(n, 2, 3, 2)),
    case("convT3d", lambda: nn.ConvTranspose3d(2, 2, 2), lambda n: randn(n, 2, 2, 3, 2)),
    case("convT3d-stride-pad-dilation-groups2",
         lambda: nn.ConvTranspose3d(2, 4, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1),
                                    output_padding=(1, 0, 1), dilation=(1, 2, 1), groups=2),
         lambda n: randn(n, 2, 2, 2, 3)),
    case("conv-convT-encoder-decoder", ConvUpDown, lambda n: randn(n, 2, 4, 6),
         classes, cross_entropy),
    # nn.InstanceNorm1d / 2d / 3d (affine; with running statistics only in eval mode,
    # training mode with them is in test_layer_rules.py: the forward updates them)
    case("instancenorm1d-affine", lambda: nn.InstanceNorm1d(3, affine=True),
         lambda n: randn(n, 3, 5)),
    case("instancenorm2d-affine", lambda: nn.InstanceNorm2d(2, affine=True),
         lambda n: randn(n, 2, 3, 4), regression, per_sample_squares),
    case("instancenorm3d-affine-eps", lambda: nn.InstanceNorm3d(2, eps=0.1, affine=True),
         lambda n: randn(n, 2, 2, 3, 2)),
    case("instancenorm1d-affine-running-stats-eval",
         lambda: with_running_stats(nn.InstanceNorm1d(3, affine=True, track_running_stats=True)),
         lambda n: randn(n, 3, 4)),
    case("instancenorm2d-affine-running-stats-eval",
         lambda: with_running_stats(nn.InstanceNorm2d(2, affine=True, track_running_stats=True)),
         lambda n: randn(n, 2, 3, 3)),
    case("conv-instancenorm-net", conv_instancenorm_net, lambda n: randn(n, 2, 6, 6),
         classes, cross_entropy),
    # nn.RMSNorm
    case("rmsnorm-last-dim", lambda: nn.RMSNorm(4), lambda n: randn(n, 5, 4)),
    case("rmsnorm-2d-input-eps", lambda: nn.RMSNorm(4, eps=1e-2), lambda n: randn(n, 4)),
    case("rmsnorm-last-2-dims", lambda: nn.RMSNorm((3, 4), eps=1e-5),
         lambda n: randn(n, 2, 3, 4)),
    case("rmsnorm-no-affine-mlp",
         lambda: nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5, elementwise_affine=False),
                               nn.Linear(5, 3)),
         lambda n: randn(n, 4), classes, cross_entropy),
    # nn.BatchNorm1d / 2d / 3d in eval mode (running statistics)
    case("batchnorm1d-eval-2d-input", lambda: with_running_stats(nn.BatchNorm1d(4)),
         lambda n: randn(n, 4)),
    case("batchnorm1d-eval-3d-input", lambda: with_running_stats(nn.BatchNorm1d(3, eps=0.1)),
         lambda n: randn(n, 3, 5)),
    case("batchnorm2d-eval", lambda: with_running_stats(nn.BatchNorm2d(2)),
         lambda n: randn(n, 2, 3, 3), regression, per_sample_squares),
    case("batchnorm3d-eval", lambda: with_running_stats(nn.BatchNorm3d(2)),
         lambda n: randn(n, 2, 2, 2, 3)),
    case("mlp-batchnorm1d-eval", mlp_batchnorm1d_eval, lambda n: randn(n, 4),
         classes, cross_entropy),
    case("conv3d-batchnorm3d-eval", conv3d_batchnorm_eval, lambda n: randn(n, 1, 3, 3, 3),
         classes, cross_entropy),
    # nn.PReLU (torch.func cannot vmap(jacrev(...)) it: no_vmap_jacobian)
    prelu_case("prelu-shared-slope", lambda: nn.PReLU(), lambda n: randn(n, 3, 4)),
    prelu_case("prelu-per-channel-2d-input", lambda: nn.PReLU(4, init=0.1),
               lambda n: randn(n, 4)),
    prelu_case("prelu-per-channel-3d-input", lambda: nn.PReLU(3), lambda n: randn(n, 3, 5),
               regression, per_sample_squares),
    prelu_case("prelu-per-channel-conv2d",
               lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.PReLU(3), nn.Conv2d(3, 2, 2)),
               lambda n: randn(n, 2, 4, 4)),
    prelu_case("prelu-shared-slope-1d-input",
               lambda: nn.Sequential(nn.Linear(4, 1), nn.Flatten(0), nn.PReLU()),  # on (B,)
               lambda n: randn(n, 4)),
    # nn.Bilinear
    case("bilinear-2d", lambda: nn.Bilinear(3, 2, 4), lambda n: (randn(n, 3), randn(n, 2)),
         classes, cross_entropy),
    case("bilinear-nobias-2d", lambda: nn.Bilinear(2, 3, 2, bias=False),
         lambda n: (randn(n, 2), randn(n, 3))),
    case("bilinear-extra-dims", lambda: nn.Bilinear(2, 3, 2),
         lambda n: (randn(n, 4, 2), randn(n, 4, 3))),
    case("bilinear-extra-dims-nobias", BilinearSelf, lambda n: randn(n, 2, 3, 5),
         regression, per_sample_squares),
    case("bilinear-keyword-inputs", BilinearKeywords, lambda n: (randn(n, 2), randn(n, 3))),
    prelu_case("bilinear-prelu-tuple-inputs", BilinearPair,
               lambda n: (randn(n, 4), randn(n, 2)), classes, cross_entropy),
    # nn.EmbeddingBag: 2-d input (each row a bag), or 1-d input with offsets
    case("embeddingbag-sum-2d", lambda: nn.EmbeddingBag(7, 3, mode="sum"),
         lambda n: ids(7, n, 4)),
    case("embeddingbag-mean-2d-padding-idx", lambda: nn.EmbeddingBag(5, 3, padding_idx=0),
         lambda n: ids(3, n, 3)),  # repeats, padding, sometimes a bag of padding only
    case("embeddingbag-max-2d", lambda: nn.EmbeddingBag(7, 3, mode="max"),
         lambda n: ids(7, n, 4), regression, per_sample_squares),
    case("embeddingbag-max-2d-padding-idx", lambda: nn.EmbeddingBag(5, 2, mode="max",
                                                                   padding_idx=1),
         lambda n: ids(3, n, 3)),
    case("embeddingbag-per-sample-weights", lambda: BagWeights(padding_idx=2),
         lambda n: (ids(6, n, 5), randn(n, 5))),
    case("embeddingbag-per-sample-weights-keyword", lambda: BagWeights(keyword=True),
         lambda n: (ids(6, n, 5), randn(n, 5))),
    case("embeddingbag-offsets-sum", lambda: BagOffsets("sum"), lambda n: ids(8, n, 3),
         classes, cross_entropy),
    case("embeddingbag-offsets-mean-lengths", lambda: BagOffsets("mean", padding_idx=0),
         ids_and_lengths(8, 4)),
    case("embeddingbag-offsets-max-last-offset-lengths",
         lambda: BagOffsets("max", include_last_offset=True, padding_idx=7),
         ids_and_lengths(8, 4)),
    case("embeddingbag-offsets-sum-last-offset", lambda: BagOffsets("sum", True),
         lambda n: ids(8, n, 2)),
    case("embeddingbag-scale-grad-by-freq",
         lambda: nn.EmbeddingBag(5, 3, mode="mean", scale_grad_by_freq=True),
         lambda n: ids(3, n, 4)),  # the torch.func fallback
]
