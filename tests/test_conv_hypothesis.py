"""Conv rule against the loop over drawn configurations (Opacus style, with hypothesis).

Dims 1 to 3, batch 0 to 3, groups 1 to 3 with channels multiples of them,
kernel, stride, padding (int, tuple, "same" at stride 1, "valid"), dilation,
bias and padding_mode; inputs just large enough to be valid. Float64, tight
tolerances.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from persample import loop_per_sample_grads, per_sample_grads

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
PADDING_MODES = ["zeros", "reflect", "circular", "replicate"]


@st.composite
def conv_configs(draw):
    d = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    kinds = ["int", "tuple", "valid"] + (["same"] if all(s == 1 for s in stride) else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "int":
        padding = draw(st.integers(0, 2))
        pads = (padding,) * d
    elif kind == "tuple":
        pads = tuple(draw(st.integers(0, 2)) for _ in range(d))
        padding = pads
    elif kind == "same":
        padding = "same"
        pads = tuple(dl * (k - 1) - dl * (k - 1) // 2 for k, dl in zip(kernel, dilation))
    else:
        padding, pads = "valid", (0,) * d
    # Big enough for the kernel without padding, and for reflect (pad < size).
    size = tuple(
        max(dl * (k - 1) + 1, p + 1) + draw(st.integers(0, 2 if d < 3 else 1))
        for k, dl, p in zip(kernel, dilation, pads)
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
        "dilation": dilation,
        "bias": draw(st.booleans()),
        "padding_mode": draw(st.sampled_from(PADDING_MODES)),
        "size": size,
        "reduction": draw(st.sampled_from(["mean", "sum"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(cfg):
    torch.manual_seed(cfg["seed"])
    conv = CONVS[cfg["d"]](
        cfg["in_channels"], cfg["out_channels"], cfg["kernel_size"], stride=cfg["stride"],
        padding=cfg["padding"], dilation=cfg["dilation"], groups=cfg["groups"],
        bias=cfg["bias"], padding_mode=cfg["padding_mode"], dtype=torch.float64,
    )
    x = torch.randn(cfg["batch"], cfg["in_channels"], *cfg["size"], dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(conv(x))
    return conv, x, y


@settings(max_examples=40, deadline=None)
@given(cfg=conv_configs())
def test_conv_rule_matches_loop(cfg):
    conv, x, y = build(cfg)
    loss_fn = nn.MSELoss(reduction=cfg["reduction"])
    got = per_sample_grads(conv, x, y, loss_fn, method="rules")
    want = loop_per_sample_grads(conv, x, y, loss_fn)
    assert list(got) == (["weight", "bias"] if cfg["bias"] else ["weight"])
    for name, g in want.items():
        assert got[name].shape == (cfg["batch"], *conv.get_parameter(name).shape)
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(cfg=conv_configs())
def test_conv_rule_flat_and_chunked(cfg):
    """The rule writing into non-contiguous views of a flat buffer, chunk by chunk."""
    conv, x, y = build(cfg)
    loss_fn = nn.MSELoss(reduction="sum")
    want = loop_per_sample_grads(conv, x, y, loss_fn)
    want = torch.cat([g.flatten(1) for g in want.values()], dim=1)
    got = per_sample_grads(conv, x, y, loss_fn, method="rules",
                           flat=True, chunk_size=2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_conv_rule_batch_dependent_rows(d):
    """A fixed non-trivial config per dim: rows differ, so a broadcast bug would show."""
    cfg = {"d": d, "batch": 3, "in_channels": 4, "out_channels": 2, "groups": 2,
           "kernel_size": (2,) * d, "stride": (1,) * d, "padding": "same",
           "dilation": (1,) * d, "bias": True, "padding_mode": "reflect",
           "size": (4,) * d, "reduction": "mean", "seed": 1}
    conv, x, y = build(cfg)
    got = per_sample_grads(conv, x, y, nn.MSELoss(), method="rules")
    want = loop_per_sample_grads(conv, x, y, nn.MSELoss())
    for name, g in want.items():
        assert not torch.allclose(g[0], g[1])
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)
