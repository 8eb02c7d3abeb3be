"""``persample dp-train``: DP-SGD on a SimpleCNN and scikit-learn's digits.

DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy"): each
step Poisson-samples a batch (each training example with probability
``q = batch_size / N``), clips every sample's gradient to norm ``C``, sums, adds
``N(0, sigma^2 C^2 I)`` and divides by the expected batch size; here
``persample.dp.private_grad`` does that from one forward and one backward
(book-keeping, Bu et al. 2023), and any ``torch.optim`` optimizer steps on the
``p.grad`` it writes. The privacy spent is counted by
``persample.dp.accounting.PrivacyAccountant`` (Google's ``dp-accounting``).

Data: the 1,797 digits as 1x28x28 images (``persample.cli.data.digits_images``), a
fixed stratified 80/20 split (1,437 train, 360 test; ``random_state=0``, the
same whatever ``--seed``). ``--compare-nonprivate`` trains the same model from
the same initial weights on the same kind of batches, without clipping or noise
(and with its own learning rate, ``--nonprivate-lr``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dp_options import add_dp_arguments, check_dp_options, clipping_label, clipping_of
from .plain import PlainHelp
from .threads import add_threads_argument, default_threads, threads_label

if TYPE_CHECKING:  # dp_accounting (scipy) takes ~1.5 s to import: only when training
    from ..dp.accounting import PrivacyAccountant
    from ..dp.mechanisms import Mechanism
    from ..dp.setup import Seeds

EPS_EVERY = 10  # steps between epsilon updates in the progress bar (RDP costs ~50 ms)


def simple_cnn() -> nn.Sequential:
    """The SimpleCNN of torch.func's "Per-sample-gradients" tutorial (conv 1->32 k3,
    conv 32->64 k3, maxpool 2, fc 9216->128->10): the model ``dp-train`` and ``audit``
    train, and the benchmark's CNN workloads.

    Takes ``(B, 1, 28, 28)``, returns logits ``(B, 10)``; 1,199,882 parameters.

    Examples:
        >>> simple_cnn()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, 32, 3, 1),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(32, 64, 3, 1),
            relu2=nn.ReLU(),
            pool=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
            fc1=nn.Linear(9216, 128),
            relu3=nn.ReLU(),
            fc2=nn.Linear(128, 10),
        )
    )


@dataclass
class DPTrainConfig:
    """Everything ``dp-train`` needs; the defaults are the command line's."""

    epochs: int = 15
    batch_size: int = 256  # expected batch size; q = batch_size / N
    sigma: float | None = None  # noise multiplier; None: the smallest meeting target_epsilon
    target_epsilon: float = 3.0  # epsilon budget at delta, used when sigma is None
    max_grad_norm: float = 1.0  # C
    delta: float = 1e-5
    lr: float = 0.05
    nonprivate_lr: float = 0.02  # the baseline's gradients are not clipped: larger
    momentum: float = 0.9
    seed: int = 0
    accountant: str = "rdp"
    secure_mode: bool = False  # the noise from the OS's secure generator, not the seed
    clipping: str = "flat"  # flat, per-layer, per-module (groups) or automatic
    automatic_gamma: float = 0.01
    target_unclipped_quantile: float = 0.5  # --clipping adaptive (Andrew et al. 2021)
    unclipped_num_std: float | None = None  # its count's noise; None: expected batch / 20
    clipbound_learning_rate: float = 0.2
    users: int | None = None  # user-level DP: the training records dealt to this many users
    records_per_user: int | None = None  # at most this many of a user's records a step
    mechanism: str = "dpsgd"  # or "bandmf", "blt": correlated noise (cyclic sampling)
    bands: int = 4  # BandMF's bands (the sampling's groups)
    buffers: int = 3  # BLT's buffers
    compare_nonprivate: bool = False
    subset: int | None = None  # train on the first SUBSET training examples only
    max_steps: int | None = None  # cap on steps per epoch (tests)
    threads: int = field(default_factory=default_threads)  # in all; the machine's free CPUs
    nproc: int = 1  # processes (torch.distributed, gloo); each gets threads // nproc
    plot: str | None = None
    json: str | None = None
    progress: bool = True


@dataclass
class Run:
    """One training run's figures, per epoch and final."""

    name: str  # "private" or "non-private"
    train_loss: list[float] = field(default_factory=list)  # mean over the epoch's batches
    train_accuracy: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)  # after each epoch
    epsilon: list[float] = field(default_factory=list)  # spent after each epoch (private)
    epoch_seconds: list[float] = field(default_factory=list)  # training steps only
    steps: int = 0
    empty_batches: int = 0

    @property
    def seconds_per_epoch(self) -> float:
        return sum(self.epoch_seconds) / max(len(self.epoch_seconds), 1)


def load_split(subset: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The digits' fixed stratified 80/20 split: ``x_train (N, 1, 28, 28)``, ``y_train (N,)``,
    ``x_test (360, 1, 28, 28)``, ``y_test (360,)``; float32 images, int64 labels.

    Args:
        subset: keep only the first ``subset`` training examples (the split is
            shuffled, so they are a random subset); the test set stays whole.

    Examples:
        >>> x, y, xt, yt = load_split()
        >>> x.shape, xt.shape, y.dtype
        (torch.Size([1437, 1, 28, 28]), torch.Size([360, 1, 28, 28]), torch.int64)
    """
    from sklearn.model_selection import train_test_split

    from .data import digits_images

    x, y = digits_images(dtype=torch.float32)
    train, test = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2,
                                   stratify=y.numpy(), random_state=0)
    train = torch.as_tensor(train)[:subset]
    test = torch.as_tensor(test)
    return x[train], y[train], x[test], y[test]


def resolve_sigma(cfg: DPTrainConfig, sample_rate: float, steps: int,
                  mechanism: Mechanism | None = None) -> float:
    """``cfg.sigma``, or the smallest sigma meeting ``cfg.target_epsilon`` after ``steps``
    (with a mechanism: over its amplified runs)."""
    from ..dp.accounting import noise_multiplier_for
    from ..dp.mechanisms import accounted_runs

    if cfg.sigma is not None:
        return cfg.sigma
    (_, rate, count), = accounted_runs(mechanism, 0.0, sample_rate, steps)
    return noise_multiplier_for(cfg.target_epsilon, cfg.delta, rate, count,
                                accountant=cfg.accountant, tol=1e-3)


def mechanism_of(cfg: DPTrainConfig, steps: int, q: float) -> Mechanism | None:
    """BandMF or BLT for the run's ``steps`` at sampling rate ``q`` (optimised for SGD
    with ``cfg.momentum``), or ``None`` for DP-SGD.

    Raises:
        ValueError: ``cycle_length * q > 1`` (:func:`persample.dp.mechanisms.resolve_mechanism`).
    """
    from ..dp.mechanisms import resolve_mechanism

    if cfg.mechanism == "dpsgd":
        return None
    workload = "momentum" if cfg.momentum > 0 else "prefix"
    return resolve_mechanism(
        cfg.mechanism, steps, q, bands=cfg.bands if cfg.mechanism == "bandmf" else None,
        buffers=cfg.buffers if cfg.mechanism == "blt" else None, workload=workload,
        momentum=cfg.momentum or 0.9)


class _LossRecorder:
    """Per-sample cross-entropy ``(B,)`` that remembers its first batch's logits and losses.

    ``private_grad`` calls the loss inside its own forward; recording there gives
    the training loss and accuracy without a second forward.
    """

    def __init__(self) -> None:
        self.seen: tuple[Tensor, Tensor] | None = None  # (logits (B, 10), losses (B,))

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        losses = F.cross_entropy(logits, targets, reduction="none")  # (B,)
        if self.seen is None:
            self.seen = logits.detach(), losses.detach()
        return losses


class _Tally:
    """Running training loss and accuracy over an epoch's batches (as seen by the loss)."""

    def __init__(self) -> None:
        self.loss_sum, self.correct, self.seen = 0.0, 0, 0

    def add(self, seen: tuple[Tensor, Tensor] | None, targets: Tensor) -> None:
        if seen is not None and len(targets):
            logits, losses = seen  # (b, 10), (b,)
            self.loss_sum += losses.sum().item()
            self.correct += (logits.argmax(1) == targets).sum().item()
            self.seen += len(targets)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.seen, 1)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.seen, 1)

    def postfix(self) -> dict[str, str]:
        return {"train loss": f"{self.loss:.3f}", "train acc": f"{self.accuracy:.3f}"}


def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 512) -> float:
    """Accuracy of ``model`` on ``x (N, ...)``, ``y (N,)``, in ``[0, 1]``, without autograd."""
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), batch):
            logits = model(x[start : start + batch])  # (b, 10)
            correct += (logits.argmax(1) == y[start : start + batch]).sum().item()
    model.train(was_training)
    return correct / max(len(y), 1)


def train(
    model: nn.Module,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    cfg: DPTrainConfig,
    sigma: float | None,
    accountant: PrivacyAccountant | None = None,
    *,
    seeds: Seeds,
    mechanism: Mechanism | None = None,
) -> Run:
    """Train ``model`` in place for ``cfg.epochs`` epochs; DP-SGD when ``sigma`` is given.

    Both runs sample batches the same way (Poisson, rate ``q``, from ``seeds.sampling``,
    :func:`persample.dp.setup.shared_seeds` of ``cfg.seed``) and scale the gradient by
    the expected batch size, so they differ only in the clipping, the noise (from
    ``seeds.noise``) and the learning rate (``cfg.lr`` or ``cfg.nonprivate_lr``).
    ``accountant`` (private only) records every step, empty batches included. With
    several processes the private run takes this rank's share of each logical batch
    (:func:`persample.dp.setup.share`). With a ``mechanism`` (BandMF, BLT) both runs
    sample cyclically (one split for the whole run), the private one's noise is
    correlated and each step accounted as the mechanism has it
    (:func:`persample.dp.mechanisms.release_runs`).
    """
    from tqdm import tqdm  # the cli extra: imported here, so --help works without it

    from ..dp import PrivateStep
    from ..dp.mechanisms import release_runs
    from ..dp.reduce import world
    from ..dp.setup import share

    x, y, x_test, y_test = data
    n = len(y)
    q = sample_rate(cfg, n)
    expected = q * (n if cfg.users is None else cfg.users)  # records, or users
    steps = min(round(1 / q), cfg.max_steps or math.inf)
    user_of = None if cfg.users is None else synthetic_users(n, cfg.users)  # (n,) or None
    batch_gen = seeds.sampling_generator()
    noise_gen = None if cfg.secure_mode else seeds.noise_generator()
    lr = cfg.lr if sigma is not None else cfg.nonprivate_lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum)
    loss_fn = _LossRecorder()
    size, rank = world() or (1, 0)
    step = None if sigma is None else PrivateStep(
        model, loss_fn, noise_multiplier=sigma, expected_batch_size=expected,
        generator=noise_gen, secure_mode=cfg.secure_mode,
        clipping=clipping_of(model, cfg, expected), mechanism=mechanism)
    sampler = _sampler(n, cfg, q, steps, batch_gen, user_of, mechanism)
    run = Run("private" if sigma is not None else "non-private")
    model.train()
    eps = 0.0  # spent so far, refreshed every EPS_EVERY steps
    for epoch in range(cfg.epochs):
        bar = tqdm(sampler, total=steps,
                   desc=f"{run.name} epoch {epoch + 1}/{cfg.epochs}", disable=not cfg.progress,
                   leave=True, dynamic_ncols=True)
        tally, accounting_s = _Tally(), 0.0
        start = time.perf_counter()
        for k, drawn in enumerate(bar):  # the logical batch's record indices
            loss_fn.seen = None
            if step is not None:  # this rank's share of the one Poisson sample
                drawn = share(drawn, rank, size, user_of)
            index = torch.tensor(drawn, dtype=torch.int64)  # (b,)
            xb, yb = x[index], y[index]  # (b, 1, 28, 28), (b,)
            ub = None if user_of is None else user_of[index]  # users (b,) or None
            if step is not None:
                step.accumulate(xb, yb, ub)
                step.release()  # with several processes: summed over all, noised once
            else:
                optimizer.zero_grad(set_to_none=True)
                (loss_fn(model(xb), yb).sum() / expected).backward()
            optimizer.step()
            run.steps += 1
            run.empty_batches += len(yb) == 0
            tally.add(loss_fn.seen, yb)
            postfix = tally.postfix()
            if accountant is not None:
                for s, r in release_runs(mechanism, sigma, q, run.steps - 1):
                    accountant.step(s, r)
                if k == 0 or (k + 1) % EPS_EVERY == 0 or k + 1 == steps:  # from the first
                    t = time.perf_counter()
                    eps = accountant.epsilon(cfg.delta)
                    accounting_s += time.perf_counter() - t
                postfix["eps"] = f"{eps:.2f}"
            bar.set_postfix(postfix, refresh=False)
        run.epoch_seconds.append(time.perf_counter() - start - accounting_s)
        bar.close()
        run.train_loss.append(tally.loss)
        run.train_accuracy.append(tally.accuracy)
        run.test_accuracy.append(evaluate(model, x_test, y_test))
        if accountant is not None:
            run.epsilon.append(eps)
    return run


def sample_rate(cfg: DPTrainConfig, n: int) -> float:
    """``q``: the expected batch over the ``n`` records, or with ``cfg.users`` over the
    users."""
    return min(1.0, cfg.batch_size / (n if cfg.users is None else cfg.users))


def synthetic_users(n: int, users: int) -> Tensor:
    """``(n,)`` each training record's user: the records dealt at random (a fixed seed)
    to ``users`` users, as many each as can be (user-level DP on a dataset without
    users)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    out = torch.empty(n, dtype=torch.int64)
    out[order] = torch.arange(n) % users
    return out


def _sampler(n: int, cfg: DPTrainConfig, q: float, steps: int, gen: torch.Generator,
             user_of: Tensor | None, mechanism: Mechanism | None):
    """The run's sampler of logical batches of the ``n`` records (each iteration an
    epoch's, lists of indices): Poisson-sampled records, or with ``user_of`` whole users
    (at most ``cfg.records_per_user`` records each), or with a mechanism cyclic Poisson
    sampling over its ``cycle_length`` groups."""
    from ..dp.sampling import logical_sampler

    return logical_sampler(n, q, steps, gen, user_of=user_of,
                           records_per_user=cfg.records_per_user,
                           cycle_length=None if mechanism is None else mechanism.cycle_length)


def run(cfg: DPTrainConfig) -> dict:
    """Train privately (and, with ``compare_nonprivate``, without DP); print, plot, save.

    Args:
        cfg: the options; see :class:`DPTrainConfig` and ``persample dp-train --help``.

    Returns:
        all figures as a dict (what ``--json`` writes): ``config``, ``data``,
        ``privacy`` (``sigma``, ``sample_rate``, ``steps``, ``epsilon`` at ``delta``
        by ``cfg.accountant``, and ``epsilon_pld`` or ``epsilon_rdp`` by the other
        one, ``None`` when that is PLD and epsilon is over 100: too slow), ``runs``
        (per run: per-epoch ``train_loss``, ``train_accuracy``, ``test_accuracy``,
        ``epsilon``, ``epoch_seconds``, and ``final_test_accuracy``,
        ``seconds_per_epoch``) and ``machine``.

    Raises:
        ValueError: a bad option (non-positive epochs, batch size, C, lr or target
            epsilon; a negative sigma; delta outside ``(0, 1)``).

    Examples:
        >>> cfg = DPTrainConfig(epochs=1, batch_size=16, subset=64, max_steps=2, sigma=2.0,
        ...                     threads=1, progress=False)
        >>> out = run(cfg)  # doctest: +ELLIPSIS
        dp-train: ...
        >>> out["privacy"]["steps"], 0 < out["privacy"]["epsilon"] < 100
        (2, True)
    """
    from ..dp.accounting import PrivacyAccountant
    from ..dp.reduce import world
    from ..dp.setup import shared_seeds

    _check(cfg)
    if cfg.nproc > 1 and world() is None:
        return _spawn(cfg)
    seeds = shared_seeds(cfg.seed)  # rank 0's on every process
    torch.set_num_threads(cfg.threads)
    data = load_split(cfg.subset)
    n = len(data[1])
    q = sample_rate(cfg, n)
    steps_per_epoch = min(round(1 / q), cfg.max_steps or math.inf)
    total_steps = cfg.epochs * steps_per_epoch
    mechanism = mechanism_of(cfg, total_steps, q)
    sigma = resolve_sigma(cfg, q, total_steps, mechanism)
    procs = f", {cfg.nproc} processes of" if cfg.nproc > 1 else ","
    units = n if cfg.users is None else cfg.users
    unit = "" if cfg.users is None else f" users (user-level DP, {cfg.users} users)"
    print(f"dp-train: SimpleCNN on digits 1x28x28, {n} train / {len(data[3])} test; "
          f"{_label(mechanism)} with sigma {sigma:.3f}, {clipping_label(cfg)}, expected batch "
          f"{q * units:.0f}{unit} (q {q:.4f}), {steps_per_epoch} steps/epoch, delta "
          f"{cfg.delta:g}{procs} {threads_label(cfg.threads)}")
    torch.manual_seed(cfg.seed)
    model = simple_cnn().to(torch.float32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    accountant = PrivacyAccountant(cfg.accountant)
    runs = [train(model, data, cfg, sigma, accountant, seeds=seeds, mechanism=mechanism)]
    if cfg.compare_nonprivate:
        model.load_state_dict(initial)
        runs.append(train(model, data, cfg, None, seeds=seeds, mechanism=mechanism))
    eps = accountant.epsilon(cfg.delta)
    other = "pld" if cfg.accountant == "rdp" else "rdp"
    # PLD's cost grows with epsilon (minutes, or out of memory, for sigma << 0.5): skip it there
    eps_other = accountant.epsilon(cfg.delta, other) if other == "rdp" or eps <= 100 else None
    result = {
        "config": asdict(cfg),
        "data": {"train": n, "test": len(data[3]), "image": [1, 28, 28], "split_seed": 0},
        "privacy": {"mechanism": _label(mechanism),
                    "bands": getattr(mechanism, "bands", 1),
                    "cycle_length": getattr(mechanism, "cycle_length", 1), "sigma": sigma,
                    "max_grad_norm": cfg.max_grad_norm, "sample_rate": q,
                    "expected_batch_size": q * units,
                    "steps": cfg.epochs * steps_per_epoch, "accounted_steps": accountant.steps,
                    "unit": "record" if cfg.users is None else "user",
                    "delta": cfg.delta, "accountant": cfg.accountant, "epsilon": eps,
                    f"epsilon_{other}": eps_other},
        "runs": [dict(asdict(r), final_test_accuracy=r.test_accuracy[-1],
                      seconds_per_epoch=r.seconds_per_epoch) for r in runs],
        "machine": {"torch": torch.__version__, "python": platform.python_version(),
                    "machine": platform.machine(), "threads": cfg.threads},
    }
    print(format_result(result))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {cfg.json}")
    if cfg.plot:
        plot_result(result, cfg.plot)
        print(f"wrote {cfg.plot}")
    return result


def _label(mechanism: Mechanism | None) -> str:
    if mechanism is None:
        return "DP-SGD"
    if hasattr(mechanism, "buffers"):
        return f"BLT ({mechanism.buffers} buffers)"
    return f"BandMF ({mechanism.bands} bands)"


def _spawn(cfg: DPTrainConfig) -> dict:
    """Run ``cfg`` in ``cfg.nproc`` processes joined by ``torch.distributed`` (gloo, a
    rendezvous file in a temporary folder): each process takes its share of every
    Poisson sample and ``PrivateStep.release`` sums them; rank 0 prints, plots and
    writes the figures, which are returned here."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.start_processes(_rank_main, args=(cfg, folder, init), nprocs=cfg.nproc,
                           join=True, start_method="spawn")
        with open(os.path.join(folder, "result.json")) as f:
            return json.load(f)


def _rank_main(rank: int, cfg: DPTrainConfig, folder: str, init: str) -> None:
    """One process of :func:`_spawn`: its share of the threads; only rank 0 prints,
    compares with the non-private run, plots and writes."""
    import contextlib
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cfg.nproc,
                            timeout=timedelta(minutes=10))
    first = rank == 0
    mine = replace(cfg, threads=max(1, cfg.threads // cfg.nproc), progress=cfg.progress and first,
                   compare_nonprivate=cfg.compare_nonprivate and first,
                   plot=cfg.plot if first else None, json=cfg.json if first else None)
    try:
        quiet = contextlib.nullcontext() if first else contextlib.redirect_stdout(
            open(os.devnull, "w"))
        with quiet:
            result = run(mine)
    finally:
        dist.destroy_process_group()
    if first:
        result["config"]["threads"] = cfg.threads
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f)


def format_result(result: dict) -> str:
    """The final table: test accuracy, epsilon and seconds per epoch of each run."""
    p = result["privacy"]
    lines = [f"  {'run':<12}{'test acc':>9}{'epsilon':>9}{'s/epoch':>9}"]
    for r in result["runs"]:
        eps = f"{p['epsilon']:.2f}" if r["name"] == "private" else "inf"
        lines.append(f"  {r['name']:<12}{r['final_test_accuracy']:>9.3f}{eps:>9}"
                     f"{r['seconds_per_epoch']:>9.2f}")
    other = "pld" if p["accountant"] == "rdp" else "rdp"
    eps_other = p[f"epsilon_{other}"]
    eps_other = "not computed" if eps_other is None else f"{eps_other:.2f}"
    unit, cycle = p.get("unit", "record"), p.get("cycle_length", p.get("bands", 1))
    accounted = "" if p.get("bands", 1) == 1 and not p["mechanism"].startswith("BLT") else (
        f" (BLT: each {unit} in at most one of every {cycle} steps; accounted as one "
        f"Gaussian mechanism of its sensitivity)" if p["mechanism"].startswith("BLT") else
        f" (BandMF: each {unit} in at most one of every {cycle} steps; accounted as "
        f"DP-SGD at rate {cycle} q)")
    lines.append(f"  epsilon at delta {p['delta']:g} ({p['accountant']}; {other}: "
                 f"{eps_other}) after {p['steps']} steps of sigma "
                 f"{p['sigma']:.3f}, q {p['sample_rate']:.4f}{accounted}")
    if len(result["runs"]) == 2:
        ratio = result["runs"][0]["seconds_per_epoch"] / result["runs"][1]["seconds_per_epoch"]
        lines.append(f"  a private epoch takes {ratio:.2f}x the time of a non-private one")
    return "\n".join(lines)


def plot_result(result: dict, path: str) -> None:
    """Learning curves: train loss; train and test accuracy with epsilon on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.8))
    for r in result["runs"]:
        style = "-" if r["name"] == "private" else "--"
        epochs = range(1, len(r["train_loss"]) + 1)
        ax_loss.plot(epochs, r["train_loss"], style, color="tab:blue", label=f"{r['name']} train")
        ax_acc.plot(epochs, r["train_accuracy"], style, color="tab:blue",
                    label=f"{r['name']} train")
        ax_acc.plot(epochs, r["test_accuracy"], style, color="tab:green",
                    label=f"{r['name']} test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy (mean over the epoch's batches)",
                title="training loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    private = result["runs"][0]
    eps_ax = ax_acc.twinx()
    eps_ax.plot(range(1, len(private["epsilon"]) + 1), private["epsilon"], ":o", markersize=3,
                color="tab:red", label=f"epsilon (delta {result['privacy']['delta']:g})")
    eps_ax.set_ylabel("epsilon spent", color="tab:red")
    eps_ax.set_ylim(bottom=0)
    handles = ax_acc.get_legend_handles_labels()
    eps_handles = eps_ax.get_legend_handles_labels()
    ax_acc.legend(handles[0] + eps_handles[0], handles[1] + eps_handles[1], fontsize=8,
                  loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    ax_loss.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    p = result["privacy"]
    fig.suptitle(f"DP-SGD, SimpleCNN on digits: sigma {p['sigma']:.2f}, C {p['max_grad_norm']:g},"
                 f" q {p['sample_rate']:.3f}, final epsilon {p['epsilon']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check(cfg: DPTrainConfig) -> None:
    check_dp_options(cfg)
    for name in ("epochs", "batch_size", "max_grad_norm", "lr", "nonprivate_lr", "threads",
                 "nproc"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("subset", "max_steps"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {getattr(cfg, name)}")
    if cfg.sigma is None and not 0 < cfg.target_epsilon < math.inf:
        raise ValueError(f"target epsilon must be finite and > 0, got {cfg.target_epsilon}")
    if cfg.sigma is not None and not cfg.sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {cfg.sigma}")
    if not 0 < cfg.delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {cfg.delta}; e.g. 1e-5")
    if cfg.mechanism not in ("dpsgd", "bandmf", "blt"):
        raise ValueError(f"mechanism must be dpsgd, bandmf or blt, got {cfg.mechanism!r}")
    if cfg.mechanism != "dpsgd" and cfg.clipping == "adaptive":
        raise ValueError(f"--mechanism {cfg.mechanism} takes a fixed clipping norm: not with "
                         "--clipping adaptive")
    for name in ("bands", "buffers"):
        if not getattr(cfg, name) >= 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``dp-train`` and its options to ``persample``'s subcommands; returns its parser.

    Examples:
        >>> parser = argparse.ArgumentParser(prog="persample")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["dp-train", "--epochs", "3"]).epochs
        3
    """
    d = DPTrainConfig()
    p = subparsers.add_parser(
        "dp-train",
        help="train a SimpleCNN with DP-SGD on scikit-learn's digits",
        description="DP-SGD (Abadi et al. 2016) on a SimpleCNN and scikit-learn's "
        "digits (1x28x28, fixed stratified 80/20 split): Poisson-sampled batches, "
        "persample.dp.private_grad (per-sample clipping and Gaussian noise from one forward "
        "and one backward), SGD with momentum, privacy accounting with Google's dp-accounting.",
    )
    p.formatter_class = PlainHelp  # (the docstring's markup as text)
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="expected batch size; each example is in a batch with probability "
                   f"q = batch-size / N (default {d.batch_size})")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--sigma", type=float, default=None,
                       help="noise multiplier (noise std / C); default: the smallest that "
                       "meets --target-epsilon")
    noise.add_argument("--target-epsilon", type=float, default=None,
                       help="epsilon budget at --delta for the whole run (default "
                       f"{d.target_epsilon} when --sigma is not given)")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help=f"clipping norm C of each sample's gradient (default {d.max_grad_norm})")
    p.add_argument("--delta", type=float, default=d.delta, help=f"default {d.delta:g}")
    p.add_argument("--lr", type=float, default=d.lr,
                   help=f"SGD learning rate of DP-SGD (default {d.lr})")
    p.add_argument("--nonprivate-lr", type=float, default=d.nonprivate_lr,
                   help="SGD learning rate of the --compare-nonprivate run, whose gradients "
                   f"are not clipped (default {d.nonprivate_lr})")
    p.add_argument("--momentum", type=float, default=d.momentum,
                   help=f"SGD momentum (default {d.momentum})")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="initial weights, batches and noise; the split is fixed (default 0)")
    p.add_argument("--accountant", choices=("rdp", "pld", "prv"), default=d.accountant,
                   help="privacy accountant: RDP (default), PLD (tighter, slower) or PRV "
                        "(Opacus's, where Opacus is installed)")
    add_dp_arguments(p, d, "records", "at random, fixed")
    p.add_argument("--mechanism", choices=("dpsgd", "bandmf", "blt"), default=d.mechanism,
                   help="the noise: DP-SGD's independent draws (default), BandMF's "
                   "correlated ones (Choquette-Choo et al. 2023; cyclic Poisson sampling "
                   "over BANDS groups) or BLT's (McMahan et al. 2024; fixed batches, an "
                   "epoch apart), the strategy optimised for SGD with --momentum")
    p.add_argument("--bands", type=int, default=d.bands,
                   help=f"BandMF's bands, at most 1 / q (default {d.bands})")
    p.add_argument("--buffers", type=int, default=d.buffers,
                   help=f"BLT's buffers: parameter-sized states (default {d.buffers})")
    p.add_argument("--compare-nonprivate", action="store_true",
                   help="also train the same model without DP and compare")
    p.add_argument("--subset", type=int, default=None,
                   help="train on the first SUBSET training examples only (quick checks)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="at most this many steps per epoch (quick checks)")
    add_threads_argument(p, "torch CPU threads in all")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="processes (torch.distributed, gloo): each takes its share of every "
                   "Poisson sample; the same accuracy and epsilon as one process "
                   f"(default {d.nproc})")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars")
    p.add_argument("--plot", metavar="FILE.png", help="write the learning curves")
    p.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    return p


def run_from_args(args: argparse.Namespace) -> dict:
    """Run ``dp-train`` with the options parsed by :func:`add_parser`'s parser."""
    target = DPTrainConfig.target_epsilon if args.target_epsilon is None else args.target_epsilon
    cfg = DPTrainConfig(
        epochs=args.epochs, batch_size=args.batch_size, sigma=args.sigma, target_epsilon=target,
        max_grad_norm=args.max_grad_norm, delta=args.delta, lr=args.lr,
        nonprivate_lr=args.nonprivate_lr,
        momentum=args.momentum, seed=args.seed, accountant=args.accountant,
        secure_mode=args.secure_mode, clipping=args.clipping, users=args.users,
        records_per_user=args.records_per_user, mechanism=args.mechanism, bands=args.bands,
        buffers=args.buffers,
        automatic_gamma=args.automatic_gamma,
        target_unclipped_quantile=args.target_unclipped_quantile,
        unclipped_num_std=args.unclipped_num_std,
        clipbound_learning_rate=args.clipbound_learning_rate,
        compare_nonprivate=args.compare_nonprivate,
        subset=args.subset,
        max_steps=args.max_steps, threads=args.threads, nproc=args.nproc, plot=args.plot,
        json=args.json, progress=args.progress)
    try:
        _check(cfg)
    except ValueError as err:
        raise SystemExit(f"persample dp-train: error: {err}") from err
    return run(cfg)
