"""The benchmark's real models, imported lazily: torchvision's resnet18, timm's ViT,
transformers' Mixtral, BERT and Llama, built here; GPT-2, LoRA, the loss from the logits
and the lazy imports are the command line's (:mod:`persample.cli.real_models`, which
``persample dp-finetune`` uses too), named here as well.

None of these packages is a dependency of persample (the ``test`` extra installs
them); the benchmark imports one only when a workload that needs it runs, and a
workload whose package is missing is reported as not installed (:class:`NotInstalled`).
Every model is built from a config with random weights (``torch.manual_seed(0)``),
nothing is downloaded, and each is in eval mode as shipped (Mixtral in training mode).
"""

from __future__ import annotations

import torch
from torch import nn

from persample.cli.real_models import (
    VISION_DIR,
    NotInstalled,
    causal_lm_loss,
    gpt2,
    load_torchvision,
    lora,
    require,
    with_lora,
)

__all__ = ["VISION_DIR", "NotInstalled", "bert_classifier", "causal_lm_loss", "gpt2", "llama",
           "load_torchvision", "lora", "mixtral", "require", "resnet18", "timm_vit",
           "with_lora"]


def resnet18(classes: int = 10) -> nn.Module:
    """torchvision's ``resnet18(num_classes=classes)`` as shipped, random weights
    (``torch.manual_seed(0)``), eval mode; float32, on the CPU. Takes ``(B, 3, H, W)``.

    Raises:
        NotInstalled: torchvision is missing.

    Examples:
        >>> sum(p.numel() for p in resnet18().parameters())
        11181642
    """
    tv = require("torchvision")
    torch.manual_seed(0)
    return tv.models.resnet18(num_classes=classes).eval()


def timm_vit(img_size: int = 28, in_chans: int = 1, classes: int = 10, width: int = 64,
             depth: int = 2, heads: int = 4) -> nn.Module:
    """timm's ``VisionTransformer(img_size, patch_size=4, in_chans, embed_dim=width,
    depth, num_heads=heads, num_classes)``: a class token, learned positions, random
    weights (``torch.manual_seed(0)``), eval mode; float32, on the CPU. The default is
    the small ViT of ``vit-grads``; ``width=192, depth=12, heads=3`` is ViT-Tiny
    (``vit_tiny_patch16_224``'s sizes; Touvron et al. 2021, DeiT-Tiny).

    Raises:
        NotInstalled: timm is missing.

    Examples:
        >>> timm_vit()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    require("timm")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=4, in_chans=in_chans, embed_dim=width,
                             depth=depth, num_heads=heads, num_classes=classes).eval()


def mixtral(vocab_size: int, seq_len: int = 64, layers: int = 2, width: int = 128,
            heads: int = 4, experts: int = 4, top_k: int = 2) -> nn.Module:
    """transformers' ``MixtralForCausalLM(MixtralConfig(...))`` from a small config: a
    sparse mixture of ``experts`` experts (``top_k`` per token, MLPs of ``2 * width``)
    in each of ``layers`` blocks of ``width``, ``heads`` heads (half as many key-value
    heads), rotary positions; transformers' default experts implementation; random
    weights (``torch.manual_seed(0)``), training mode (no dropout in this config);
    float32, on the CPU. Returns a ``ModelOutput`` with ``.logits (B, T, vocab_size)``.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = mixtral(257, seq_len=8, layers=1, width=16, heads=2)
        >>> model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape
        torch.Size([1, 8, 257])
    """
    transformers = require("transformers")
    config = transformers.MixtralConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=seq_len, use_cache=False,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def bert_classifier(vocab_size: int = 30522, layers: int = 4, width: int = 768,
                    heads: int = 12, intermediate: int = 3072, classes: int = 2,
                    max_positions: int = 512) -> nn.Module:
    """transformers' ``BertForSequenceClassification(BertConfig(...))``: ``layers``
    blocks of ``width`` with ``heads`` heads and an MLP of ``intermediate``, absolute
    positions up to ``max_positions``, the pooler and a ``classes``-way ``classifier``;
    the other settings BERT-base's (``BertConfig`` defaults). Random weights
    (``torch.manual_seed(0)``), eval mode; float32, on the CPU. Called as
    ``model(input_ids=..., token_type_ids=..., attention_mask=...)``; returns a
    ``ModelOutput`` with ``.logits (B, classes)``.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = bert_classifier(100, layers=1, width=16, heads=2, intermediate=32)
        >>> model(input_ids=torch.zeros(3, 8, dtype=torch.long)).logits.shape
        torch.Size([3, 2])

    Source: Devlin et al. 2019 (BERT); transformers' ``BertConfig``.
    """
    transformers = require("transformers")
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=width,
                                     num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=intermediate,
                                     max_position_embeddings=max_positions, num_labels=classes)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def llama(vocab_size: int = 32000, layers: int = 4, width: int = 1024, heads: int = 16,
          kv_heads: int = 4, intermediate: int = 2816, max_positions: int = 2048) -> nn.Module:
    """transformers' ``LlamaForCausalLM(LlamaConfig(...))``: ``layers`` blocks of
    ``width``, grouped-query attention (``heads`` query heads sharing ``kv_heads``
    key/value heads), rotary positions, RMSNorm, a SwiGLU MLP of ``intermediate``, an
    output layer of its own (not tied to the embedding, as Llama ships). Random weights
    (``torch.manual_seed(0)``), eval mode; float32, on the CPU. Called as
    ``model(input_ids=..., attention_mask=...)``; returns a ``ModelOutput`` with
    ``.logits (B, T, vocab_size)``.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = llama(100, layers=1, width=16, heads=4, kv_heads=2, intermediate=32)
        >>> model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape
        torch.Size([1, 8, 100])

    Source: Touvron et al. 2023 (Llama 2: grouped-query attention); transformers'
    ``LlamaConfig``.
    """
    transformers = require("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=width,
                                      intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()
