"""Cases (see ``cases.py``) for nn.RNN, nn.LSTM, nn.GRU, nn.MultiheadAttention and Transformer layers."""

from __future__ import annotations

from typing import Any

RECURRENT_CASES: list[dict[str, Any]] = []
