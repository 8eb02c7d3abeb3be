"""Cases (see ``cases.py``) for op rules written one op per file in ``persample/rules/``.

A new op rule adds one case here: a small model whose parameters enter that op. Every
case runs through the whole battery of ``test_battery.py`` (per-sample gradients,
parameter Jacobians, norms and the DP step against the loop over samples, in float64), and
``test_op_rules.py`` checks that each parameter of it really takes the rule.
Sizes coincide on purpose (the batch size ``N = 3`` is also a feature size), so a
rule that found the batch by a size would be caught.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cases import N, case, per_sample_squares, randn


class ScaleShift(nn.Module):
    """``torch.addcmul(shift, x, scale)``: a shift per position and a scale per feature,
    both broadcast over the samples."""

    def __init__(self, positions: int = N, features: int = 4, value: float = 0.5):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(positions, features))
        self.scale = nn.Parameter(torch.randn(features))
        self.value = value

    def forward(self, x: Tensor) -> Tensor:  # (B, positions, features)
        return torch.addcmul(self.shift, x, self.scale, value=self.value)


class ScaleOfInput(nn.Module):
    """``x.addcmul(w, h)``: the parameter is the first factor, ``h`` carries the samples
    and the op's own input is computed from them (the method form)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, N))
        self.lin = nn.Linear(N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N)
        h = self.lin(x).tanh()
        return h.addcmul(self.w, h)


class Chosen(nn.Module):
    """``where`` of a mask made from the samples and a parameter: as the input (T5's
    position bias, ``where(mask, bias, min)``), in the method form
    (``bias.where(mask, x)``), or as the other tensor (``where(mask, x, fill)``)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(N, N))
        self.lin = nn.Linear(N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N)
        h = self.lin(x)  # (B, N)
        mask = (x[:, :, None] * x[:, None, :]) > 0  # (B, N, N)
        if self.form == "function":
            y = torch.where(mask, self.w, -3.0)
        elif self.form == "method":
            y = self.w.where(mask, h[:, None, :])
        else:
            y = torch.where(mask, h[:, :, None], self.w)
        return (y * h[:, None, :]).sum(-1)  # (B, N)


class Sliced(nn.Module):
    """Views of a parameter by basic indexing (BEiT's ``table[:k]`` and ``table[k:]``),
    an integer, ``None`` and ``...`` among them, each added to the samples."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(N + 2, N))
        self.lin = nn.Linear(N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N)
        h = self.lin(x)  # (B, N)
        head, tail = self.table[:N], self.table[N:]  # (N, N), (2, N)
        return (h[:, None, :] * head).sum(-1) + tail[1] * h + self.table[None, 0, ...] * x


class Resized(nn.Module):
    """A parameter grid interpolated to the samples' size (a position table resized,
    BEiT's; ViT's position embeddings at another image size), in ``mode``."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.grid = nn.Parameter(torch.randn(1, 2, N, N + 1))
        self.lin = nn.Linear(N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N)
        size = (N, N) if self.mode == "same" else (N + 2, N - 1)
        mode = "bilinear" if self.mode == "same" else self.mode
        grid = F.interpolate(self.grid, size=size, mode=mode, **(
            {"align_corners": False} if mode in ("bilinear", "bicubic") else {}))
        h = self.lin(x)  # (B, N)
        return (grid.flatten(1, 2)[..., :N - 1] * h[:, None, :N - 1]).sum(-1)  # (B, 2 N
        # or 2 (N + 2))


class Solved(nn.Module):
    """``torch.linalg.solve`` with a learned matrix ``(N, N)`` (``N`` is the batch size):
    against each sample's columns (``"columns"``, the matrix dims of ``x.unsqueeze(-1)``),
    each sample's rows from the right (``"right"``, ``left=False``), or each sample's own
    matrix (a parameter plus its diagonal) against a learned vector repeated into the
    batch (``"vectors"``), or against itself (``"itself"``); the columns by
    ``linalg.solve_ex`` (``"ex"``), ``cholesky_solve`` with the matrix's lower triangle
    as the factor (``"cholesky"``), ``linalg.lu_solve`` of its LU factors
    (``"lu"``)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a = nn.Parameter(torch.randn(N, N) + 3 * torch.eye(N))
        self.b = nn.Parameter(torch.randn(N))
        self.lin = nn.Linear(N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N)
        h = self.lin(x)
        if self.form == "columns":
            return torch.linalg.solve(self.a, h.unsqueeze(-1)).squeeze(-1) + self.b
        if self.form == "right":
            return torch.linalg.solve(self.a, h.unsqueeze(1), left=False).squeeze(1) * self.b
        if self.form == "ex":
            return torch.linalg.solve_ex(self.a, h.unsqueeze(-1))[0].squeeze(-1) + self.b
        if self.form == "cholesky":
            factor = torch.tril(self.a)  # (a lower factor: its diagonal about 3)
            return torch.cholesky_solve(h.unsqueeze(-1), factor).squeeze(-1) + self.b
        if self.form == "lu":
            return torch.linalg.lu_solve(*torch.linalg.lu_factor(self.a),
                                         h.unsqueeze(-1)).squeeze(-1) + self.b
        if self.form == "itself":  # (the identity: no gradient reaches the matrix)
            return (torch.linalg.solve(self.a, self.a) @ h.unsqueeze(-1)).squeeze(-1) * self.b
        own = self.a + h.exp()[:, :, None] * torch.eye(N)  # (B, N, N)
        return torch.linalg.solve(own, self.b.expand(x.shape[0], N))  # (B, N)


OP_CASES: list[dict[str, Any]] = [
    case("getitem-basic", Sliced, lambda n: randn(n, N)),
    case("interpolate-same", lambda: Resized("same"), lambda n: randn(n, N)),
    case("interpolate-bilinear", lambda: Resized("bilinear"), lambda n: randn(n, N)),
    case("interpolate-bicubic", lambda: Resized("bicubic"), lambda n: randn(n, N)),
    case("interpolate-nearest", lambda: Resized("nearest"), lambda n: randn(n, N)),
    case("where-input", lambda: Chosen("function"), lambda n: randn(n, N)),
    case("where-method", lambda: Chosen("method"), lambda n: randn(n, N)),
    case("where-other", lambda: Chosen("other"), lambda n: randn(n, N)),
    case("addcmul-scale-shift", ScaleShift, lambda n: randn(n, N, 4)),
    case("addcmul-method-one-factor", ScaleOfInput, lambda n: randn(n, N),
         loss_fn=per_sample_squares),
    *[case(f"solve-{form}", lambda form=form: Solved(form), lambda n: randn(n, N))
      for form in ("columns", "right", "vectors", "itself", "ex", "cholesky")],
]
OP_VJP_CASES: list[dict[str, Any]] = [
    case("solve-lu", lambda: Solved("lu"), lambda n: randn(n, N)),
]
"""Ops on the rules' data flow whose parameters take the per-op VJP (no gradient rule):
``linalg.lu_solve``."""
