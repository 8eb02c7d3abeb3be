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

__all__ = ["VISION_DIR", "NotInstalled", "bert_classifier", "causal_lm_loss", "gcn", "gpt2",
           "gpt_oss", "llama", "llava", "load_torchvision", "lora", "mixtral", "require",
           "resnet18", "timm_vit", "vit_mae", "with_lora"]


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


def gpt_oss(vocab_size: int, seq_len: int = 64, layers: int = 2, width: int = 128,
            heads: int = 4, experts: int = 4, top_k: int = 2) -> nn.Module:
    """transformers' ``GptOssForCausalLM`` from a small config: ``experts`` experts with
    biases and a clamped SwiGLU (``top_k`` per token) in each of ``layers`` blocks of
    ``width``, attention with sinks, sliding and full layers in turn; transformers'
    default (grouped) experts implementation; random weights, eval mode, float32.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = gpt_oss(257, seq_len=8, layers=2, width=16, heads=2)
        >>> model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape
        torch.Size([1, 8, 257])
    """
    transformers = require("transformers")
    config = transformers.GptOssConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=width,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=width // heads,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=seq_len // 4,
        max_position_embeddings=seq_len, use_cache=False,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + [
            "sliding_attention"] * (layers % 2),
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config).eval()


def qwen2_moe(vocab_size: int, seq_len: int = 64, layers: int = 2, width: int = 128,
              heads: int = 4, experts: int = 4, top_k: int = 2) -> nn.Module:
    """transformers' ``Qwen2MoeForCausalLM`` from a small config: in each of ``layers``
    blocks of ``width``, ``experts`` routed experts (``top_k`` per token, transformers'
    default grouped implementation) beside a shared expert with a gate of its own;
    random weights, eval mode, float32.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = qwen2_moe(257, seq_len=8, layers=1, width=16, heads=2)
        >>> model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape
        torch.Size([1, 8, 257])
    """
    transformers = require("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
        moe_intermediate_size=width, shared_expert_intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=seq_len, use_cache=False,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config).eval()


def switch(vocab_size: int, layers: int = 2, width: int = 128, heads: int = 4,
           experts: int = 4, capacity: int = 32) -> nn.Module:
    """transformers' ``SwitchTransformersForConditionalGeneration`` from a small config:
    ``layers`` encoder and decoder blocks of ``width``, every other one a mixture of
    ``experts`` experts with top-1 routing, each expert taking at most ``capacity``
    tokens of a sequence (the rest dropped); random weights, eval mode, float32 (the
    routers in float32, as the config's choices all are narrower).

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = switch(257, width=16, heads=2, capacity=2)
        >>> ids = torch.zeros(1, 8, dtype=torch.long)
        >>> model(input_ids=ids, decoder_input_ids=ids).logits.shape
        torch.Size([1, 8, 257])
    """
    transformers = require("transformers")
    config = transformers.SwitchTransformersConfig(
        vocab_size=vocab_size, d_model=width, d_kv=width // heads, d_ff=2 * width,
        num_layers=layers, num_decoder_layers=layers, num_heads=heads, num_experts=experts,
        expert_capacity=capacity, num_sparse_encoder_layers=max(1, layers // 2),
        num_sparse_decoder_layers=max(1, layers // 2), decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=vocab_size - 1)
    torch.manual_seed(0)
    return transformers.SwitchTransformersForConditionalGeneration(config).eval()


def vit_mae(img_size: int = 32, patch: int = 4, width: int = 64, depth: int = 2,
            heads: int = 4, mask_ratio: float = 0.75) -> nn.Module:
    """transformers' ``ViTMAEForPreTraining`` from a small config (masked autoencoder:
    ``depth`` encoder blocks of ``width`` on the visible patches, a decoder of one block
    on them and the learned mask token repeated into the masked places); random weights,
    eval mode, float32. Called with ``pixel_values`` and ``noise`` (which patches are
    masked).

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = vit_mae(16, width=16, depth=1, heads=2)
        >>> out = model(pixel_values=torch.zeros(1, 3, 16, 16), noise=torch.rand(1, 16))
        >>> out.logits.shape
        torch.Size([1, 16, 48])
    """
    transformers = require("transformers")
    config = transformers.ViTMAEConfig(
        image_size=img_size, patch_size=patch, hidden_size=width, num_hidden_layers=depth,
        num_attention_heads=heads, intermediate_size=4 * width, decoder_hidden_size=width,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=heads,
        decoder_intermediate_size=4 * width, mask_ratio=mask_ratio)
    torch.manual_seed(0)
    return transformers.ViTMAEForPreTraining(config).eval()


def llava(vocab_size: int, seq_len: int = 64, img_size: int = 32, patch: int = 8,
          width: int = 128, layers: int = 2, heads: int = 4) -> nn.Module:
    """transformers' ``LlavaForConditionalGeneration`` from a small config: a CLIP vision
    tower of ``layers`` blocks of ``width`` on ``img_size`` images in ``patch`` patches
    (its class token dropped), a two-layer projector, and a Llama of ``layers`` blocks of
    ``width`` whose image token is id ``vocab_size`` (the vocabulary one larger): each
    image's ``(img_size / patch)^2`` features written into the rows of its sample's image
    tokens. Random weights, eval mode, float32.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
        >>> model = llava(257, seq_len=8, img_size=16, width=16, layers=1, heads=2)
        >>> ids = torch.tensor([[1, 257, 257, 257, 257, 2, 3, 4]])
        >>> model(input_ids=ids, pixel_values=torch.zeros(1, 3, 16, 16)).logits.shape
        torch.Size([1, 8, 258])
    """
    transformers = require("transformers")
    vision = transformers.CLIPVisionConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=heads, image_size=img_size, patch_size=patch)
    text = transformers.LlamaConfig(
        vocab_size=vocab_size + 1, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq_len,
        use_cache=False)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=vocab_size,
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def gcn(features: int, width: int = 64, classes: int = 2) -> nn.Module:
    """Two torch_geometric ``GCNConv`` layers and a mean pool per graph, then a linear
    classifier, on a ``Batch`` of graphs (``forward(batch)``: ``x``, ``edge_index``,
    ``batch``); random weights, eval mode.

    Raises:
        NotInstalled: torch_geometric is missing.
    """
    geometric = require("torch_geometric")

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = geometric.nn.GCNConv(features, width)
            self.conv2 = geometric.nn.GCNConv(width, width)
            self.head = nn.Linear(width, classes)

        def forward(self, data):
            h = self.conv1(data.x, data.edge_index).relu()
            h = self.conv2(h, data.edge_index).relu()
            return self.head(geometric.nn.global_mean_pool(h, data.batch))

    torch.manual_seed(0)
    return GCN().eval()


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
