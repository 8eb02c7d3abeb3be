"""Real models as users build and call them: Hugging Face ``transformers`` and ``peft``,
``timm`` and ``torchvision``, from small configs with random weights (no downloads).

Each entry of :data:`ZOO` builds ``(model, inputs, targets, loss_fn)`` in float64,
eval mode, called as its library's users call it: keyword inputs (a dict, like a
tokenizer's ``BatchEncoding``), padding masks, a ``ModelOutput`` returned, a
per-sample loss written from the logits. Sizes are chosen to coincide (batch size
= sequence length = heads = windows where the model has them), so that a guess of
where the batch is from a size has nowhere to hide.

``torchvision``: the only wheel that matches torch 2.13 here is a CUDA build; its
Python model code imports once its two op schemas exist
(:func:`persample.cli.real_models.load_torchvision`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from persample.cli.real_models import load_torchvision  # noqa: F401 (test_readme imports it)

SETUP = "the README's set-up command (torchvision and timm go in .venv/vision)"


def require(name: str) -> Any:
    """The package ``name``, imported. Missing: under CI (``CI`` set), where the README's
    set-up installed it, the test fails with the import error; elsewhere it is skipped,
    naming the set-up that installs it."""
    import importlib
    import os

    try:
        if name == "torchvision":
            found = load_torchvision()
            if found is None:
                raise ImportError("torchvision is neither in the environment nor in "
                                  ".venv/vision")
            return found
        load_torchvision()  # transformers and timm import it when it is installed
        return importlib.import_module(name)
    except ImportError as err:
        if os.environ.get("CI"):
            pytest.fail(f"{name} does not import under CI ({type(err).__name__}: {err}); "
                        f"{SETUP} installs it", pytrace=False)
        pytest.skip(f"{name} is not installed: run {SETUP}")


# ---------------------------------------------------------------------------
# losses as users write them

def causal_lm_loss(out: Any, labels: Tensor) -> Tensor:
    """Each sample's mean next-token cross-entropy over its own tokens (-100: padding)."""
    logits, labels = out.logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def seq2seq_loss(out: Any, labels: Tensor) -> Tensor:
    per_token = F.cross_entropy(out.logits.transpose(1, 2), labels, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def logits_ce(out: Any, labels: Tensor) -> Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, labels, reduction="none")


# ---------------------------------------------------------------------------
# text models

B = T = HEADS = 4  # coinciding on purpose
VOCAB = 40


def _text(pad_last: bool = True) -> tuple[dict, Tensor]:
    """``{input_ids, attention_mask}`` with sample 0 right-padded by one token, and
    labels with -100 where padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad_last:
        mask[0, -1] = 0
        ids[0, -1] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def _hf(cls_name: str, config: Any) -> nn.Module:
    transformers = require("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    return model.double().eval()


def gpt2_config(**extra):
    transformers = require("transformers")
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2,
                                   n_head=HEADS, bos_token_id=1, eos_token_id=1, **extra)


def gpt_oss(seq_len: int) -> nn.Module:
    """transformers' gpt-oss 2x16, 4 experts with biases top-2 in the default grouped
    implementation, sliding and full layers, float32 (its router runs there), eval."""
    transformers = require("transformers")
    config = transformers.GptOssConfig(
        vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=seq_len * 4,
        use_cache=False, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config).float().eval()


def gpt2_lm():
    inputs, labels = _text()
    return _hf("GPT2LMHeadModel", gpt2_config()), inputs, labels, causal_lm_loss


def gpt2_cls():
    inputs, _ = _text()
    labels = torch.tensor([0, 2, 1, 2])
    model = _hf("GPT2ForSequenceClassification", gpt2_config(pad_token_id=0, num_labels=3))
    return model, inputs, labels, logits_ce


def bert():
    transformers = require("transformers")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=HEADS, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=3)
    inputs, _ = _text()
    return (_hf("BertForSequenceClassification", config), inputs, torch.tensor([0, 2, 1, 2]),
            logits_ce)


def bert_token_types():
    """BERT with the tokenizer's ``token_type_ids`` (two segments) passed in."""
    model, inputs, labels, loss = bert()
    inputs["token_type_ids"] = (torch.arange(T) >= T // 2).long().expand(B, T).clone()
    return model, inputs, labels, loss


def distilbert():
    transformers = require("transformers")
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=HEADS,
                                           hidden_dim=32, max_position_embeddings=16,
                                           num_labels=3)
    inputs, _ = _text()
    return (_hf("DistilBertForSequenceClassification", config), inputs,
            torch.tensor([1, 0, 2, 2]), logits_ce)


def _seq2seq(cls_name: str, config: Any):
    inputs, labels = _text()
    g = torch.Generator().manual_seed(2)
    decoder = torch.randint(2, VOCAB, (B, T), generator=g)
    inputs["decoder_input_ids"] = decoder
    targets = torch.roll(decoder, -1, 1)
    return _hf(cls_name, config), inputs, targets, seq2seq_loss


def t5():
    transformers = require("transformers")
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                   num_heads=HEADS, relative_attention_num_buckets=8,
                                   decoder_start_token_id=0, pad_token_id=0)
    return _seq2seq("T5ForConditionalGeneration", config)


def bart():
    transformers = require("transformers")
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1,
                                     decoder_layers=1, encoder_attention_heads=HEADS,
                                     decoder_attention_heads=HEADS, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=16)
    return _seq2seq("BartForConditionalGeneration", config)


def opt():
    transformers = require("transformers")
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                    ffn_dim=32, num_attention_heads=HEADS,
                                    max_position_embeddings=16, word_embed_proj_dim=16)
    inputs, labels = _text()
    return _hf("OPTForCausalLM", config), inputs, labels, causal_lm_loss


def llama_config():
    transformers = require("transformers")
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=HEADS,
                                    num_key_value_heads=2, max_position_embeddings=16)


def llama():
    inputs, labels = _text()
    return _hf("LlamaForCausalLM", llama_config()), inputs, labels, causal_lm_loss


def deberta_v2():
    """DeBERTa-v2's disentangled attention: relative position embeddings shared by all
    samples, gathered against each sample's queries and keys."""
    transformers = require("transformers")
    config = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                          num_attention_heads=HEADS, intermediate_size=32,
                                          max_position_embeddings=16, relative_attention=True,
                                          position_buckets=4, max_relative_positions=8,
                                          pos_att_type=["p2c", "c2p"], num_labels=3)
    inputs, _ = _text()
    return (_hf("DebertaV2ForSequenceClassification", config), inputs,
            torch.tensor([2, 0, 1, 1]), logits_ce)


def vit_hf():
    transformers = require("transformers")
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                    num_hidden_layers=2, num_attention_heads=HEADS,
                                    intermediate_size=32, num_labels=3)
    torch.manual_seed(3)
    pixels = torch.randn(B, 3, 8, 8, dtype=torch.float64)
    return (_hf("ViTForImageClassification", config), {"pixel_values": pixels},
            torch.tensor([0, 1, 2, 0]), logits_ce)


def _lora(model: nn.Module, targets: list[str]) -> nn.Module:
    peft = require("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    torch.manual_seed(4)
    for name, p in wrapped.named_parameters():  # lora_B starts at zero: make it count
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    return wrapped.double().eval()


def gpt2_lora():
    model, inputs, labels, loss = gpt2_lm()
    return _lora(model, ["c_attn", "c_fc"]), inputs, labels, loss


def llama_lora():
    """With ``position_ids`` by keyword (peft passes it on only so), a ``(1, T)`` tensor
    shared by all samples."""
    model, inputs, labels, loss = llama()
    inputs["position_ids"] = torch.arange(T)[None]
    return _lora(model, ["q_proj", "v_proj", "down_proj"]), inputs, labels, loss


# ---------------------------------------------------------------------------
# vision models, as shipped (in-place ReLUs, residual +=), eval mode

def _images(size: int, n: int = B) -> Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 3, size, size, generator=g, dtype=torch.float64)


def _vision(model: nn.Module, size: int, classes: int = 5):
    torch.manual_seed(6)
    labels = torch.randint(0, classes, (B,), generator=torch.Generator().manual_seed(7))
    return model.double().eval(), _images(size), labels, logits_ce


def resnet18():
    tv = require("torchvision")
    torch.manual_seed(0)
    return _vision(tv.models.resnet18(num_classes=5), 32)


def mobilenet_v3():
    tv = require("torchvision")
    torch.manual_seed(0)
    return _vision(tv.models.mobilenet_v3_small(num_classes=5, width_mult=0.25), 32)


def efficientnet_b0():
    tv = require("torchvision")
    torch.manual_seed(0)
    return _vision(tv.models.efficientnet_b0(num_classes=5), 32)


def densenet():
    tv = require("torchvision")
    torch.manual_seed(0)
    model = tv.models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                               bn_size=2, num_classes=5)
    return _vision(model, 32)


def convnext():
    tv = require("torchvision")
    from torchvision.models.convnext import CNBlockConfig

    torch.manual_seed(0)
    model = tv.models.convnext.ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)],
                                        num_classes=5, layer_scale=0.5)
    return _vision(model, 16)


def swin():
    """Windows of 2x2 patches over a 4x4 grid: 4 windows = batch size = heads."""
    tv = require("torchvision")
    torch.manual_seed(0)
    model = tv.models.SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2, 1],
                                      num_heads=[HEADS, HEADS], window_size=[2, 2],
                                      num_classes=5)
    return _vision(model, 8)


def timm_vit_layerscale():
    timm = require("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=HEADS, init_values=0.5,
        num_classes=5)
    return _vision(model, 8)


def timm_resnet():
    require("timm")
    torch.manual_seed(0)
    from timm.models.resnet import BasicBlock, ResNet

    return _vision(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5), 32)


def timm_efficientnet():
    timm = require("timm")
    torch.manual_seed(0)
    return _vision(timm.create_model("efficientnet_b0", num_classes=5), 32)


def timm_convnext():
    timm = require("timm")
    torch.manual_seed(0)
    model = timm.models.convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16),
                                          num_classes=5, ls_init_value=0.5)
    return _vision(model, 32)


def timm_mobilevit():
    """MobileViT: patches unfolded into ``(B*P, N, C)`` for its transformer and folded back."""
    timm = require("timm")
    torch.manual_seed(0)
    return _vision(timm.create_model("mobilevit_xxs", num_classes=5), 32)


def timm_levit():
    """LeViT: ``flatten(0, 1)`` of ``(B, N, C)`` before a BatchNorm1d, attention biases
    indexed by a ``(N, N)`` table."""
    timm = require("timm")
    torch.manual_seed(0)
    model = timm.models.levit.Levit(img_size=32, embed_dim=(16, 32), key_dim=4,
                                    num_heads=(HEADS, HEADS), depth=(1, 1), num_classes=5)
    model, images, labels, loss = _vision(model, 32)
    # in eval mode LeViT caches its attention biases across calls (with their autograd
    # graph, so a second backward fails even for plain autograd): train mode, with the
    # BatchNorms in eval mode as a per-sample model needs
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model, images, labels, loss


ZOO: dict[str, Callable] = {
    "gpt2-lm": gpt2_lm,
    "gpt2-cls": gpt2_cls,
    "bert": bert,
    "bert-token-types": bert_token_types,
    "distilbert": distilbert,
    "t5": t5,
    "bart": bart,
    "opt": opt,
    "llama": llama,
    "deberta-v2": deberta_v2,
    "vit": vit_hf,
    "gpt2-lora": gpt2_lora,
    "llama-lora": llama_lora,
    "resnet18": resnet18,
    "mobilenet-v3": mobilenet_v3,
    "efficientnet-b0": efficientnet_b0,
    "densenet": densenet,
    "convnext": convnext,
    "swin": swin,
    "timm-vit-layerscale": timm_vit_layerscale,
    "timm-resnet": timm_resnet,
    "timm-efficientnet": timm_efficientnet,
    "timm-convnext": timm_convnext,
    "timm-mobilevit": timm_mobilevit,
    "timm-levit": timm_levit,
}
