"""The convolution rule's two methods (patches, grouped backward) agree with autograd
on every configuration, and the cost model picks the one measured cheaper."""

import pytest
import torch
import torch.nn.functional as F

from persample.rules.conv import choose, conv_weight_per_sample

# (spatial dims, c, o, kernel, stride, padding, dilation, size, images per sample)
CONFIGS = [
    (2, 3, 4, 3, 1, 0, 1, 6, 1),
    (2, 3, 4, 3, 2, 1, 1, 7, 1),
    (2, 2, 4, 3, 1, "same", 2, 6, 1),
    (2, 4, 4, 1, 2, 0, 1, 6, 1),  # 1x1, strided: the input itself
    (2, 4, 4, 1, 1, 1, 1, 4, 1),  # 1x1 with padding: through unfold
    (2, 4, 4, (1, 3), (2, 1), (0, 1), 1, 5, 1),
    (2, 4, 4, 3, 1, 1, 1, 4, 4),  # 4 windows per sample, summed
    (1, 4, 4, 3, 2, 1, 2, 9, 1),
    (1, 4, 4, 1, 1, 0, 1, 4, 4),
]


def _autograd_per_sample(x, g, weight, stride, padding, dilation):
    """Sample by sample: d <g_i, conv(x_i, W)> / dW over its images."""
    conv = {1: F.conv1d, 2: F.conv2d}[weight.dim() - 2]
    rows = []
    for xi, gi in zip(x, g[:, 0]):
        w = weight.clone().requires_grad_()
        out = conv(xi, w, None, stride, padding, dilation)
        rows.append(torch.autograd.grad(out, w, gi)[0])
    return torch.stack(rows).unsqueeze(1)


@pytest.mark.parametrize("method", ["patches", "grouped"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_both_methods_match_autograd(method, config):
    d, c, o, k, stride, padding, dilation, size, a = config
    n = 4
    k = (k,) * d if isinstance(k, int) else k
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, a, c, *(size,) * d, generator=gen)
    weight = torch.randn(o, c, *k, generator=gen)
    conv = {1: F.conv1d, 2: F.conv2d}[d]
    out = conv(x.flatten(0, 1), weight, None, stride, padding, dilation)
    g = torch.randn(n, 1, a, *out.shape[1:], generator=gen)
    dst = torch.full((n, 1, *weight.shape), float("nan"))
    conv_weight_per_sample(x, g, weight.shape, stride, padding, dilation, 1, dst, method)
    want = _autograd_per_sample(x, g, weight, stride, padding, dilation)
    torch.testing.assert_close(dst, want, rtol=1e-10, atol=1e-12)


def test_patches_write_into_a_column_slice_of_a_flat_result():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(4, 1, 3, 5, 5, generator=gen), torch.randn(4, 3, 3, 3)
    g = torch.randn(4, 1, 1, 4, 3, 3, generator=gen)
    flat = torch.zeros(4, 7 + weight.numel() + 5)
    dst = flat[:, 7 : 7 + weight.numel()].view(4, 1, *weight.shape)
    conv_weight_per_sample(x, g, weight.shape, 1, 0, 1, 1, dst, "patches")
    torch.testing.assert_close(dst, _autograd_per_sample(x, g, weight, 1, 0, 1),
                               rtol=1e-10, atol=1e-12)
    assert flat[:, :7].abs().sum() == 0 and flat[:, -5:].abs().sum() == 0


@pytest.mark.parametrize(("layer", "want"), [
    ((64, 1, 32, 3, 26), "patches"),   # the tutorial's SimpleCNN conv1: a patch of 9 numbers
    ((64, 32, 64, 3, 24), "grouped"),  # the tutorial's SimpleCNN conv2: patches 9x the result
    ((32, 64, 64, 3, 8), "grouped"),   # resnet18 layer1 at 32x32
    ((32, 128, 128, 3, 4), "patches"),  # resnet18 layer2
    ((32, 512, 512, 3, 1), "patches"),  # resnet18 layer4: grouped takes 27x the write
    ((32, 256, 512, 1, 1), "patches"),  # 1x1 downsample
])
def test_cost_model_choice(layer, want):
    n, c, o, k, s = layer
    g = torch.empty(n, 1, 1, o, s, s)
    assert choose(g, torch.Size([o, c, k, k]), 1) == want
    if c == o:  # depthwise: grouped
        assert choose(g, torch.Size([o, 1, k, k]), c) == "grouped"
