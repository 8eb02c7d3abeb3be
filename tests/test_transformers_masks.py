"""transformers' attention masks made by ``torch.vmap`` (a mask function combined with
another: Gemma 3's image tokens attending to each other) are made by broadcasting while
persample captures a forward, where every mask function is transformers' own: the same
mask, from ops the capture follows. A mask function of the user's own keeps ``vmap``;
other threads and calls outside a capture are untouched, and the patch is undone."""

from __future__ import annotations

import threading

import pytest
import torch

import zoo
from persample.patches import WhileCapturing

transformers = zoo.require("transformers")
masking = pytest.importorskip("transformers.masking_utils")
B, T = 4, 6


@pytest.fixture
def vmapped(monkeypatch):
    """The masks made by ``vmap`` since (counted)."""
    made = []
    original = masking._vmap_expansion_sdpa

    def counting(function):
        made.append(function)
        return original(function)

    monkeypatch.setattr(masking, "_vmap_expansion_sdpa", counting)
    return made


def _blocks() -> torch.Tensor:
    groups = torch.full((B, T), -1)
    for i in range(B):  # (each sample's image block somewhere else)
        groups[i, i % 3:i % 3 + 3] = 0
    return groups


def _mask(function) -> torch.Tensor:
    interface = masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    return interface(batch_size=B, q_length=T, kv_length=T, mask_function=function,
                     use_vmap=True, allow_is_causal_skip=False)


def test_transformers_own_mask_functions_are_broadcast_while_capturing(vmapped):
    function = masking.or_masks(masking.causal_mask_function,
                                masking.blockwise_overlay(_blocks()))
    want = _mask(function)
    assert len(vmapped) == 1
    WhileCapturing.enter()
    try:
        got = _mask(function)
        eager = masking.eager_mask(batch_size=B, q_length=T, kv_length=T,
                                   mask_function=function, use_vmap=True,
                                   allow_is_causal_skip=False)
    finally:
        WhileCapturing.exit()
    assert len(vmapped) == 1  # (neither made by vmap)
    assert torch.equal(got, want) and got.shape == (B, 1, T, T)
    assert torch.equal(eager == 0, want)  # (eager's: 0 where attended, -inf elsewhere)
    assert masking.sdpa_mask.__name__ == "sdpa_mask" and not hasattr(
        masking.sdpa_mask, "__wrapped__")  # undone
    assert masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is masking.sdpa_mask


def test_a_mask_function_of_ones_own_keeps_vmap(vmapped):
    groups = _blocks()

    def mine(batch, head, q, kv):  # (not transformers': it may not index as theirs do)
        return groups[batch, q] == groups[batch, kv]

    WhileCapturing.enter()
    try:
        _mask(masking.or_masks(masking.causal_mask_function, mine))
    finally:
        WhileCapturing.exit()
    assert len(vmapped) == 1


def test_other_threads_keep_vmap_while_one_captures(vmapped):
    function = masking.or_masks(masking.causal_mask_function,
                                masking.blockwise_overlay(_blocks()))
    WhileCapturing.enter()
    try:
        other = threading.Thread(target=_mask, args=(function,))
        other.start()
        other.join(timeout=60)
        assert not other.is_alive()
    finally:
        WhileCapturing.exit()
    assert len(vmapped) == 1
