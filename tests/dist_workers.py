"""Workers of tests/test_dp_distributed.py, run in spawned processes (gloo on the CPU).

Each worker joins a process group, runs every scenario on its own share of the data and
saves what it saw to ``{out}/rank{r}.pt``; errors are saved as their messages."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from persample.dp import BLT, BandMF, PrivateStep


def GIVEN_BLT() -> BLT:
    """A BLT of given decays (no optimisation in the workers)."""
    return BLT(12, 2, cycle_length=4, decays=([0.9, 0.5], [0.7, 0.2]))

N, C = 8, 0.1
# each sample's user: whole users on each of two ranks, or user 2 on both
USERS = {"users": torch.tensor([0, 0, 1, 1, 2, 2, 2, 3]),
         "split user": torch.tensor([0, 0, 1, 2, 2, 2, 3, 3])}
# clipping by groups (interleaving layers) and automatic clipping, as the tests check them
CLIPPINGS = {
    "groups": dict(max_grad_norm=[0.05, 0.08], param_groups=[
        ["conv.weight", "fc.bias", "head.weight"], ["conv.bias", "fc.weight", "head.bias"]]),
    "automatic": dict(max_grad_norm="automatic", automatic_gamma=0.05),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 2)
        self.fc = nn.Linear(27, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:  # (b, 1, 4, 4)
        return self.head(torch.tanh(self.fc(torch.tanh(self.conv(x)).flatten(1))))


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, 1, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (N,), generator=g))


def model() -> Net:
    """The same weights in every process: drawn in float32 whatever the default dtype."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(0)
        return Net().double()
    finally:
        torch.set_default_dtype(dtype)


def grads(net: nn.Module) -> dict[str, Tensor | None]:
    return {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # the scenario expects one: its message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def worker(rank: int, world: int, out: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        saved = run_all(rank, world)
    finally:
        dist.destroy_process_group()
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))


def run_all(rank: int, world: int) -> dict:
    x, y = data()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    loss_fn = nn.CrossEntropyLoss()
    saved = {}

    net = model()  # a plain module on every rank
    step = PrivateStep(net, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    half = (mine.stop - mine.start) // 2  # two micro-batches per rank
    step.accumulate(x[mine][:half], y[mine][:half])
    step.accumulate(x[mine][half:], y[mine][half:])
    step.release()
    saved["plain"] = grads(net)

    ddp_net = model()  # wrapped in DistributedDataParallel
    ddp = nn.parallel.DistributedDataParallel(ddp_net)
    step = PrivateStep(ddp, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    step.accumulate(x[mine], y[mine])
    step.release()
    saved["ddp"] = grads(ddp_net)

    for kind, options in CLIPPINGS.items():  # DDP-wrapped, two micro-batches per rank
        net = model()
        step = PrivateStep(nn.parallel.DistributedDataParallel(net), loss_fn,
                           noise_multiplier=0.0, expected_batch_size=N, **options)
        step.accumulate(x[mine][:half], y[mine][:half])
        step.accumulate(x[mine][half:], y[mine][half:])
        step.release()
        saved[kind] = grads(net)

    for kind, users in USERS.items():  # user-level: whole users per rank, or one split
        net = model()
        step = PrivateStep(net, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                           expected_batch_size=4)
        step.accumulate(x[mine], y[mine], users[mine])
        saved[kind] = _error(step.release), grads(net)

    noisy = nn.Linear(30, 20).double()  # releases with nothing accumulated: noise only
    gen = torch.Generator().manual_seed(rank + 1)  # different per rank: rank 0's counts
    step = PrivateStep(noisy, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, generator=gen, sample_rate=0.1)
    draws = []
    for _ in range(100):
        step.release()
        draws.append(torch.cat([noisy.weight.grad.flatten(), noisy.bias.grad]))
    saved["noise"] = torch.stack(draws)
    saved["accounted"] = step.accountant.steps, step.epsilon(1e-5)

    banded = nn.Linear(30, 20).double()  # BandMF: rank 0's draws, correlated, added once
    step = PrivateStep(banded, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(rank + 1),
                       mechanism=BandMF(12, 3))
    draws = []
    for _ in range(12):
        step.release()
        draws.append(torch.cat([banded.weight.grad.flatten(), banded.bias.grad]))
    saved["banded noise"] = torch.stack(draws)

    buffered = nn.Linear(30, 20).double()  # BLT: rank 0's draws through its buffers, once
    step = PrivateStep(buffered, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(rank + 1),
                       mechanism=GIVEN_BLT())
    draws = []
    for _ in range(12):
        step.release()
        draws.append(torch.cat([buffered.weight.grad.flatten(), buffered.bias.grad]))
    saved["blt noise"] = torch.stack(draws)

    secure = nn.Linear(30, 20).double()  # secure_mode: rank 0's draw from the OS
    step = PrivateStep(secure, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, secure_mode=True)
    before, draws = torch.get_rng_state(), []
    for _ in range(30):
        step.release()
        draws.append(torch.cat([secure.weight.grad.flatten(), secure.bias.grad]))
    saved["secure noise"] = torch.stack(draws)
    saved["secure left torch's generator"] = torch.equal(before, torch.get_rng_state())

    bad = model()
    step = PrivateStep(bad, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N + rank, sample_rate=0.5)  # differs between ranks
    step.accumulate(x[mine], y[mine])
    saved["mismatch"] = _error(step.release), grads(bad)
    saved["mismatch accounted"] = step.accountant.steps

    nan_net = model()
    step = PrivateStep(nan_net, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    xs = x[mine].clone()
    if rank == world - 1:
        xs[0, 0, 0, 0] = float("nan")
    saved["nan accumulate"] = _error(lambda: step.accumulate(xs, y[mine]))
    saved["nan"] = _error(step.release), grads(nan_net)

    other = model()  # rank 1 holds another model
    if rank == 1:
        other.head = nn.Linear(16, 4).double()
    step = PrivateStep(other, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    saved["models"] = _error(step.release), grads(other)

    late = model()  # last: rank 1 never releases; rank 0 must not hang
    step = PrivateStep(late, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N, timeout=3.0)
    if rank == 0:
        saved["absent"] = _error(step.release), grads(late)
    return saved
