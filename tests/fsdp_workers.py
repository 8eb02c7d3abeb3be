"""Workers of tests/test_fsdp.py, run in spawned processes (gloo on the CPU): models
sharded with FSDP2's ``fully_shard`` per block and at the root.

Each worker joins a process group, runs every scenario on its own share of the batch and
saves what it saw to ``{out}/rank{r}.pt`` (sharded results gathered with
``full_tensor()``; errors as their messages). The references (the unsharded model in one
process) are computed by the test itself from the same builders."""

from __future__ import annotations

import os
import resource
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import persample
from dist_workers import _error
from persample.dp import BLT, BandMF, PrivateStep, private_grad

V, D, T, LAYERS = 40, 12, 6, 2
N, C, SIGMA = 8, 0.5, 1.3  # samples (N // world per rank), clipping norm, noise multiplier
# clipping by groups (the embedding and first block against the rest) and automatic
FIRST = ["emb.weight", "blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc.weight",
         "blocks.0.fc.bias", "blocks.0.out.weight", "blocks.0.out.bias"]
CLIPPINGS = {"groups": dict(max_grad_norm=[0.3, 0.4]),  # FIRST, and the rest
             "automatic": dict(max_grad_norm="automatic", automatic_gamma=0.05)}


USERS = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7])  # each sample's user: two per rank, whole


def clipping(kind: str) -> dict:
    """The options of :data:`CLIPPINGS` ``kind``, with the groups named."""
    if kind != "groups":
        return CLIPPINGS[kind]
    rest = [n for n, _ in net().named_parameters() if n not in FIRST]
    return dict(CLIPPINGS[kind], param_groups=[FIRST, rest])


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.checkpointed = checkpointed

    def _forward(self, h: Tensor) -> Tensor:
        return h + self.out(torch.tanh(self.fc(self.ln(h))))

    def forward(self, h: Tensor) -> Tensor:  # (b, t, D)
        if self.checkpointed:
            return checkpoint(self._forward, h, use_reentrant=False)
        return self._forward(h)


class Net(nn.Module):
    """Embedding, blocks of LayerNorm + Linear, a head: a transformer's shape."""

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(checkpointed) for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, ids: Tensor) -> Tensor:  # (b, t) -> (b, t, V)
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def lm_loss(out: Any, y: Tensor) -> Tensor:
    """Per-sample summed token cross-entropy ``(b,)``."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def data(vocab: int = V) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (N, T), generator=g),
            torch.randint(0, vocab, (N, T), generator=g))


def net(kind: str = "plain") -> nn.Module:
    """The same weights in every process, drawn in float32 whatever the default dtype
    (then float64; float32 for ``"bf16"``)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return _net(kind)
    finally:
        torch.set_default_dtype(dtype)


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        import transformers

        config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=D, n_layer=2,
                                         n_head=2, bos_token_id=1, eos_token_id=1)
        return transformers.GPT2LMHeadModel(config).double().eval()
    model = Net(checkpointed=kind == "checkpoint")
    if kind == "lora":
        import peft

        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc", "out"],
                                 lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        torch.manual_seed(4)
        for name, p in model.named_parameters():  # lora_B starts at zero: make it count
            if "lora_B" in name:
                p.data.normal_(0, 0.5)
    return model.float() if kind == "bf16" else model.double()


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in ("Block", "GPT2Block")]


def shard(model: nn.Module, **options: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in blocks_of(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {k: full(p.grad) for k, p in model.named_parameters() if p.requires_grad}


def worker(rank: int, world: int, out: str, init: str, job: str) -> None:
    from persample.cli.real_models import load_torchvision

    load_torchvision()  # (transformers imports it when it is installed)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        saved = {"scenarios": scenarios, "memory": memory}[job](rank, world)
    finally:
        dist.destroy_process_group()
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))


def _step(model: nn.Module, ids: Tensor, y: Tensor, users: Tensor | None = None,
          **options: Any) -> dict:
    """PrivateStep (sigma 0) over this rank's samples in two micro-batches (``users``:
    each sample's user)."""
    options = {"max_grad_norm": C, **options}
    step = PrivateStep(model, lm_loss, noise_multiplier=0.0, expected_batch_size=N,
                       **options)
    half = len(ids) // 2
    first, second = (None, None) if users is None else (users[:half], users[half:])
    norms = torch.cat([step.accumulate(ids[:half], y[:half], first).norms,
                       step.accumulate(ids[half:], y[half:], second).norms])
    step.release()
    return {"norms": norms, "grads": grads(model),
            "dtensor": all(type(p.grad).__name__ == "DTensor" for p in model.parameters()
                           if p.requires_grad)}


def scenarios(rank: int, world: int) -> dict:
    ids, y = data()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    ids, y = ids[mine], y[mine]
    saved: dict[str, Any] = {}

    model = shard(net())
    saved["norms"] = persample.per_sample_grad_norms(model, ids, y, lm_loss, method="rules")
    saved["grads"] = persample.per_sample_grads(model, ids, y, lm_loss, method="rules")
    saved["one"] = persample.per_sample_grad_norms(model, ids[:1], y[:1], lm_loss)
    saved["loop"] = _error(lambda: persample.per_sample_grads(model, ids, y, lm_loss,
                                                              method="loop"))
    saved["step"] = _step(model, ids, y)
    for kind in CLIPPINGS:
        saved[kind] = _step(shard(net()), ids, y, **clipping(kind))
    saved["users"] = _step(shard(net()), ids, y, USERS[mine])  # whole users per micro-batch
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # the optimizer on the shards
    saved["stepped"] = {k: full(p) for k, p in model.named_parameters()}
    model = shard(net())
    saved["private_grad"] = private_grad(model, ids, y, lm_loss, max_grad_norm=C,
                                         noise_multiplier=0.0).norms, grads(model)

    model = shard(net())  # releases with nothing accumulated: the noise alone
    step = PrivateStep(model, lm_loss, max_grad_norm=C, noise_multiplier=SIGMA,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(7))
    draws = []
    for _ in range(60):
        step.release()
        draws.append(torch.cat([g.flatten() for g in grads(model).values()]))
    saved["noise"] = torch.stack(draws)
    model = shard(net())  # BandMF: each shard's draws correlated where they are
    step = PrivateStep(model, lm_loss, max_grad_norm=C, noise_multiplier=SIGMA,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(7),
                       mechanism=BandMF(12, 3))
    draws = []
    for _ in range(12):
        step.release()
        draws.append(torch.cat([g.flatten() for g in grads(model).values()]))
    saved["banded noise"] = torch.stack(draws)
    model = shard(net())  # BLT: each shard's buffers where it is
    step = PrivateStep(model, lm_loss, max_grad_norm=C, noise_multiplier=SIGMA,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(7),
                       mechanism=BLT(12, 2, cycle_length=4, decays=([0.9, 0.5], [0.7, 0.2])))
    draws = []
    for _ in range(12):
        step.release()
        draws.append(torch.cat([g.flatten() for g in grads(model).values()]))
    saved["blt noise"] = torch.stack(draws)
    model = shard(net())  # secure_mode: rank 0 draws each parameter's noise, broadcast
    step = PrivateStep(model, lm_loss, max_grad_norm=C, noise_multiplier=SIGMA,
                       expected_batch_size=10, secure_mode=True)
    before, draws = torch.get_rng_state(), []
    for _ in range(30):
        step.release()
        draws.append(torch.cat([g.flatten() for g in grads(model).values()]))
    saved["secure noise"] = torch.stack(draws)
    saved["secure left torch's generator"] = torch.equal(before, torch.get_rng_state())

    saved["lora"] = _step(shard(net("lora")), ids, y)
    saved["checkpoint"] = _step(shard(net("checkpoint")), ids, y)
    saved["gpt2"] = _step(shard(net("gpt2")), ids, y)
    saved["gpt2 norms"] = persample.per_sample_grad_norms(shard(net("gpt2")), ids, y, lm_loss,
                                                          method="rules")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    saved["bf16"] = _step(shard(net("bf16"), mp_policy=policy), ids, y)

    bad = shard(net())  # expected_batch_size differs between ranks
    step = PrivateStep(bad, lm_loss, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N + rank)
    saved["mismatch"] = _error(lambda: step.accumulate(ids, y)), grads(bad)
    other = shard(net())  # the noise generators differ between ranks
    step = PrivateStep(other, lm_loss, max_grad_norm=C, noise_multiplier=1.0,
                       expected_batch_size=N, generator=torch.Generator().manual_seed(rank))
    saved["generators"] = _error(lambda: step.accumulate(ids, y)), grads(other)
    nan_model = shard(net())  # a non-finite gradient on the last rank only: row V // 2
    with torch.no_grad():  # of the table (the last rank's shard) is NaN, looked up there
        if rank == world - 1:
            nan_model.emb.weight.to_local()[0] = float("nan")
    nan_ids = torch.where(ids == V // 2, V // 2 + 1, ids)
    if rank == world - 1:
        nan_ids[0, 0] = V // 2
    step = PrivateStep(nan_model, lm_loss, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    saved["nan"] = _error(lambda: step.accumulate(nan_ids, y)), grads(nan_model)

    empty = shard(net())  # rank 0 has no sample in the first micro-batch
    step = PrivateStep(empty, lm_loss, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N)
    first = 0 if rank == 0 else len(ids) // 2
    step.accumulate(ids[:first], y[:first])
    step.accumulate(ids[first:], y[first:])
    step.release()
    saved["empty"] = grads(empty)

    late = shard(net())  # last: rank 1 never accumulates; rank 0 must not hang
    step = PrivateStep(late, lm_loss, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=N, timeout=3.0)
    if rank == 0:
        saved["absent"] = _error(lambda: step.accumulate(ids, y))
    return saved


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the distinct storages alive among the tensors the ops read and
    made (storages resized in place, as FSDP frees and refills its gathered parameters,
    counted at their size of the moment): the process's tensor memory as its allocator
    sees it, without the C library's caching that makes the resident set size noisy."""

    def __init__(self):
        super().__init__()
        self.tensors: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if type(t) in (Tensor, nn.Parameter) and t.device.type == "cpu":  # (a DTensor
                self.tensors[id(t)] = weakref.ref(t)  # is a wrapper: its local tensor counts)
        sizes: dict[int, int] = {}
        for key, ref in list(self.tensors.items()):
            t = ref()
            if t is None:
                del self.tensors[key]
                continue
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(sizes.values()))
        return out


def memory(rank: int, world: int) -> dict:
    """Two DP steps of a GPT-2 (8 blocks of width 512) over this rank's samples: the
    process's peak RSS (MB), sharded over the ranks, or whole in a world of one. The
    sharded model is built on the meta device and its shards allocated after
    ``fully_shard``, as large models are."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=500, n_positions=32, n_embd=512, n_layer=8,
                                     n_head=4, bos_token_id=1, eos_token_id=1)
    if world == 1:
        model = transformers.GPT2LMHeadModel(config).eval()
    else:
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config).eval()
        shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02)
    ids, y = data(500)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = slice(rank * N // world, (rank + 1) * N // world)
    step = PrivateStep(model, lm_loss, max_grad_norm=C, noise_multiplier=1.0,
                       expected_batch_size=N, generator=torch.Generator().manual_seed(0))
    live = LiveBytes()
    with live:
        for _ in range(2):
            step.accumulate(ids[mine], y[mine])
            step.release()
            opt.step()
    return {"peak_mb": live.peak / 1e6,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
