"""Cases (see ``cases.py``) for more stock layers.

ConvTranspose, InstanceNorm, RMSNorm, BatchNorm (eval), EmbeddingBag, PReLU and
Bilinear, alone and in small models.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from cases import case, classes, cross_entropy, randn


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
]
