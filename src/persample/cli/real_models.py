"""Real models for the command line, imported lazily: transformers' GPT-2 and peft's LoRA
(``persample dp-finetune``), and how the benchmark (:mod:`persample_bench.real_models`,
which builds its other models on these) imports torchvision, timm, transformers and peft.

None of these packages is a dependency of persample (the ``test`` extra installs
them); a command imports one only when it needs it, and a model whose package is
missing is reported as not installed (:class:`NotInstalled`).
Every model is built from a config with random weights (``torch.manual_seed(0)``),
nothing is downloaded, and each is in eval mode as shipped.

``torchvision``: the only wheel that matches torch 2.13 here is a CUDA build, whose
compiled ops do not load beside a CPU torch; its Python model code imports once its
two op schemas exist (:func:`load_torchvision`). So that ``import transformers`` (which
imports torchvision whenever it is importable) works in the environment the README's
set-up makes, that set-up installs torchvision, and timm (which needs it), beside the
environment in ``<venv>/vision`` (:data:`VISION_DIR`), not in it; the benchmark and the
tests put that folder on ``sys.path`` only after defining the schemas.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VISION_DIR = Path(sys.prefix) / "vision"
"""Where the README's set-up installs torchvision and timm: beside the environment."""

INSTALL_HINT = "pip install -e '.[test]'"
VISION_HINT = ("pip install --no-deps --target <venv>/vision 'timm>=1.0,<2' torchvision==0.28.0, "
               "or both into the environment where torchvision's compiled ops load")

_LIB = None  # the torch.library fragment defining torchvision's op schemas, kept alive


class NotInstalled(ImportError):
    """A package a workload needs is not installed; the message says how to install it."""


def load_torchvision() -> ModuleType | None:
    """``import torchvision``, defining ``torchvision::nms``/``::qnms`` first if its
    compiled ops did not load (a CUDA build beside a CPU torch).

    torchvision is taken from the environment, or else from :data:`VISION_DIR`
    (appended to ``sys.path``; the README's set-up installs torchvision and timm there,
    out of the environment, so that ``import transformers`` works without this call).

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

    Examples:
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
        if not VISION_DIR.is_dir() or str(VISION_DIR) in sys.path:
            return None
        sys.path.append(str(VISION_DIR))
        return load_torchvision()
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

    Examples:
        >>> require("no_such_package_here")
        Traceback (most recent call last):
        ...
        persample.cli.real_models.NotInstalled: no_such_package_here is not installed (pip install -e '.[test]')
    """  # noqa: E501
    import importlib

    found = load_torchvision()
    if name == "torchvision":
        if found is None:
            raise NotInstalled(f"torchvision is not installed ({VISION_HINT})")
        return found
    try:
        return importlib.import_module(name)
    except ImportError as err:
        hint = VISION_HINT if name == "timm" else INSTALL_HINT
        raise NotInstalled(f"{name} is not installed ({hint})") from err


def causal_lm_loss(out: Any, labels: Tensor) -> Tensor:
    """Each sample's mean next-token cross-entropy over its own tokens, from the logits.

    Args:
        out: the model's output with ``.logits`` ``(B, T, V)`` float (a ``ModelOutput``).
        labels: ``(B, T)`` int64 token ids; ``-100`` marks padding (ignored).

    Returns:
        ``(B,)`` losses in nats per token: position ``t``'s logits predict token ``t + 1``.

    Examples:
        >>> out = type("Out", (), {"logits": torch.zeros(2, 5, 7)})()
        >>> causal_lm_loss(out, torch.ones(2, 5, dtype=torch.long))  # log(7) each
        tensor([1.9459, 1.9459])

    Source: the tests' ``zoo.py`` (a loss written from the logits, as users write it).
    """
    logits, labels = out.logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def gpt2(vocab_size: int, seq_len: int = 64, layers: int = 4, width: int = 256,
         heads: int = 4) -> nn.Module:
    """transformers' ``GPT2LMHeadModel(GPT2Config(...))``: ``layers`` blocks of
    ``width`` with ``heads`` heads, ``n_positions = seq_len``; random weights
    (``torch.manual_seed(0)``), eval mode (no dropout); float32, on the CPU.
    Called as ``model(input_ids=..., attention_mask=...)``; returns a
    ``ModelOutput`` with ``.logits (B, T, vocab_size)``.

    Raises:
        NotInstalled: transformers is missing.

    Examples:
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


def lora(model: nn.Module, rank: int, targets: list[str],
         modules_to_save: list[str] | None = None, task_type: str | None = None,
         b_std: float = 0.0) -> nn.Module:
    """``peft``'s LoRA adapters of rank ``rank`` (``lora_alpha = 2 * rank``, no dropout)
    on the modules named ``targets``; ``modules_to_save`` (e.g. a classifier head)
    trained in full beside them; every other parameter frozen. ``fan_in_fan_out`` is
    set where the targets are transformers' ``Conv1D`` (GPT-2). ``task_type`` as peft's
    ``LoraConfig`` takes it (``"SEQ_CLS"``, ``"CAUSAL_LM"``).

    peft starts ``lora_B`` at zero, so that the adapted model is the base model and
    every ``lora_A`` gets a zero gradient; ``b_std > 0`` draws ``lora_B`` from
    ``N(0, b_std^2)`` instead (``torch.manual_seed(1)``), as after some fine-tuning.

    Returns:
        The ``PeftModel``, called as the model was.

    Raises:
        NotInstalled: peft is missing.

    Examples:
        >>> net = lora(gpt2(257, seq_len=8, layers=1, width=16, heads=2), 2, ["c_attn"])
        >>> sorted({n.split(".")[-3] for n, p in net.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']

    Source: Hu et al. 2021 (LoRA); peft's ``LoraConfig``.
    """
    peft = require("peft")
    conv1d = _transformers_conv1d()
    fan_in_fan_out = conv1d is not None and any(
        isinstance(m, conv1d) for name, m in model.named_modules()
        if name.split(".")[-1] in targets)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=list(targets), fan_in_fan_out=fan_in_fan_out,
                             modules_to_save=modules_to_save, task_type=task_type)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = peft.get_peft_model(model, config)
    if b_std > 0:
        torch.manual_seed(1)
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, b_std)
    return wrapped


def _transformers_conv1d() -> type | None:
    """transformers' ``Conv1D`` (GPT-2's linear layers, weight stored ``(in, out)``)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def with_lora(model: nn.Module, rank: int = 8) -> nn.Module:
    """``peft``'s LoRA adapters of rank ``rank`` on GPT-2's attention input projection
    (``c_attn``, a ``Conv1D``: ``fan_in_fan_out=True``), no dropout; only the adapters
    are trainable. Returns the ``PeftModel``, called as the model was.

    Raises:
        NotInstalled: peft is missing.

    Examples:
        >>> net = with_lora(gpt2(257, seq_len=8, layers=1, width=16, heads=2), rank=2)
        >>> sum(p.numel() for p in net.parameters() if p.requires_grad)
        128

    Source: Hu et al. 2021 (LoRA); peft's ``LoraConfig``.
    """
    return lora(model, rank, ["c_attn"])
