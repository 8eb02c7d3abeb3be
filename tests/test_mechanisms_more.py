"""Mechanisms of architectures the other tests do not build, each on the rules and
exact against the loop (float64, ``B`` equal to other dims so that no size tells where
the batch is): ``einsum`` with parameters of any rank, a shared tensor filled with
per-sample data (``h.new_zeros(...)``), FFT token mixing (FNet) and complex filters
(GFNet), ``cdist`` to a codebook (VQ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from battery import METHODS, check

B = 4


class Einsum(nn.Module):
    def __init__(self, eq: str, shape: tuple[int, ...], first: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape))
        self.eq, self.first = eq, first
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.einsum(self.eq, self.w, x) if self.first else torch.einsum(self.eq, x, self.w)
        return self.head(h.reshape(x.shape[0], -1, 4).mean(1))


class RelativeShift(nn.Module):
    """Transformer-XL's relative scores: ``einsum`` with a position table, then the shift
    by padding and views."""

    def __init__(self):
        super().__init__()
        self.q, self.r, self.head = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 4)), \
            nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q(x)  # (B, T, 4)
        bd = torch.einsum("bid,jd->bij", q, self.r)  # (B, T, T)
        n, t, _ = bd.shape
        bd = F.pad(bd, (1, 0)).view(n, t + 1, t)[:, 1:].view(n, t, t)
        return self.head((bd.softmax(-1) @ q).mean(1))


class Filled(nn.Module):
    """A shared tensor of zeros taking per-sample data where it covers the batch whole."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)  # (B, T, 4)
        z = h.new_zeros(h.shape)
        z[:, :, :2] = h[:, :, :2].tanh()
        return self.head(z.mean(1))


class FNet(nn.Module):
    """FNet's token mixing: the real part of a 2-d FFT over the sequence and features."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.fft.fft2(self.a(x)).real.mean(1))


class GlobalFilter(nn.Module):
    """GFNet: a learned complex filter (``view_as_complex`` of a parameter) on the FFT of
    the sequence, and back."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.filter = nn.Parameter(0.5 * torch.randn(3, 4, 2))  # (T // 2 + 1, 4, re/im)

    def forward(self, x: Tensor) -> Tensor:
        spectrum = torch.fft.rfft(self.a(x), dim=1)  # (B, 3, 4), complex
        spectrum = spectrum * torch.view_as_complex(self.filter)
        return self.head(torch.fft.irfft(spectrum, n=x.shape[1], dim=1).mean(1))


class Codebook(nn.Module):
    """A VQ-VAE codebook: distances by ``cdist``, the nearest code, straight-through."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.code = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        z = self.a(x)  # (B, T, 4)
        d = torch.cdist(z, self.code.expand(z.shape[0], -1, -1))  # (B, T, codes)
        q = self.code[d.argmin(-1)]
        zq = z + (q - z).detach()
        commitment = ((q - z.detach()) ** 2).mean((1, 2))[:, None]
        return self.head(zq.mean(1)) + commitment


class ShiftedWindows(nn.Module):
    """Swin's shifted-window attention: the batch merged with the windows, a learned
    relative bias plus a shift mask repeated for every sample's windows (a shared tensor
    as long as the merged batch, paired with the samples' windows row by row), given to
    SDPA as one mask: the op's own backward gives each sample's rows of the mask."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(4, 12), nn.Linear(4, 4), nn.Linear(4, 3)
        self.bias = nn.Parameter(0.5 * torch.randn(2, 4, 4))  # (heads, N, N)
        shift = torch.zeros(4, 4, 4)  # (windows, N, N)
        shift[1:, :2, 2:] = shift[1:, 2:, :2] = -100.0
        self.register_buffer("shift", shift)

    def forward(self, x: Tensor) -> Tensor:  # x (B, 4 windows, N = 4, 4)
        n = x.shape[0]
        h = x.reshape(n * 4, 4, 4)  # (B * windows, N, C)
        q, k, v = self.qkv(h).view(n * 4, 4, 3, 2, 2).permute(2, 0, 3, 1, 4)
        mask = self.shift.unsqueeze(1).unsqueeze(0).expand(n, -1, -1, -1, -1).reshape(-1, 1, 4, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + mask)
        o = self.out(o.transpose(1, 2).reshape(n * 4, 4, 4))
        return self.head(o.view(n, 16, 4).mean(1))


class SegmentScores(nn.Module):
    """XLNet's segment term: a shared matrix as long as the batch (made from its size)
    read with the samples' letter by ``einsum``, beside a learned segment embedding."""

    def __init__(self):
        super().__init__()
        self.q, self.seg, self.head = nn.Linear(4, 4), nn.Parameter(torch.randn(2, 4)), \
            nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x (B, T, 4)
        n, t, _ = x.shape
        q = self.q(x).transpose(0, 1)  # (T, B, 4)
        same = torch.eye(t).unsqueeze(-1).expand(t, t, n)  # (T, T, B): shared
        seg = torch.stack([same, 1 - same], -1)  # (T, T, B, 2)
        ef = torch.einsum("ibd,sd->ibs", q, self.seg)
        scores = torch.einsum("ijbs,ibs->bij", seg, ef)  # (B, T, T)
        return self.head((scores.softmax(-1) @ x).mean(1))


class SlidingChunks(nn.Module):
    """Longformer's overlapping chunks: the batch merged with the heads, the sequence
    viewed as chunks of ``2w`` and made to overlap by ``as_strided``, then chunk-wise
    scores with ``einsum``."""

    def __init__(self):
        super().__init__()
        self.q, self.head = nn.Linear(4, 8), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x (B, T = 8, 4)
        n, t, _ = x.shape
        q = self.q(x).view(n, t, 2, 4).transpose(1, 2).reshape(n * 2, t, 4)  # (B*heads, T, d)
        chunks = q.view(n * 2, t // 4, 4, 4)  # chunks of 2w = 4
        size, stride = list(chunks.shape), list(chunks.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        windows = chunks.as_strided(size=size, stride=stride)  # (B*heads, 3, 4, d)
        scores = torch.einsum("bcxd,bcyd->bcxy", windows, windows)
        return self.head(scores.softmax(-1).reshape(n, -1, 4).mean(1))


class RelativeKeys(nn.Module):
    """XLNet's position keys: a shared sinusoid table widened to the batch, projected by
    a parameter with ``einsum`` (a derived tensor as long as the batch), then read per
    sample against the queries."""

    def __init__(self):
        super().__init__()
        self.q, self.r, self.head = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 4)), \
            nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x (B, T, 4)
        n, t, _ = x.shape
        q = self.q(x).transpose(0, 1)  # (T, B, 4)
        angles = torch.arange(t, dtype=x.dtype)[:, None] * torch.arange(1, 5, dtype=x.dtype)
        table = angles.sin()[:, None, :].expand(t, n, 4)  # (T, B, 4): shared
        keys = torch.einsum("ibh,hd->ibd", table, self.r)  # derived, as long as the batch
        scores = torch.einsum("ibd,jbd->bij", q, keys)  # (B, T, T)
        return self.head((scores.softmax(-1) @ x).mean(1))


EINSUMS = {
    "3d-table": lambda: Einsum("bti,hio->btho", (4, 4, 4)),
    "param-first": lambda: Einsum("io,bti->bto", (4, 4), first=True),
    "ellipsis": lambda: Einsum("...i,io->...o", (4, 4)),
    "implicit-output": lambda: Einsum("bti,io", (4, 4)),
    "batch-in-dim-1": lambda: Einsum("tbi,io->bto", (4, 4)),
    "relative-shift": RelativeShift,
    "new-zeros-filled": Filled,
    "fnet": FNet,
    "gfnet": GlobalFilter,
    "vq-codebook": Codebook,
    "shifted-windows": ShiftedWindows,
    "segment-scores": SegmentScores,
    "relative-keys": RelativeKeys,
    "sliding-chunks": SlidingChunks,
}


@pytest.mark.parametrize("name", EINSUMS)
def test_on_the_rules_and_exact(name):
    torch.manual_seed(0)
    model = EINSUMS[name]().double()
    x = torch.randn(B, 4, 4).double()  # (B, T = B, 4)
    if name == "sliding-chunks":
        x = torch.randn(B, 8, 4).double()
    if name == "shifted-windows":
        x = torch.randn(B, 4, 4, 4).double()  # (B, windows = B, N = B, 4)
    if name == "batch-in-dim-1":
        x = torch.randn(4, B, 4).double()
        model = _BatchSecond(model)
    check(model, x, torch.randint(0, 3, (B,)), nn.CrossEntropyLoss(), methods=METHODS)


class _BatchSecond(nn.Module):
    """Takes ``(B, T, 4)`` and hands the einsum ``(T, B, 4)``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner.head(torch.einsum(self.inner.eq, x.transpose(0, 1), self.inner.w)
                               .mean(1))
