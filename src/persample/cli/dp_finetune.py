"""``persample dp-finetune``: a small GPT-2 fine-tuned with DP-SGD on real text.

A transformers GPT-2 (random weights, optionally trained briefly without privacy
first) is fine-tuned on the docstrings of Python's standard library, tokenised as
bytes (:func:`persample.data.docstring_batch`), fully or with LoRA adapters
(``peft``), with DP-SGD over Poisson-sampled logical batches split into physical
micro-batches (:class:`persample.dp.PrivateStep`). The same loop without privacy
(gradients accumulated over the same micro-batches) is the baseline: perplexity on
held-out text before and after, epsilon, time per logical step and the loop's peak
memory. Li et al. 2022 ("Large language models can be strong differentially
private learners") and Yu et al. 2022 (DP LoRA) describe this use.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data import ByteTokenizer, docstring_batch
from .real_models import causal_lm_loss, gpt2, with_lora


@dataclass
class FinetuneConfig:
    """The options of ``persample dp-finetune`` (see ``--help``)."""

    lora: bool = True  # LoRA adapters on the attention's c_attn (peft), else full fine-tuning
    rank: int = 8  # LoRA rank
    layers: int = 4
    width: int = 256
    heads: int = 4
    seq_len: int = 64
    train_windows: int = 3584  # sequences of seq_len tokens to fine-tune on
    test_windows: int = 256  # held-out sequences (the text after the training windows)
    pretrain_steps: int = 0  # non-private steps of batch 16 on the training text first
    steps: int = 10  # logical DP-SGD steps
    batch_size: int = 256  # expected logical batch (Poisson, q = batch_size / N)
    physical: int = 16  # micro-batch size
    sigma: float | None = None  # noise multiplier; None: the smallest for target_epsilon
    target_epsilon: float = 8.0
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    lr: float = 5e-4  # Adam
    seed: int = 0
    threads: int = 2
    json: str | None = None


def build_model(cfg: FinetuneConfig) -> tuple[nn.Module, int, int]:
    """The model (LoRA-wrapped if asked), its trainable and total parameter counts.

    Example:
        >>> cfg = FinetuneConfig(layers=1, width=32, heads=2, seq_len=16, rank=2)
        >>> model, trainable, total = build_model(cfg)
        >>> trainable < total
        True
    """
    torch.manual_seed(cfg.seed)
    model = gpt2(ByteTokenizer.vocab_size, seq_len=cfg.seq_len, layers=cfg.layers,
                 width=cfg.width, heads=cfg.heads)
    if cfg.lora:
        model = with_lora(model, cfg.rank)
    model.eval()  # no dropout: the per-sample gradients of a deterministic forward
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, trainable, total


def perplexity(model: nn.Module, inputs: dict[str, Tensor], labels: Tensor,
               batch: int = 64) -> float:
    """``exp`` of the mean next-token cross-entropy (nats per token) over ``labels``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(labels), batch):
            part = {k: v[start : start + batch] for k, v in inputs.items()}
            losses = causal_lm_loss(model(**part), labels[start : start + batch])  # (b,)
            total += losses.sum().item() * (labels.shape[1] - 1)
            count += len(losses) * (labels.shape[1] - 1)
    return math.exp(total / max(count, 1))


def _rss_mb(field_name: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return None


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux)
    except OSError:
        pass


def finetune(cfg: FinetuneConfig, private: bool, sigma: float,
             data: tuple[dict[str, Tensor], Tensor]) -> dict[str, Any]:
    """One fine-tuning run, private (``PrivateStep``) or not, from the same weights and
    the same Poisson-sampled logical batches; returns its figures."""
    from ..dp import PoissonBatchSampler, PrivacyAccountant, PrivateStep

    inputs, labels = data
    n = len(labels)
    model, trainable, total = build_model(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    test = {k: v[n - cfg.test_windows :] for k, v in inputs.items()}, labels[n - cfg.test_windows :]
    train_n = n - cfg.test_windows
    if cfg.pretrain_steps:
        _pretrain(model, inputs, labels, train_n, cfg)
    before = perplexity(model, *test)
    q = min(1.0, cfg.batch_size / train_n)
    sampler = PoissonBatchSampler(train_n, q, cfg.steps, torch.Generator().manual_seed(cfg.seed))
    opt = torch.optim.Adam(params, lr=cfg.lr)
    step = PrivateStep(model, causal_lm_loss, max_grad_norm=cfg.max_grad_norm,
                       noise_multiplier=sigma, expected_batch_size=q * train_n,
                       generator=torch.Generator().manual_seed(cfg.seed + 1)) if private else None
    accountant = PrivacyAccountant()
    times, rss_before = [], _rss_mb("VmRSS")
    _reset_peak()
    for logical in sampler:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for part in torch.tensor(logical, dtype=torch.long).split(cfg.physical):
            micro = {k: v[part] for k, v in inputs.items()}
            if step is not None:
                step.accumulate(micro, labels[part])
            else:  # the same sum of per-sample losses over the expected batch size
                (causal_lm_loss(model(**micro), labels[part]).sum() / (q * train_n)).backward()
        if step is not None:
            step.release()
            accountant.step(sigma, q)
        opt.step()
        times.append(time.perf_counter() - start)
    peak = _rss_mb("VmHWM")
    return {"name": "private" if private else "non-private", "trainable": trainable,
            "total": total, "perplexity_before": before, "perplexity_after": perplexity(
                model, *test), "epsilon": accountant.epsilon(cfg.delta) if private else None,
            "ms_per_step": statistics.median(times) * 1e3,
            "peak_mb": None if peak is None or rss_before is None else peak - rss_before,
            "steps": len(times)}


def _pretrain(model: nn.Module, inputs: dict[str, Tensor], labels: Tensor, train_n: int,
              cfg: FinetuneConfig) -> None:
    """A few non-private Adam steps of batch 16 on the training text (all parameters)."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    for _ in range(cfg.pretrain_steps):
        idx = torch.randint(0, train_n, (16,), generator=gen)
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model(**{k: v[idx] for k, v in inputs.items()}), labels[idx]).mean(
        ).backward()
        opt.step()
    for p, flag in zip(params, flags):
        p.requires_grad_(flag)
        p.grad = None


def run(cfg: FinetuneConfig) -> dict:
    """Fine-tune privately and without privacy from the same weights; print and return
    the figures (what ``--json`` writes).

    Raises:
        ValueError: a bad option.
        NotInstalled: transformers (or peft for LoRA) is missing.

    Example:
        >>> cfg = FinetuneConfig(layers=1, width=32, heads=2, seq_len=16, train_windows=64,
        ...                      test_windows=16, steps=2, batch_size=16, physical=8,
        ...                      sigma=1.0, rank=2, threads=1)
        >>> out = run(cfg)  # doctest: +ELLIPSIS
        dp-finetune: ...
        >>> [r["name"] for r in out["runs"]], out["runs"][0]["steps"]
        (['private', 'non-private'], 2)
    """
    from ..dp import noise_multiplier_for

    for name in ("layers", "width", "heads", "seq_len", "train_windows", "test_windows",
                 "steps", "batch_size", "physical", "max_grad_norm", "lr", "threads", "rank"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    if cfg.test_windows >= cfg.train_windows + cfg.test_windows:
        raise ValueError("test_windows must leave training windows")
    torch.set_num_threads(cfg.threads)
    data = docstring_batch(cfg.train_windows + cfg.test_windows, cfg.seq_len)
    q = min(1.0, cfg.batch_size / cfg.train_windows)
    sigma = cfg.sigma if cfg.sigma is not None else noise_multiplier_for(
        cfg.target_epsilon, cfg.delta, q, cfg.steps)
    runs = [finetune(cfg, True, sigma, data), finetune(cfg, False, sigma, data)]
    private, plain = runs
    what = f"LoRA r={cfg.rank} on c_attn" if cfg.lora else "full"
    print(f"dp-finetune: GPT-2 {cfg.layers}x{cfg.width} ({what}: {private['trainable']:,} of "
          f"{private['total']:,} parameters trained), T={cfg.seq_len}, "
          f"{cfg.train_windows} training / {cfg.test_windows} held-out windows of the standard "
          f"library's docstrings; {cfg.steps} steps, logical batch {cfg.batch_size} (q "
          f"{q:.4f}) in micro-batches of {cfg.physical}, sigma {sigma:.3f}, C "
          f"{cfg.max_grad_norm:g}")
    print(f"  {'run':<12}{'ppl before':>11}{'ppl after':>11}{'epsilon':>9}{'ms/step':>10}"
          f"{'peak MB':>9}")
    for r in runs:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        peak = "?" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        print(f"  {r['name']:<12}{r['perplexity_before']:>11.2f}{r['perplexity_after']:>11.2f}"
              f"{eps:>9}{r['ms_per_step']:>10.1f}{peak:>9}")
    ratio = private["ms_per_step"] / plain["ms_per_step"]
    print(f"  a DP step takes {ratio:.2f}x a non-private one (delta {cfg.delta:g})")
    result = {"config": asdict(cfg), "sigma": sigma, "sample_rate": q, "runs": runs,
              "time_ratio": ratio}
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {cfg.json}")
    return result


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``dp-finetune`` subcommand's options."""
    d = FinetuneConfig()
    p = subparsers.add_parser(
        "dp-finetune", help="fine-tune a small GPT-2 with DP-SGD on the standard library's "
        "docstrings, with LoRA or fully, against the same loop without privacy",
        description=__doc__)
    p.add_argument("--full", dest="lora", action="store_false",
                   help="fine-tune every parameter (default: LoRA adapters)")
    for name in ("rank", "layers", "width", "heads", "seq_len", "train_windows",
                 "test_windows", "pretrain_steps", "steps", "batch_size", "physical",
                 "seed", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                       help=f"default {getattr(d, name)}")
    for name in ("sigma", "target_epsilon", "delta", "max_grad_norm", "lr"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name),
                       help=f"default {getattr(d, name)}")
    p.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    return p


def run_from_args(args: argparse.Namespace) -> dict:
    """Run ``dp-finetune`` with the parsed options."""
    cfg = FinetuneConfig(**{k: getattr(args, k) for k in asdict(FinetuneConfig())})
    try:
        return run(cfg)
    except ValueError as err:
        raise SystemExit(f"persample dp-finetune: error: {err}") from err
