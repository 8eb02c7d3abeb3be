"""What a certificate costs: the first call of a plan with and without it, and the later
calls, alternated in one process (``python -m persample_bench.certified_cost``).

Each workload is timed as its users call it: per-sample gradients of the PyTorch
tutorial's CNN (B=64), per-sample gradient norms of a 20-layer MLP of width 512
(B=100), and a DP step of GPT-2 4x768 with its 50,257-token table tied (B=8, T=128;
needs ``transformers``). A first call is timed after :func:`persample.clear_plans` and
:func:`persample.certificate.forget` (a plan not seen before), with ``check="first"``
(certified) and ``check="never"``; a later call with each after warm-up. Medians of
alternated repetitions, float32, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import persample
from persample import certificate


def _cnn() -> Callable[[str], None]:
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    return lambda check: persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(),
                                                    check=check)


def _mlp() -> Callable[[str], None]:
    layers = [nn.Linear(64, 512), nn.Tanh()]
    for _ in range(18):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(512, 10))
    x, y = torch.randn(100, 64), torch.randint(0, 10, (100,))
    return lambda check: persample.per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(),
                                                         check=check)


def _gpt2() -> Callable[[str], None]:
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from persample.dp import private_grad

    config = GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=128)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 50257, (8, 128))

    def loss_fn(out, labels):
        logits, labels = out.logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)

    return lambda check: private_grad(model, {"input_ids": ids}, ids, loss_fn,
                                      max_grad_norm=1.0, noise_multiplier=1.0, check=check)


WORKLOADS = {"cnn-grads (B=64)": _cnn, "mlp-norms 20x512 (B=100)": _mlp,
             "gpt2-768 tied DP step (B=8, T=128)": _gpt2}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, repeats: int) -> dict[str, float]:
    """Median seconds of a first call (certified and not) and a later call (each)."""
    call = WORKLOADS[name]()
    call("never")  # imports, allocator
    times: dict[str, list[float]] = {k: [] for k in ("first", "first-never", "later",
                                                     "later-never")}

    def fresh(check: str) -> float:
        persample.clear_plans()
        certificate.forget()
        return _timed(lambda: call(check))

    for _ in range(repeats):
        times["first"].append(fresh("first"))
        times["first-never"].append(fresh("never"))
        call("first")  # (certified before the later calls)
        for _ in range(2):
            times["later"].append(_timed(lambda: call("first")))
            times["later-never"].append(_timed(lambda: call("never")))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    """Print the table of the certificates' cost (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| workload | first call, certified | first call, check='never' | ratio | "
          "later call | later, check='never' | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workload or list(WORKLOADS):
        t = measure(name, args.repeats)
        print(f"| {name} | {t['first'] * 1e3:,.1f} ms | {t['first-never'] * 1e3:,.1f} ms | "
              f"{t['first'] / t['first-never']:.2f}x | {t['later'] * 1e3:,.1f} ms | "
              f"{t['later-never'] * 1e3:,.1f} ms | {t['later'] / t['later-never']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
