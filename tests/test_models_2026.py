"""transformers models of the architectures trained in 2025-26, from small configs
(``B`` = 4 = heads = experts somewhere), in float64 and evaluation mode: every parameter a
forward reads takes a rule or a module rule (none ``torch.func``, nor the fallback), and
the per-sample gradients equal the loop's.

DeepSeek-V3 (multi-head latent attention with keys assembled by writes into a fresh
tensor, a group-limited sigmoid router, a shared expert), Qwen3-Next (gated DeltaNet by
``linalg.solve_triangular``, gated attention, a mixture with a shared expert), Qwen2-MoE
and OLMoE (mixtures), RecurrentGemma (RG-LRU gates by ``baddbmm`` of a bias and a weight
per head), Perceiver (learned latents broadcast into the batch as the queries), ViTMAE
(mask tokens repeated into the batch), Swin-v2, ModernBERT, and attention variants:
BEiT (a relative position bias per layer), Longformer (sliding windows by ``as_strided``
chunks, a global token), T5 for sequence classification (its end-of-sequence state);
LLaVA (image features listed per image, joined, and written by ``masked_scatter`` into
each sample's image tokens), Gemma 3 (the same, and a mask made by ``torch.vmap``),
Idefics3 (SmolVLM: position ids by ``bucketize``).
The mixtures run transformers' eager experts here: its grouped kernel has no float64
(``grouped_mm`` in float32 is tested with gpt-oss in ``test_experts.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import persample
import zoo
from battery import flat

transformers = zoo.require("transformers")
pytestmark = pytest.mark.slow
B, L = 4, 8
T = transformers


def next_token(out, ids):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def classes(out, y):
    return F.cross_entropy(out.logits, y, reduction="none")


def squares(out, y):
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits
    return hidden.pow(2).flatten(1).mean(1)


def _ids(vocab: int = 50) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(1, vocab, (B, L))
    return {"input_ids": ids}, ids


def _eager(model):
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            config._experts_implementation = "eager"
    return model


def deepseek_v3():
    return _eager(T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=8,
        q_lora_rank=8, qk_rope_head_dim=4, v_head_dim=4, qk_nope_head_dim=4,
        first_k_dense_replace=1, max_position_embeddings=64, use_cache=False))), *_ids(), next_token


def qwen3_next():
    return _eager(T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=4,
        linear_value_head_dim=4, linear_conv_kernel_dim=2, max_position_embeddings=64,
        use_cache=False))), *_ids(), next_token


def qwen2_moe():
    return _eager(T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False))), *_ids(), next_token


def olmoe():
    return _eager(T.OlmoeForCausalLM(T.OlmoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False))), *_ids(), next_token


def recurrent_gemma():
    return T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, lru_width=16, attention_window_size=4,
        conv1d_width=2, block_types=["recurrent", "recurrent", "attention"], head_dim=8,
        partial_rotary_factor=0.5)), *_ids(), next_token


def perceiver():
    model = T.PerceiverModel(T.PerceiverConfig(
        num_latents=4, d_latents=16, d_model=16, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=2, num_cross_attention_heads=2, qk_channels=16,
        v_channels=16))
    return model, {"inputs": torch.randn(B, L, 16)}, None, squares


def vit_mae():
    model = T.ViTMAEForPreTraining(T.ViTMAEConfig(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=32, decoder_hidden_size=16,
        decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=32, mask_ratio=0.5))
    inputs = {"pixel_values": torch.randn(B, 3, 16, 16), "noise": torch.rand(B, 16)}
    return model, inputs, None, squares


def swin_v2():
    model = T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2], window_size=4,
        num_labels=3))
    return model, {"pixel_values": torch.randn(B, 3, 32, 32)}, torch.randint(0, 3, (B,)), classes


def modern_bert():
    model = T.ModernBertForSequenceClassification(T.ModernBertConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_labels=3, max_position_embeddings=64,
        global_attn_every_n_layers=2, local_attention=4, pad_token_id=0))
    inputs, _ = _ids()
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, 5:] = 0
    return model, {**inputs, "attention_mask": mask}, torch.randint(0, 3, (B,)), classes


def beit():
    model = T.BeitForImageClassification(T.BeitConfig(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=32, num_labels=3,
        use_relative_position_bias=True))
    return model, {"pixel_values": torch.randn(B, 3, 16, 16)}, torch.randint(0, 3, (B,)), classes


def longformer():
    model = T.LongformerForSequenceClassification(T.LongformerConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, num_labels=3, attention_window=4,
        max_position_embeddings=2 * L + 4, pad_token_id=0))
    ids = torch.randint(1, 50, (B, 2 * L))  # (windows of 4 over 16 tokens; the first global)
    return model, {"input_ids": ids}, torch.randint(0, 3, (B,)), classes


def t5_classifier():
    model = T.T5ForSequenceClassification(T.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, num_labels=3,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    ids = torch.randint(2, 50, (B, L))
    ids[:, -1] = 1  # (one end-of-sequence token each: the classifier reads its state)
    return model, {"input_ids": ids}, torch.randint(0, 3, (B,)), classes


def llava():
    """Four image rows per sample (a 16x16 image in 8x8 patches, CLIP's class token
    dropped) written into four image tokens, which sit elsewhere in each sample."""
    vision = T.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=4, image_size=16, patch_size=8)
    text = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                         max_position_embeddings=64)
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=49,
        vision_feature_select_strategy="default", vision_feature_layer=-1))
    ids = torch.randint(1, 49, (B, 2 * L))
    for i in range(B):
        ids[i, 1 + 2 * i:5 + 2 * i] = 49
    return model, {"input_ids": ids, "pixel_values": torch.randn(B, 3, 16, 16)}, None, (
        lambda out, y: out.logits[:, -1].pow(2).mean(1))


def gemma3():
    """Four image tokens per sample between its begin- and end-of-image tokens, at
    another place in each sample; the image tokens attend to each other both ways
    (transformers makes that mask with ``torch.vmap``, which persample's capture has made
    by broadcasting), and the text by a sliding window."""
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, image_size=16, patch_size=4,
                                  vision_use_head=False)
    text = T.Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, sliding_window=8,
                              max_position_embeddings=64, pad_token_id=0)
    model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=60,
        boi_token_index=61, eoi_token_index=62))
    for p in model.parameters():  # (the projector and norms start at zero)
        torch.nn.init.normal_(p, std=0.2)
    ids, kinds = torch.randint(1, 59, (B, 14)), torch.zeros(B, 14, dtype=torch.long)
    for i, start in enumerate([1, 3, 6, 9]):
        ids[i, start - 1], ids[i, start:start + 4], ids[i, start + 4] = 61, 60, 62
        kinds[i, start:start + 4] = 1
    inputs = {"input_ids": ids, "pixel_values": torch.randn(B, 3, 16, 16),
              "attention_mask": torch.ones(B, 14, dtype=torch.long), "token_type_ids": kinds}
    return model, inputs, None, lambda out, y: out.logits[:, -1].pow(2).mean(1)


def idefics3():
    """SmolVLM's architecture: each sample's image (a 16x16 image in 4x4 patches, pixel
    shuffled by 2 into four image tokens) at another place in each sample, with the
    processor's pixel mask; the vision embeddings' position ids come from ``bucketize``
    of each image's fractional patch coordinates."""
    vision = T.Idefics3VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, image_size=16, patch_size=4)
    text = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=60,
                         max_position_embeddings=64)
    model = T.Idefics3ForConditionalGeneration(T.Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=55, scale_factor=2))
    ids = torch.randint(1, 50, (B, 2 * L))
    for i in range(B):
        ids[i, 1 + i:5 + i] = 55
    inputs = {"input_ids": ids, "pixel_values": torch.randn(B, 1, 3, 16, 16),
              "pixel_attention_mask": torch.ones(B, 1, 16, 16, dtype=torch.bool)}
    return model, inputs, None, lambda out, y: out.logits[:, -1].pow(2).mean(1)


def detr():
    """DETR with transformers' own ResNet backbone: the pixel mask (a sample's right part
    padded) resized to the feature map as one image's channels (``mask[None]``), object
    queries broadcast into the batch, the detection heads' logits and boxes."""
    backbone = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                              layer_type="basic", out_features=["stage2"])
    model = T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=B,
        num_labels=3, auxiliary_loss=False))
    mask = torch.ones(B, 32, 32, dtype=torch.long)
    mask[1, :, 20:] = 0
    inputs = {"pixel_values": torch.randn(B, 3, 32, 32), "pixel_mask": mask}
    return model, inputs, None, lambda out, y: (out.logits.pow(2).flatten(1).mean(1)
                                                + out.pred_boxes.pow(2).flatten(1).mean(1))


def jetmoe():
    """JetMoE: mixtures of experts in its attention and its MLP, the tokens sorted by
    expert and split by each expert's count, a linear map per expert, joined and split
    again; ``B`` = 4 = the experts."""
    model = T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, kv_channels=4,
        intermediate_size=16, num_key_value_heads=2, num_local_experts=B,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=1))
    inputs, ids = _ids()
    return model, inputs, ids, next_token


def dbrx():
    """DBRX: its experts a loop over those some token of the batch chose, each a slice of
    stacked weights indexed by that choice; ``clip_qkv``; ``B`` = 4 = the experts."""
    model = T.DbrxForCausalLM(T.DbrxConfig(
        d_model=16, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=50,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": B, "moe_top_k": 2},
        pad_token_id=1))
    inputs, ids = _ids()
    return model, inputs, ids, next_token


def vitdet():
    """VitDet: windowed and global attention with decomposed relative positions (the
    queries, the samples merged with the heads, against tables looked up by position,
    by ``einsum``); ``B`` = 4 = the heads."""
    model = T.VitDetModel(T.VitDetConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=B, mlp_ratio=2,
        image_size=16, patch_size=4, pretrain_image_size=16, window_size=2,
        window_block_indices=[0], use_relative_position_embeddings=True,
        residual_block_indices=[1]))
    return model, {"pixel_values": torch.randn(B, 3, 16, 16)}, None, squares


MODELS = {f.__name__: f for f in (deepseek_v3, qwen3_next, qwen2_moe, olmoe, recurrent_gemma,
                                  perceiver, vit_mae, swin_v2, modern_bert, beit, longformer,
                                  t5_classifier, llava, gemma3, idefics3, detr, jetmoe, dbrx,
                                  vitdet)}
# Gemma 3's RMSNorm computes in float32 whatever the input: a sample's forward alone rounds
# otherwise than the batch's, and the loop differs from the batch's gradient by as much
LOOSER = {"gemma3": 1e-6}


def _to64(x):
    if isinstance(x, dict):
        return {k: _to64(v) for k, v in x.items()}
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


@pytest.mark.parametrize("name", MODELS)
def test_on_the_rules_and_exact(name):
    torch.manual_seed(0)
    model, x, y, loss_fn = MODELS[name]()
    model, x = model.double().eval(), _to64(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # auto may not leave the rules
        warnings.filterwarnings("ignore", message=".*(Initializing global|performance|"
                                "falling back|not installed).*")
        routes = persample.supported(model, x, y, loss_fn)
        got = persample.per_sample_grads(model, x, y, loss_fn)
    paths = {r.path for r in routes} - {"unused"}
    assert paths <= {"rule", "module rule"}, [(r.module, r.path, r.reason) for r in routes
                                              if r.path not in ("rule", "module rule")]
    want = persample.loop_per_sample_grads(model, x, y, loss_fn)
    err = (flat(got) - flat(want)).abs().max() / flat(want).abs().max()
    assert err < LOOSER.get(name, 1e-9), err
