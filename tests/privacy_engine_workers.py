"""Workers of tests/test_privacy_engine.py's several-process tests, run in spawned
processes (gloo on the CPU): the Opacus loop through persample's ``PrivacyEngine`` on
each rank, its model wrapped in ``DistributedDataParallel`` or sharded with FSDP2's
``fully_shard``, with and without ``BatchMemoryManager``; each saves the batches it saw
and the weights it ended with to ``{out}/rank{r}.pt``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from persample.dp import PrivacyEngine

B, SIZE, STEPS = 20, 4, 3  # expected logical batch; physical batches of at most 4
# (wrapped how, which loop): "ghost" is Opacus's grad_sample_mode="ghost_fsdp" (the
# criterion make_private returns), without BatchMemoryManager
SCENARIOS = [("ddp", "plain"), ("ddp", "bmm"), ("fsdp", "plain"), ("fsdp", "bmm"),
             ("fsdp", "ghost")]


def wrapped(model: nn.Module, how: str) -> nn.Module:
    """``model`` in DDP, or sharded with FSDP2 (each linear layer, then the root)."""
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.fc)
    fully_shard(model.out)
    return fully_shard(model)


def run(how: str, loop: str, rank: int, make) -> dict:
    """The loop on this rank (the tests' ``_bmm_loop``): ``(x, y, rng state)`` per
    physical batch, grouped by the logical batch each step ended, and the final weights
    (whole)."""
    from test_privacy_engine import _bmm_loop

    torch.manual_seed(1 + rank)  # each rank's own dropout masks
    model = make()
    module = wrapped(model, how)
    engine = PrivacyEngine()
    criterion = nn.CrossEntropyLoss()
    private, optimizer, *given, loader = engine.make_private(
        module=module, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(make.data(), batch_size=B), noise_multiplier=0.0,
        max_grad_norm=0.3, criterion=criterion,
        grad_sample_mode="ghost_fsdp" if loop == "ghost" else "hooks")
    criterion = given[0] if given else criterion
    seen = _bmm_loop(engine, private, optimizer, loader, criterion, STEPS,
                     SIZE if loop == "bmm" else None)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"seen": seen, "weights": [p.detach().clone() for p in whole],
            "sharded": all(hasattr(p, "full_tensor") for p in model.parameters())}


def worker(rank: int, world: int, out: str, init: str) -> None:
    from test_privacy_engine import _data, _twin

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))

    def make():
        return _twin(0.3).train()
    make.data = _data
    try:
        saved = {(how, loop): run(how, loop, rank, make) for how, loop in SCENARIOS}
        saved["secure"] = _refused(make)
    finally:
        dist.destroy_process_group()
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))


def _refused(make) -> str:
    """The error of ``secure_mode`` with several processes (the ranks must draw one
    Poisson sample alike)."""
    model = make()
    try:
        PrivacyEngine(secure_mode=True).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(make.data(), batch_size=B), noise_multiplier=1.0,
            max_grad_norm=1.0)
    except ValueError as err:
        return str(err)
    return "no error"
