"""ConvTranspose rule against the loop over drawn configurations (with hypothesis).

Dims 1 to 3, batch 0 to 3, groups 1 to 3 with channels multiples of them,
kernel, stride, padding, output_padding (smaller than stride or dilation, as
torch requires), dilation, bias, and sometimes ``output_size=`` at the call
instead of ``output_padding`` (then smaller than the stride). Float64, tight
tolerances; the per-sample gradients and the parameter Jacobian.
"""

from __future__ import annotations

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from persample import (
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grads,
    supported,
)

CONVS = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


class WithOutputSize(nn.Module):
    """Calls its transposed convolution with ``output_size=`` (its own output_padding is 0)."""

    def __init__(self, conv: nn.modules.conv._ConvTransposeNd, output_size: tuple[int, ...]):
        super().__init__()
        self.conv = conv
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x, output_size=self.output_size)


@st.composite
def conv_transpose_configs(draw):
    d = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(d))
    as_size = draw(st.booleans())  # pass output_padding as output_size= instead
    # torch: output_padding < max(stride, dilation); output_size= allows only < stride.
    output_padding = tuple(draw(st.integers(0, (s if as_size else max(s, dl)) - 1))
                           for s, dl in zip(stride, dilation))
    # The output size must be positive: (s_in - 1) * stride - 2 * padding + dl * (k - 1) + 1 > 0.
    size = tuple(
        max(1, -(-(2 * p - dl * (k - 1)) // s) + 1) + draw(st.integers(0, 2 if d < 3 else 1))
        for k, s, p, dl in zip(kernel, stride, padding, dilation)
    )
    return {
        "d": d,
        "batch": draw(st.integers(0, 3)),
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 2)),
        "groups": groups,
        "kernel_size": kernel,
        "stride": stride,
        "padding": padding,
        "output_padding": output_padding,
        "dilation": dilation,
        "bias": draw(st.booleans()),
        "output_size": as_size,
        "size": size,
        "reduction": draw(st.sampled_from(["mean", "sum"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(cfg):
    torch.manual_seed(cfg["seed"])
    as_size = cfg["output_size"]
    conv = CONVS[cfg["d"]](
        cfg["in_channels"], cfg["out_channels"], cfg["kernel_size"], stride=cfg["stride"],
        padding=cfg["padding"], output_padding=0 if as_size else cfg["output_padding"],
        dilation=cfg["dilation"], groups=cfg["groups"], bias=cfg["bias"], dtype=torch.float64,
    )
    model = conv
    if as_size:
        out_size = tuple(
            (i - 1) * s - 2 * p + dl * (k - 1) + op + 1
            for i, s, p, dl, k, op in zip(cfg["size"], cfg["stride"], cfg["padding"],
                                          cfg["dilation"], cfg["kernel_size"],
                                          cfg["output_padding"])
        )
        model = WithOutputSize(conv, out_size)
    x = torch.randn(cfg["batch"], cfg["in_channels"], *cfg["size"], dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, conv, x, y


@settings(max_examples=40, deadline=None)
@given(cfg=conv_transpose_configs())
def test_conv_transpose_rule_matches_loop(cfg):
    model, conv, x, y = build(cfg)
    if cfg["batch"] > 1:  # (a batch of one is the plain gradient)
        assert {r.path for r in supported(model, x)} == {"rule"}
    loss_fn = nn.MSELoss(reduction=cfg["reduction"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no vmap "performance drop"
        warnings.filterwarnings("ignore", "per_sample_grads got an empty batch")  # (batch 0)
        got = per_sample_grads(model, x, y, loss_fn, method="rules")
    want = loop_per_sample_grads(model, x, y, loss_fn)
    assert list(got) == list(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(cfg=conv_transpose_configs())
def test_conv_transpose_rule_flat_and_chunked(cfg):
    """The rule writing into non-contiguous views of a flat buffer, chunk by chunk."""
    model, _, x, y = build(cfg)
    loss_fn = nn.MSELoss(reduction="sum")
    want = loop_per_sample_grads(model, x, y, loss_fn)
    want = torch.cat([g.flatten(1) for g in want.values()], dim=1)
    got = per_sample_grads(model, x, y, loss_fn, method="rules",
                           flat=True, chunk_size=2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(cfg=conv_transpose_configs().filter(lambda c: c["batch"] > 0))
def test_conv_transpose_rule_param_jacobian(cfg):
    """Several cotangents per sample (``v > 1``) go through the same folded backward."""
    model, _, x, _ = build(cfg)
    got = param_jacobian(model, x, method="rules")
    want = loop_param_jacobian(model, x)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)
