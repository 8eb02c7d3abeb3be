"""Real models for ``persample bench``, imported lazily: torchvision, timm, transformers.

None of these packages is a dependency of persample (the ``test`` extra installs
them); the benchmark imports one only when a workload that needs it runs, and a
workload whose package is missing is reported as not installed (:class:`NotInstalled`).
Every model is built from a config with random weights (``torch.manual_seed(0)``),
nothing is downloaded, and each is in eval mode as shipped.

``torchvision``: the only wheel that matches torch 2.13 here is a CUDA build, whose
compiled ops do not load beside a CPU torch; its Python model code imports once its
two op schemas exist (:func:`load_torchvision`).
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INSTALL_HINT = "pip install -e '.[test]'"

_LIB = None  # the torch.library fragment defining torchvision's op schemas, kept alive


class NotInstalled(ImportError):
    """A package a workload needs is not installed; the message says how to install it."""


def load_torchvision() -> ModuleType | None:
    """``import torchvision``, defining ``torchvision::nms``/``::qnms`` first if its
    compiled ops did not load (a CUDA build beside a CPU torch).

    When ``import torchvision`` raises a ``RuntimeError`` naming a ``torchvision::``
    operator, the half-imported ``torchvision`` modules are dropped from
    ``sys.modules``, the schemas ``nms(Tensor dets, Tensor scores, float
    iou_threshold) -> Tensor`` and ``qnms(...)`` (same signature) are defined with
    ``torch.library.Library("torchvision", "DEF")`` (kept in a module global, so that
    they stay defined) and the import is tried again. The models need neither op.

    Returns:
        The ``torchvision`` module, or ``None`` if it is not installed.

    Raises:
        RuntimeError: ``import torchvision`` failed for another reason.

    Example:
        >>> tv = load_torchvision()
        >>> tv is None or hasattr(tv, "models")
        True

    Source: moved from the tests' ``zoo.py`` (same behaviour).
    """
    global _LIB
    try:
        import torchvision

        return torchvision
    except ImportError:
        return None
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    if _LIB is None:
        _LIB = torch.library.Library("torchvision", "DEF")
        _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


def require(name: str) -> ModuleType:
    """Import the package ``name`` (``"torchvision"``, ``"timm"``, ``"transformers"``).

    ``torchvision`` goes through :func:`load_torchvision` first, since timm and
    transformers import it when it is installed.

    Returns:
        The module.

    Raises:
        NotInstalled: the package is not installed; the message has the install hint.

    Example:
        >>> require("no_such_package_here")
        Traceback (most recent call last):
        ...
        persample.cli.real_models.NotInstalled: no_such_package_here is not installed (pip install -e '.[test]')
    """  # noqa: E501
    import importlib

    found = load_torchvision()
    if name == "torchvision":
        if found is None:
            raise NotInstalled(f"torchvision is not installed ({INSTALL_HINT})")
        return found
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise NotInstalled(f"{name} is not installed ({INSTALL_HINT})") from err


def causal_lm_loss(out: Any, labels: Tensor) -> Tensor:
    """Each sample's mean next-token cross-entropy over its own tokens, from the logits.

    Args:
        out: the model's output with ``.logits`` ``(B, T, V)`` float (a ``ModelOutput``).
        labels: ``(B, T)`` int64 token ids; ``-100`` marks padding (ignored).

    Returns:
        ``(B,)`` losses in nats per token: position ``t``'s logits predict token ``t + 1``.

    Example:
        >>> out = type("Out", (), {"logits": torch.zeros(2, 5, 7)})()
        >>> causal_lm_loss(out, torch.ones(2, 5, dtype=torch.long))  # log(7) each
        tensor([1.9459, 1.9459])

    Source: the tests' ``zoo.py`` (a loss written from the logits, as users write it).
    """
    logits, labels = out.logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def resnet18(classes: int = 10) -> nn.Module:
    """torchvision's ``resnet18(num_classes=classes)`` as shipped, random weights
    (``torch.manual_seed(0)``), eval mode; float32, on the CPU. Takes ``(B, 3, H, W)``.

    Raises:
        NotInstalled: torchvision is missing.

    Example:
        >>> sum(p.numel() for p in resnet18().parameters())
        11181642
    """
    tv = require("torchvision")
    torch.manual_seed(0)
    return tv.models.resnet18(num_classes=classes).eval()


def gpt2(vocab_size: int, seq_len: int = 64, layers: int = 4, width: int = 256,
         heads: int = 4) -> nn.Module:
    """transformers' ``GPT2LMHeadModel(GPT2Config(...))``: ``layers`` blocks of
    ``width`` with ``heads`` heads, ``n_positions = seq_len``; random weights
    (``torch.manual_seed(0)``), eval mode (no dropout); float32, on the CPU.
    Called as ``model(input_ids=..., attention_mask=...)``; returns a
    ``ModelOutput`` with ``.logits (B, T, vocab_size)``.

    Raises:
        NotInstalled: transformers is missing.

    Example:
        >>> model = gpt2(257, seq_len=8, layers=1, width=16, heads=2)
        >>> model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape
        torch.Size([1, 8, 257])
    """
    transformers = require("transformers")
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=width,
                                     n_layer=layers, n_head=heads, bos_token_id=vocab_size - 1,
                                     eos_token_id=vocab_size - 1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def with_lora(model: nn.Module, rank: int = 8) -> nn.Module:
    """``peft``'s LoRA adapters of rank ``rank`` on GPT-2's attention input projection
    (``c_attn``, a ``Conv1D``: ``fan_in_fan_out=True``), no dropout; only the adapters
    are trainable. Returns the ``PeftModel``, called as the model was.

    Raises:
        NotInstalled: peft is missing.

    Example:
        >>> lora = with_lora(gpt2(257, seq_len=8, layers=1, width=16, heads=2), rank=2)
        >>> sum(p.numel() for p in lora.parameters() if p.requires_grad)
        128

    Source: Hu et al. 2021 (LoRA); peft's ``LoraConfig``.
    """
    peft = require("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=["c_attn"], fan_in_fan_out=True)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def timm_vit(img_size: int = 28, in_chans: int = 1, classes: int = 10) -> nn.Module:
    """timm's ``VisionTransformer(img_size, patch_size=4, in_chans, embed_dim=64, depth=2,
    num_heads=4, num_classes)``: a class token, learned positions, random weights
    (``torch.manual_seed(0)``), eval mode; float32, on the CPU.

    Raises:
        NotInstalled: timm is missing.

    Example:
        >>> timm_vit()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    require("timm")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=4, in_chans=in_chans, embed_dim=64,
                             depth=2, num_heads=4, num_classes=classes).eval()
