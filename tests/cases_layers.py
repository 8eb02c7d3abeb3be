"""Cases (see ``cases.py``) for ConvTranspose, InstanceNorm, RMSNorm, BatchNorm (eval), EmbeddingBag, PReLU, Bilinear."""

from __future__ import annotations

from typing import Any

LAYER_CASES: list[dict[str, Any]] = []
