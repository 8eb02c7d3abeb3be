"""Workers of tests/test_dp_setup.py's two-process tests, run in spawned processes (gloo on
the CPU): the seeds every rank shares, and ``make_private``'s loop on each rank (the
model plain, in ``DistributedDataParallel`` or sharded with FSDP2; record- and
user-level), each saving what it saw to ``{out}/rank{r}.pt``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from persample.dp import make_private
from persample.dp.setup import shared_seeds

# records; the most records of a physical batch; the run's seed (with it ranks get
# physical batches of a single record, which FSDP2 captures at n = 1)
N, SIZE, SEED = 60, 5, 6
# 20 users of 2 to 4 records (at most 3 a step), interleaved, ids not 0..19
USERS = torch.repeat_interleave(torch.arange(20) * 3 + 1, torch.tensor([2, 3, 4] * 6 + [2, 4])
                                )[torch.randperm(N, generator=torch.Generator().manual_seed(1))]
# (scenario, wrapped how, user-level)
SCENARIOS = [("plain", "plain", False), ("ddp", "ddp", False), ("fsdp", "fsdp", False),
             ("users", "plain", True), ("fsdp users", "fsdp", True)]


def data() -> TensorDataset:
    """``(x (N, 4), y (N,), index (N,))``: each record carries its index."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (N,), generator=g), torch.arange(N))


def net() -> nn.Module:
    """The same float64 weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def wrapped(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        return fully_shard(model)
    return model


def train(how: str = "plain", users: bool = False) -> dict:
    """One epoch of ``make_private`` (sigma 0) on this process: the record indices of
    each physical batch, grouped by logical batch, and the final weights (whole)."""
    model = net()
    module = wrapped(model, how)
    private = make_private(
        module, torch.optim.SGD(model.parameters(), lr=0.5), data(), nn.CrossEntropyLoss(),
        noise_multiplier=0.0, epochs=1, max_grad_norm=0.3,
        expected_batch_size=5 if users else 12, physical_batch_size=SIZE,
        user_ids=USERS if users else None, records_per_user=3 if users else None,
        generator=torch.Generator().manual_seed(SEED))
    seen = []
    for logical in private.batches():
        parts = []
        for x, y, index in logical:
            private.accumulate(x, y)
            parts.append(index.tolist())
        seen.append(parts)
        private.release()
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"seen": seen, "weights": [p.detach().clone() for p in whole],
            "sharded": all(hasattr(p, "full_tensor") for p in model.parameters())}


def seeds(rank: int) -> dict:
    """Each rank's own draw from torch's generator (seeded apart), and the seeds
    ``shared_seeds`` gave it from that generator and from its own int."""
    torch.manual_seed(100 + rank)
    own = int(torch.randint(1 << 62, (1,)))
    torch.manual_seed(100 + rank)
    return {"own": own, "drawn": shared_seeds(), "given": shared_seeds(rank)}


def secure_refused() -> str:
    model = net()
    try:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data(),
                     nn.CrossEntropyLoss(), noise_multiplier=1.0, epochs=1, max_grad_norm=1.0,
                     expected_batch_size=12, secure_mode=True)
    except ValueError as err:
        return str(err)
    return "no error"


def worker(rank: int, world: int, out: str, init: str) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        saved = {"seeds": seeds(rank), "secure": secure_refused()}
        saved.update({name: train(how, users) for name, how, users in SCENARIOS})
    finally:
        dist.destroy_process_group()
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
