"""``persample attribute``: finding mislabelled training samples by their influence.

scikit-learn's digits (16x16) with a fraction of the training labels flipped to
another class; a small CNN trained briefly with SGD; every training sample scored
three ways:

- self-influence, TracIn over checkpoints (Pruthi et al. 2020): ``sum_c lr |g_i|^2``
  at the checkpoints ``c`` (:func:`persample.per_sample_grad_norms`);
- influence functions (Koh & Liang 2017): self-influence ``g_i^T (F + lambda I)^{-1}
  g_i`` at the final model, the GGN ``F`` by EK-FAC (George et al. 2018), K-FAC
  (Martens & Grosse 2015) or its exact diagonal (:func:`persample.self_influence`);
- TRAK-style influence on a clean validation set (Park et al. 2023): ``phi_i = P g_i``
  the projected gradients (:class:`persample.GradientProjector`), and the influence
  of training sample ``i`` on the validation loss
  ``sum_j phi_j^T (Phi^T Phi + lambda I)^-1 phi_i``, summed over TRAK's ensemble: the
  same checkpoints, each with its own projection; a harmful sample (negative
  influence) is flagged.

Each score's AUC of finding the flipped labels (scikit-learn's ``roc_auc_score``), the
time and peak RSS of each phase, and the same projections by materialising the
per-sample gradients first (``per_sample_grads`` then ``proj.project``). Other
libraries' scores are the benchmark's (``python -m persample_bench.attribution`` runs
dattri's TracIn beside); this command imports none.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ._rss import reset_peak_rss, status_kib
from .plain import PlainHelp
from .threads import add_threads_argument, default_threads, threads_label


@dataclass
class AttributeConfig:
    """The options of ``persample attribute`` (see ``--help``)."""

    flip: float = 0.1  # the fraction of training labels flipped
    epochs: int = 6
    checkpoints: int = 3  # the last epochs whose end is a TracIn checkpoint
    lr: float = 0.1
    batch_size: int = 50
    dim: int = 128  # projected dimensions (below the training samples: a ridge regression)
    kind: str = "kronecker"
    ridge: float = 0.1  # lambda, relative to the mean diagonal of Phi^T Phi
    chunk: int = 250  # samples per per-sample call
    seed: int = 0
    threads: int = field(default_factory=default_threads)  # the machine's free CPUs
    json: str | None = None
    plot: str | None = None


class _Phase:
    """Times a phase and reads its peak RSS (a phase entered again: the seconds added,
    the larger peak)."""

    def __init__(self, name: str, figures: dict):
        self.name, self.figures = name, figures

    def __enter__(self):
        self.measured = reset_peak_rss()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.start
        peak_kib = status_kib("VmHWM") if self.measured else None
        peak = None if peak_kib is None else peak_kib / 1024
        before = self.figures.get(self.name)  # a phase run again (per checkpoint) adds up
        if before is not None:
            seconds += before["seconds"]
            peak = max((p for p in (peak, before["peak_rss_mb"]) if p is not None),
                       default=None)
        self.figures[self.name] = {"seconds": seconds, "peak_rss_mb": peak}


def cnn() -> nn.Module:
    """The small CNN: conv 16 (3x3), ReLU, max-pool 2, conv 32, ReLU, linear 10."""
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 5 * 5, 10))


def _data(cfg: AttributeConfig) -> tuple[Tensor, ...]:
    from sklearn.model_selection import train_test_split

    from .data import digits_images

    x, y = digits_images(size=16)
    train, val = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2,
                                  random_state=cfg.seed, stratify=y.numpy())
    train, val = torch.as_tensor(train), torch.as_tensor(val)
    gen = torch.Generator().manual_seed(cfg.seed)
    flipped = torch.rand(len(train), generator=gen) < cfg.flip
    noisy = y[train].clone()
    shift = torch.randint(1, 10, (int(flipped.sum()),), generator=gen)
    noisy[flipped] = (noisy[flipped] + shift) % 10  # another class
    return x[train], noisy, flipped, x[val], y[val]


def _chunks(x: Tensor, y: Tensor, size: int):
    for start in range(0, len(y), size):
        yield x[start : start + size], y[start : start + size]


# another library's self-influence of every training sample ``(n,)``, from the model,
# the TracIn checkpoints (state dicts), the training images and labels and the options
Beside = Callable[[nn.Module, list, Tensor, Tensor, AttributeConfig], Tensor]


def run(cfg: AttributeConfig, beside: dict[str, Beside] | None = None) -> dict[str, Any]:
    """Train, score, report; returns every figure (what ``--json`` writes).

    ``beside``: other libraries' self-influence by name (the benchmark's), each timed
    as a phase and scored by its AUC; one that raises ``ImportError`` is reported as not
    installed."""
    from sklearn.metrics import roc_auc_score

    import persample

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    x, y, flipped, x_val, y_val = _data(cfg)
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    phases: dict[str, dict] = {}
    checkpoints = []
    with _Phase("train", phases):
        for epoch in range(cfg.epochs):
            for idx in torch.randperm(len(y)).split(cfg.batch_size):
                opt.zero_grad()
                loss_fn(model(x[idx]), y[idx]).backward()
                opt.step()
            if epoch >= cfg.epochs - cfg.checkpoints:
                checkpoints.append({k: v.clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        val_accuracy = (model(x_val).argmax(1) == y_val).float().mean().item()
    final = {k: v.clone() for k, v in model.state_dict().items()}

    self_influence = torch.zeros(len(y))
    with _Phase("self-influence (TracIn, per_sample_grad_norms)", phases):
        for state in checkpoints:
            model.load_state_dict(state)
            norms = torch.cat([persample.per_sample_grad_norms(model, xb, yb, loss_fn)
                               for xb, yb in _chunks(x, y, cfg.chunk)])
            self_influence += cfg.lr * norms.square()
    others = _beside(beside or {}, model, checkpoints, x, y, cfg, phases)

    influence, same = torch.zeros(len(y), dtype=torch.float64), 0.0
    for c, state in enumerate(checkpoints):  # TRAK's ensemble: a projection per checkpoint
        model.load_state_dict(state)
        proj = persample.GradientProjector(model, cfg.dim, kind=cfg.kind, seed=cfg.seed + c)
        phi_val = torch.cat([proj(xb, yb, loss_fn) for xb, yb in _chunks(x_val, y_val,
                                                                         cfg.chunk)])
        with _Phase(f"training set projected ({cfg.kind}, GradientProjector)", phases):
            phi = torch.cat([proj(xb, yb, loss_fn) for xb, yb in _chunks(x, y, cfg.chunk)])
        with _Phase("training set projected (per_sample_grads, then project)", phases):
            phi_m = torch.cat([proj.project(persample.per_sample_grads(model, xb, yb, loss_fn))
                               for xb, yb in _chunks(x, y, cfg.chunk)])
        same = max(same, (phi - phi_m).abs().max().item() / phi_m.abs().max().item())
        with _Phase("TRAK-style influence (ridge solve)", phases):
            influence += _trak(phi.double(), phi_val.double(), cfg.ridge)
    model.load_state_dict(final)
    curvatures = _influence_functions(model, x, y, loss_fn, cfg, phases)

    labels = flipped.numpy()
    auc = {"self-influence (TracIn)": float(roc_auc_score(labels, self_influence.numpy())),
           "TRAK-style (harmful to validation)": float(roc_auc_score(labels,
                                                                      (-influence).numpy()))}
    auc.update({name: float(roc_auc_score(labels, s.numpy())) for name, s in curvatures.items()})
    auc.update({name: float(roc_auc_score(labels, s.numpy())) for name, s in others.items()
                if isinstance(s, Tensor)})
    figures = {"config": asdict(cfg), "train_samples": len(y), "flipped": int(flipped.sum()),
               "validation_samples": len(y_val), "validation_accuracy": val_accuracy,
               "projected_dim": proj.dim, "parameters": sum(p.numel() for p in
                                                            model.parameters()),
               "auc": auc, "phases": phases,
               "projection_rel_difference_materialised": same,
               "beside": {name: "ran" if isinstance(s, Tensor) else s
                          for name, s in others.items()}}
    print(format_figures(figures))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"wrote {cfg.json}")
    if cfg.plot:
        _plot(cfg.plot, flipped, {"self-influence (TracIn)": self_influence,
                                  "harm to validation (TRAK-style)": -influence})
        print(f"wrote {cfg.plot}")
    return figures


def _influence_functions(model: nn.Module, x: Tensor, y: Tensor, loss_fn: nn.Module,
                         cfg: AttributeConfig, phases: dict) -> dict[str, Tensor]:
    """Self-influence by influence functions at the final model (Koh & Liang 2017):
    ``g_i^T (F + lambda I)^{-1} g_i`` with the GGN ``F`` by EK-FAC, K-FAC and its
    diagonal (:func:`persample.self_influence`), each timed: fitting the curvature,
    then scoring."""
    from ..influence import fit_preconditioner, self_influence

    scores = {}
    for curvature in ("ekfac", "kfac", "diagonal"):
        with _Phase(f"{curvature} fit (KFAC{', EKFAC' if curvature == 'ekfac' else ''})",
                    phases):
            pre = fit_preconditioner(model, (x, y), loss_fn, curvature=curvature,
                                     batch_size=cfg.chunk)
        with _Phase(f"{curvature} self-influence (persample.self_influence)", phases):
            scores[f"self-influence ({curvature.upper()} influence function)"] = \
                self_influence(model, (x, y), loss_fn, preconditioner=pre,
                               batch_size=cfg.chunk).double()
    return scores


def _beside(beside: dict[str, Beside], model: nn.Module, checkpoints: list[dict], x: Tensor,
            y: Tensor, cfg: AttributeConfig, phases: dict) -> dict[str, Tensor | str]:
    """Each other library's scores, timed as a phase; why not where it is not
    installed."""
    got: dict[str, Tensor | str] = {}
    for name, score in beside.items():
        try:
            with _Phase(f"self-influence ({name})", phases):
                got[name] = score(model, checkpoints, x, y, cfg).double()
        except ImportError as err:
            phases.pop(f"self-influence ({name})", None)
            got[name] = f"not installed ({err})"
    return got


def _trak(phi: Tensor, phi_val: Tensor, ridge: float) -> Tensor:
    """``(n,)``: ``sum_j phi_j^T (Phi^T Phi + lambda I)^-1 phi_i`` for each training
    sample, ``lambda = ridge * mean(diag(Phi^T Phi))``."""
    gram = phi.T @ phi  # (k, k)
    lam = ridge * gram.diagonal().mean()
    gram.diagonal().add_(lam)
    direction = torch.linalg.solve(gram, phi_val.sum(0))  # (k,)
    return phi @ direction


def format_figures(f: dict) -> str:
    """The report as text.

    Examples:
        >>> print(format_figures({"config": {"threads": 1}, "train_samples": 2, "flipped": 1,
        ...     "validation_samples": 1,
        ...     "validation_accuracy": 0.5, "parameters": 3, "projected_dim": 2,
        ...     "auc": {"a": 0.75}, "phases": {"p": {"seconds": 1.0, "peak_rss_mb": None}},
        ...     "projection_rel_difference_materialised": 0.0}))  # doctest: +ELLIPSIS
        digits: 2 training samples (1 labels flipped), 1 validation; ...
    """
    lines = [f"digits: {f['train_samples']} training samples ({f['flipped']} labels "
             f"flipped), {f['validation_samples']} validation; CNN of {f['parameters']:,} "
             f"parameters, validation accuracy {f['validation_accuracy']:.2f}; gradients "
             f"projected to {f['projected_dim']} dimensions; "
             f"{threads_label(f['config']['threads'])}",
             "", "AUC of finding the flipped labels:"]
    lines += [f"  {name:<46}{value:6.3f}" for name, value in f["auc"].items()]
    lines += ["", f"  {'phase':<58}{'seconds':>9}{'peak RSS MB':>13}"]
    for name, p in f["phases"].items():
        peak = "n/a" if p["peak_rss_mb"] is None else f"{p['peak_rss_mb']:.0f}"
        lines.append(f"  {name:<58}{p['seconds']:9.2f}{peak:>13}")
    agree = f["projection_rel_difference_materialised"]
    lines.append(f"  (the two projections agree to {agree:.1e} relative)")
    for name, why in f.get("beside", {}).items():
        if why != "ran":
            lines.append(f"  {name}: {why}")
    return "\n".join(lines)


def _plot(path: str, flipped: Tensor, scores: dict[str, Tensor]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scores), figsize=(5 * len(scores), 3.5))
    for ax, (name, s) in zip(axes, scores.items()):
        ax.hist(s[~flipped].numpy(), bins=40, alpha=0.6, label="clean", density=True)
        ax.hist(s[flipped].numpy(), bins=40, alpha=0.6, label="flipped", density=True)
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``attribute`` and its options to ``persample``'s subcommands.

    Examples:
        >>> parser = argparse.ArgumentParser(prog="persample")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["attribute", "--dim", "512"]).dim
        512
    """
    d = AttributeConfig()
    p = subparsers.add_parser(
        "attribute", aliases=["influence"],
        help="find flipped labels in the digits by gradient influence and influence functions",
        description=__doc__.split("\n\n")[1])
    p.formatter_class = PlainHelp  # (the docstring's markup as text)
    p.add_argument("--flip", type=float, default=d.flip,
                   help=f"fraction of training labels flipped (default {d.flip})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--checkpoints", type=int, default=d.checkpoints,
                   help=f"TracIn checkpoints: the last epochs' ends (default {d.checkpoints})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD step size (default {d.lr})")
    p.add_argument("--dim", type=int, default=d.dim,
                   help=f"projected dimensions (default {d.dim})")
    p.add_argument("--kind", default=d.kind, choices=("kronecker", "gaussian", "rademacher"),
                   help=f"the projection (default {d.kind})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    add_threads_argument(p)
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="the score distributions, clean and "
                   "flipped")
    return p


def run_from_args(args: argparse.Namespace, beside: dict[str, Beside] | None = None) -> dict:
    """Run ``attribute`` with the options parsed by :func:`add_parser`'s parser (and
    ``beside``, as :func:`run` takes it)."""
    cfg = AttributeConfig(flip=args.flip, epochs=args.epochs, checkpoints=args.checkpoints,
                          lr=args.lr, dim=args.dim, kind=args.kind, seed=args.seed,
                          threads=args.threads, json=args.json, plot=args.plot)
    if not 0 < cfg.flip < 1 or not 1 <= cfg.checkpoints <= cfg.epochs:
        raise SystemExit("attribute: need 0 < --flip < 1 and 1 <= --checkpoints <= --epochs")
    return run(cfg, beside)
