"""``persample dp-finetune``: a small GPT-2 fine-tuned with DP-SGD on real text.

A transformers GPT-2 (random weights, optionally trained briefly without privacy
first) is fine-tuned on the docstrings of Python's standard library, tokenised as
bytes (:func:`persample.cli.data.docstring_batch`), fully or with LoRA adapters
(``peft``), with DP-SGD over Poisson-sampled logical batches split into physical
micro-batches (:class:`persample.dp.PrivateStep`). The same loop without privacy
(gradients accumulated over the same micro-batches) is the baseline: perplexity on
held-out text before and after, epsilon, time per logical step and the loop's peak
memory. Li et al. 2022 ("Large language models can be strong differentially
private learners") and Yu et al. 2022 (DP LoRA) describe this use.

With ``--nproc N --fsdp`` the private run is sharded over ``N`` processes (gloo): the
model is sharded with FSDP2's ``fully_shard`` per GPT-2 block and at the root, each
process accumulates its share of every logical batch, and the table shows its
perplexity and epsilon beside the same run in one process, with each process's peak
memory.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ._rss import reset_peak_rss, status_kib
from .data import ByteTokenizer, docstring_batch
from .dp_options import add_dp_arguments, check_dp_options, clipping_label, clipping_of
from .plain import PlainHelp
from .real_models import causal_lm_loss, gpt2, with_lora
from .threads import add_threads_argument, default_threads, threads_label

if TYPE_CHECKING:
    from ..dp.mechanisms import Mechanism


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
    clipping: str = "flat"  # flat, per-layer, per-module (groups) or automatic
    automatic_gamma: float = 0.01
    target_unclipped_quantile: float = 0.5  # --clipping adaptive (Andrew et al. 2021)
    unclipped_num_std: float | None = None  # its count's noise; None: expected batch / 20
    clipbound_learning_rate: float = 0.2
    users: int | None = None  # user-level DP: the training windows in this many users' runs
    records_per_user: int | None = None  # at most this many of a user's windows a step
    mechanism: str = "dpsgd"  # or "bandmf", "blt": correlated noise (cyclic sampling)
    bands: int = 4  # BandMF's bands (the sampling's groups)
    buffers: int = 3  # BLT's buffers
    secure_mode: bool = False  # the noise from the OS's secure generator, not the seed
    lr: float = 5e-4  # Adam
    seed: int = 0
    threads: int = field(default_factory=default_threads)  # the machine's free CPUs
    nproc: int = 1  # processes of the private run (gloo); each gets threads // nproc
    fsdp: bool = False  # shard the private run's model with FSDP2 over the processes
    json: str | None = None


def build_model(cfg: FinetuneConfig) -> tuple[nn.Module, int, int]:
    """The model (LoRA-wrapped if asked), its trainable and total parameter counts.

    Examples:
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
    kib = status_kib(field_name)
    return None if kib is None else kib / 1e3


def finetune(cfg: FinetuneConfig, private: bool, sigma: float,
             data: tuple[dict[str, Tensor], Tensor], world: tuple[int, int] = (1, 0)
             ) -> dict[str, Any]:
    """One fine-tuning run, private (``PrivateStep``) or not, from the same weights and
    the same Poisson-sampled logical batches; returns its figures. ``world``: ``(size,
    rank)`` of this process among those of a distributed private run (sharded with FSDP2
    if ``cfg.fsdp``), which takes its share of every logical batch."""
    from ..dp import PrivacyAccountant, PrivateStep
    from ..dp.mechanisms import release_runs
    from ..dp.setup import shared_seeds

    inputs, labels = data
    n = len(labels)
    model, trainable, total = build_model(cfg)
    if cfg.fsdp and world[0] > 1:
        from torch.distributed.fsdp import fully_shard

        for block in [m for m in model.modules() if type(m).__name__ == "GPT2Block"]:
            fully_shard(block)
        fully_shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    test = {k: v[n - cfg.test_windows :] for k, v in inputs.items()}, labels[n - cfg.test_windows :]
    train_n = n - cfg.test_windows
    if cfg.pretrain_steps:
        _pretrain(model, inputs, labels, train_n, cfg)
    before = perplexity(model, *test)
    q, expected = sample_rate(cfg), sample_rate(cfg) * (cfg.users or train_n)  # records or users
    user_of = window_users(cfg)  # (train_n,) or None
    seeds = shared_seeds(cfg.seed)  # rank 0's on every process
    mechanism = mechanism_of(cfg, q)
    sampler = _sampler(cfg, q, user_of, seeds.sampling_generator(), mechanism)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    noise_gen = None if cfg.secure_mode else seeds.noise_generator()
    step = PrivateStep(model, causal_lm_loss, noise_multiplier=sigma,
                       expected_batch_size=expected, generator=noise_gen,
                       secure_mode=cfg.secure_mode,
                       clipping=clipping_of(model, cfg, expected), mechanism=mechanism
                       ) if private else None
    accountant = PrivacyAccountant()
    reset_peak_rss()  # (the memory earlier runs freed given back first)
    times, rss_before = [], _rss_mb("VmRSS")
    for logical in sampler:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for records in _micro_batches(logical, cfg.physical, world, user_of):
            part = torch.tensor(records, dtype=torch.int64)  # (b,)
            micro = {k: v[part] for k, v in inputs.items()}
            if step is not None:
                step.accumulate(micro, labels[part], None if user_of is None else user_of[part])
            else:  # the same sum of per-sample losses over the expected batch size
                (causal_lm_loss(model(**micro), labels[part]).sum() / expected).backward()
        if step is not None:
            step.release()
            for s, r in release_runs(mechanism, sigma, q, len(times)):
                accountant.step(s, r)  # (a mechanism: its share of the run's privacy)
        opt.step()
        times.append(time.perf_counter() - start)
    peak = _rss_mb("VmHWM")
    return {"name": "private" if private else "non-private", "trainable": trainable,
            "total": total, "perplexity_before": before, "perplexity_after": perplexity(
                model, *test), "epsilon": accountant.epsilon(cfg.delta) if private else None,
            "ms_per_step": statistics.median(times) * 1e3,
            "peak_mb": None if peak is None or rss_before is None else peak - rss_before,
            "steps": len(times)}


def sample_rate(cfg: FinetuneConfig) -> float:
    """``q``: the expected logical batch over the training windows, or with ``cfg.users``
    over the users."""
    return min(1.0, cfg.batch_size / (cfg.users or cfg.train_windows))


def window_users(cfg: FinetuneConfig) -> Tensor | None:
    """User-level DP: ``(train_windows,)`` each training window's user, the text dealt
    to ``cfg.users`` users in runs of consecutive windows (as a user writes a run of
    documents), as even as can be; ``None`` without ``cfg.users``.

    Examples:
        >>> window_users(FinetuneConfig(train_windows=7, users=3)).tolist()
        [0, 0, 0, 1, 1, 2, 2]
    """
    if cfg.users is None:
        return None
    return torch.arange(cfg.train_windows) * cfg.users // cfg.train_windows


def mechanism_of(cfg: FinetuneConfig, q: float) -> Mechanism | None:
    """BandMF or BLT made for ``cfg.steps`` at sampling rate ``q`` (the prefix workload:
    Adam's updates are not a linear workload), or ``None`` for DP-SGD.

    Raises:
        ValueError: ``cycle_length * q > 1`` (:func:`persample.dp.mechanisms.resolve_mechanism`).
    """
    from ..dp.mechanisms import resolve_mechanism

    if cfg.mechanism == "dpsgd":
        return None
    return resolve_mechanism(cfg.mechanism, cfg.steps, q,
                             bands=cfg.bands if cfg.mechanism == "bandmf" else None,
                             buffers=cfg.buffers if cfg.mechanism == "blt" else None)


def _sampler(cfg: FinetuneConfig, q: float, user_of: Tensor | None, gen: torch.Generator,
             mechanism: Mechanism | None = None):
    """The logical batches: Poisson over the windows, or over the users (whole users, at
    most ``cfg.records_per_user`` windows each), or with a mechanism cyclic Poisson
    sampling over its ``cycle_length`` groups; the same on every process (``gen``
    seeded alike)."""
    from ..dp.sampling import logical_sampler

    return logical_sampler(cfg.train_windows, q, cfg.steps, gen, user_of=user_of,
                           records_per_user=cfg.records_per_user,
                           cycle_length=None if mechanism is None else mechanism.cycle_length)


def _micro_batches(logical: list[int], physical: int, world: tuple[int, int],
                   user_of: Tensor | None) -> list[list[int]]:
    """This process's micro-batches of a logical batch, as many as every process's (each
    runs the same collectives): its share of the windows in near-equal ones of at most
    ``physical`` (at least one); with ``user_of``, its whole users filled in order
    (:mod:`persample.dp.setup`).

    Examples:
        >>> users = torch.tensor([0, 0, 1, 1, 2, 3, 3])
        >>> _micro_batches([0, 1, 2, 3, 4, 5, 6], 3, (2, 1), users)
        [[2, 3], [5, 6]]
        >>> _micro_batches([0, 1, 2, 3, 4, 5, 6], 2, (2, 0), None)
        [[0, 2], [4, 6]]
    """
    from ..dp.setup import even_parts, physical_batches

    size, rank = world
    if user_of is not None:
        return physical_batches(logical, physical, user_of=user_of, rank=rank,
                                world_size=size)
    return physical_batches(logical, parts=even_parts(len(logical), physical, size),
                            rank=rank, world_size=size)


def _spawned(cfg: FinetuneConfig, sigma: float) -> list[dict[str, Any]]:
    """The private run in ``cfg.nproc`` processes (gloo, a rendezvous file in a
    temporary folder): every process's figures."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.start_processes(_rank_main, args=(cfg, sigma, folder, init), nprocs=cfg.nproc,
                           join=True, start_method="spawn")
        found = []
        for rank in range(cfg.nproc):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                found.append(json.load(f))
        return found


def _rank_main(rank: int, cfg: FinetuneConfig, sigma: float, folder: str, init: str) -> None:
    """One process of :func:`_spawned`: its share of the threads and of every batch."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cfg.nproc,
                            timeout=timedelta(minutes=10))
    try:
        torch.set_num_threads(max(1, cfg.threads // cfg.nproc))
        data = docstring_batch(cfg.train_windows + cfg.test_windows, cfg.seq_len)
        result = finetune(cfg, True, sigma, data, (cfg.nproc, rank))
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


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


def _check_users(cfg: FinetuneConfig) -> None:
    """User-level DP's limits: no more users than windows, and a user's windows in a
    step must fit one micro-batch (they are clipped together)."""
    if cfg.users is None:
        return
    if cfg.users > cfg.train_windows:
        raise ValueError(f"users ({cfg.users}) must be at most train_windows "
                         f"({cfg.train_windows}): each user owns at least one window")
    most = -(-cfg.train_windows // cfg.users)  # the most windows a user owns
    most = most if cfg.records_per_user is None else min(most, cfg.records_per_user)
    if most > cfg.physical:
        raise ValueError(f"physical ({cfg.physical}) must hold a user's {most} windows of a "
                         "step, which are clipped together: raise --physical or cap them "
                         "with --records-per-user")


def run(cfg: FinetuneConfig) -> dict:
    """Fine-tune privately and without privacy from the same weights; print and return
    the figures (what ``--json`` writes).

    Raises:
        ValueError: a bad option.
        NotInstalled: transformers (or peft for LoRA) is missing.

    Examples:
        >>> cfg = FinetuneConfig(layers=1, width=32, heads=2, seq_len=16, train_windows=64,
        ...                      test_windows=16, steps=2, batch_size=16, physical=8,
        ...                      sigma=1.0, rank=2, threads=1)
        >>> out = run(cfg)  # doctest: +ELLIPSIS
        dp-finetune: ...
        >>> [r["name"] for r in out["runs"]], out["runs"][0]["steps"]
        (['private', 'non-private'], 2)
    """
    from ..dp import noise_multiplier_for
    from ..dp.mechanisms import accounted_runs

    for name in ("layers", "width", "heads", "seq_len", "train_windows", "test_windows",
                 "steps", "batch_size", "physical", "max_grad_norm", "lr", "threads", "rank",
                 "nproc"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    check_dp_options(cfg)
    _check_users(cfg)
    torch.set_num_threads(cfg.threads)
    data = docstring_batch(cfg.train_windows + cfg.test_windows, cfg.seq_len)
    q = sample_rate(cfg)
    _check_mechanism(cfg)
    (_, rate, count), = accounted_runs(mechanism_of(cfg, q), 0.0, q, cfg.steps)
    sigma = cfg.sigma if cfg.sigma is not None else noise_multiplier_for(
        cfg.target_epsilon, cfg.delta, rate, count)
    if cfg.fsdp and cfg.nproc < 2:
        raise ValueError("--fsdp shards the model over processes: give --nproc 2 or more")
    runs = [finetune(cfg, True, sigma, data), finetune(cfg, False, sigma, data)]
    private, plain = runs
    if cfg.nproc > 1:
        ranks = _spawned(cfg, sigma)
        how = "FSDP2" if cfg.fsdp else "whole model"
        runs.insert(0, {**ranks[0], "name": f"private x{cfg.nproc}",
                        "peak_mb_per_rank": [r["peak_mb"] for r in ranks],
                        "sharding": how})
    what = f"LoRA r={cfg.rank} on c_attn" if cfg.lora else "full"
    print(f"dp-finetune: GPT-2 {cfg.layers}x{cfg.width} ({what}: {private['trainable']:,} of "
          f"{private['total']:,} parameters trained), T={cfg.seq_len}, "
          f"{cfg.train_windows} training / {cfg.test_windows} held-out windows of the standard "
          f"library's docstrings; {cfg.steps} steps, logical batch {cfg.batch_size}"
          f"{'' if cfg.users is None else ' users'} (q "
          f"{q:.4f}{_users_label(cfg)}) in micro-batches of {cfg.physical}, sigma "
          f"{sigma:.3f}{' (secure noise)' if cfg.secure_mode else ''}"
          f"{_mechanism_label(cfg)}, "
          f"{clipping_label(cfg)}; {threads_label(cfg.threads)}")
    print(f"  {'run':<12}{'ppl before':>11}{'ppl after':>11}{'epsilon':>9}{'ms/step':>10}"
          f"{'peak MB':>9}")
    for r in runs:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        peak = "?" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        print(f"  {r['name']:<12}{r['perplexity_before']:>11.2f}{r['perplexity_after']:>11.2f}"
              f"{eps:>9}{r['ms_per_step']:>10.1f}{peak:>9}")
    ratio = private["ms_per_step"] / plain["ms_per_step"]
    print(f"  a DP step takes {ratio:.2f}x a non-private one (delta {cfg.delta:g})")
    if cfg.nproc > 1:
        per_rank = ", ".join("?" if m is None else f"{m:.0f}" for m in runs[0]["peak_mb_per_rank"])
        print(f"  private x{cfg.nproc}: {cfg.nproc} gloo processes ({runs[0]['sharding']}), "
              f"peak MB per process: {per_rank}; one process: {private['peak_mb']:.0f}")
    result = {"config": asdict(cfg), "sigma": sigma, "sample_rate": q, "runs": runs,
              "time_ratio": ratio, "unit": "window" if cfg.users is None else "user"}
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {cfg.json}")
    return result


def _check_mechanism(cfg: FinetuneConfig) -> None:
    if cfg.mechanism not in ("dpsgd", "bandmf", "blt"):
        raise ValueError(f"mechanism must be dpsgd, bandmf or blt, got {cfg.mechanism!r}")
    if cfg.mechanism == "dpsgd":
        return
    if cfg.clipping == "adaptive":
        raise ValueError(f"--mechanism {cfg.mechanism} takes a fixed clipping norm: not "
                         f"with --clipping adaptive")
    if not 1 <= cfg.bands <= cfg.steps:
        raise ValueError(f"--bands must be in [1, steps], got {cfg.bands}")


def _mechanism_label(cfg: FinetuneConfig) -> str:
    if cfg.mechanism == "bandmf":
        return f", BandMF ({cfg.bands} bands)"
    return f", BLT ({cfg.buffers} buffers)" if cfg.mechanism == "blt" else ""


def _users_label(cfg: FinetuneConfig) -> str:
    if cfg.users is None:
        return ""
    cap = "" if cfg.records_per_user is None else f", at most {cfg.records_per_user} each"
    return f" over {cfg.users} users: user-level DP{cap}"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``dp-finetune`` subcommand's options."""
    d = FinetuneConfig()
    p = subparsers.add_parser(
        "dp-finetune", help="fine-tune a small GPT-2 with DP-SGD on the standard library's "
        "docstrings, with LoRA or fully, against the same loop without privacy",
        description=__doc__)
    p.formatter_class = PlainHelp  # (the docstring's markup as text)
    p.add_argument("--full", dest="lora", action="store_false",
                   help="fine-tune every parameter (default: LoRA adapters)")
    for name in ("rank", "layers", "width", "heads", "seq_len", "train_windows",
                 "test_windows", "pretrain_steps", "steps", "batch_size", "physical",
                 "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                       help=f"default {getattr(d, name)}")
    add_threads_argument(p)
    for name in ("sigma", "target_epsilon", "delta", "max_grad_norm", "lr"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name),
                       help=f"default {getattr(d, name)}")
    add_dp_arguments(p, d, "windows", "runs of consecutive windows")
    p.add_argument("--mechanism", choices=("dpsgd", "bandmf", "blt"), default=d.mechanism,
                   help="DP-SGD's independent noise (default), BandMF's correlated noise "
                   "(Choquette-Choo et al. 2023; cyclic Poisson sampling) or BLT's "
                   "(McMahan et al. 2024; fixed batches)")
    p.add_argument("--bands", type=int, default=d.bands,
                   help=f"BandMF's bands, at most 1 / q (default {d.bands})")
    p.add_argument("--buffers", type=int, default=d.buffers,
                   help=f"BLT's buffers: parameter-sized states (default {d.buffers})")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="also run the private fine-tuning in this many processes (gloo), "
                   f"each on its share of every logical batch (default {d.nproc})")
    p.add_argument("--fsdp", action="store_true",
                   help="with --nproc: shard that run's model with FSDP2 (fully_shard per "
                   "GPT-2 block and at the root)")
    p.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    return p


def run_from_args(args: argparse.Namespace) -> dict:
    """Run ``dp-finetune`` with the parsed options."""
    cfg = FinetuneConfig(**{k: getattr(args, k) for k in asdict(FinetuneConfig())})
    try:
        return run(cfg)
    except ValueError as err:
        raise SystemExit(f"persample dp-finetune: error: {err}") from err
