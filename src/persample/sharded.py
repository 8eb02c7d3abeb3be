"""Models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter as a ``DTensor`` sharded across the ranks (dim 0 cut in
``world`` chunks) and, for the forward and backward of each unit (a module passed to
``fully_shard``), all-gathers the unit's parameters into plain tensors, its
*unsharded* parameters, which it frees again after use (their storage resized to
zero; the tensor objects stay the same from step to step). The ops of the forward
read the unsharded parameters, so persample follows those: a :class:`Sharding` maps
each trainable parameter's name to its unsharded form (the one the engine watches)
and to its sharded one (the one ``p.grad`` is written to). The per-sample work reads
activations and backprops only, not the parameters' values; where a rule must replay
an op on them, :func:`gatherer` all-gathers that unit again (FSDP's own ``unshard``)
until :func:`reshard_all` at the end of the call.

Clipped sums are reduced to the shards with :func:`reduce_to_shards` (a reduce-scatter
per unit, leaving each rank with its shard); a rank never holds more than one unit's
sums in full. FSDP1 (the ``FullyShardedDataParallel`` wrapper) is refused.

Source: Zhao et al. 2023, "PyTorch FSDP: experiences on scaling fully sharded data
parallel"; the FSDP2 design in ``torch.distributed.fsdp.fully_shard``'s documentation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` was applied to, outermost
    first (``named_modules()`` order); empty for an unsharded model.

    Raises:
        ValueError: ``model`` is or contains an FSDP1 ``FullyShardedDataParallel``.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed support
        return []
    units = []
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError(
                f"module '{name or type(m).__name__}' is wrapped in FSDP1's "
                "FullyShardedDataParallel, whose flat parameters cannot be split by "
                "sample: shard the model with FSDP2 instead, "
                "torch.distributed.fsdp.fully_shard(block) for each block and then "
                "fully_shard(model)")
        if isinstance(m, FSDPModule):
            units.append(m)
    return units


def refuse_sharded(model: nn.Module, method: str) -> None:
    """``torch.func`` and the loop differentiate the model as a whole, which a sharded
    model is not on any rank: a clear error instead of gradients of the wrong tensors.

    Raises:
        ValueError: ``model`` has FSDP2 units.
    """
    if fsdp_units(model):
        raise ValueError(
            f"method={method!r} cannot run on a model sharded with FSDP2 (each rank holds "
            "a shard of each parameter): only the rules split it by sample. Use "
            "method='rules' (or 'auto'), or compare with the loop on an unsharded copy")


class Sharding:
    """The trainable parameters of an FSDP2 model in their two forms.

    Attributes:
        names: the trainable parameters' names, ``named_parameters()`` order.
        sharded: ``{name: parameter}`` as the optimizer holds it (a ``DTensor`` for a
            parameter FSDP manages, else the plain parameter every rank holds whole).
        working: ``{name: parameter}`` as the forward reads it (the unsharded plain
            tensor, in ``MixedPrecisionPolicy.param_dtype``, or the plain parameter).
        unit_of: ``{id(working parameter): FSDP unit}`` for the managed ones.
    """

    def __init__(self, model: nn.Module, units: list[nn.Module]):
        self.units = units
        _initialise(units)
        managed = {}  # id of either form -> FSDPParam
        for unit in units:
            for group in _groups(unit):
                for fp in group.fsdp_params:
                    managed[id(fp.sharded_param)] = (fp, unit)
                    managed[id(fp._unsharded_param)] = (fp, unit)
        self.sharded: dict[str, nn.Parameter] = {}
        self.working: dict[str, nn.Parameter] = {}
        self.unit_of: dict[int, nn.Module] = {}
        self.fsdp: dict[str, Any] = {}  # name -> FSDPParam
        for name, p in model.named_parameters():
            if id(p) in managed:
                fp, unit = managed[id(p)]
                if not fp.sharded_param.requires_grad:
                    continue
                self.sharded[name], self.working[name] = fp.sharded_param, fp._unsharded_param
                self.unit_of[id(fp._unsharded_param)] = unit
                self.fsdp[name] = fp
            elif p.requires_grad:
                self.sharded[name] = self.working[name] = p
        self.names = list(self.sharded)

    def groups(self) -> list[list[int]]:
        """The ids of the working parameters, one list per unit (in the units' order),
        then one of those every rank holds whole: the order every rank sums and reduces
        them in."""
        found = []
        for unit in self.units:
            mine = [id(self.working[n]) for n in self.names
                    if self.unit_of.get(id(self.working[n])) is unit]
            if mine:
                found.append(mine)
        plain = [id(self.working[n]) for n in self.names if n not in self.fsdp]
        return found + ([plain] if plain else [])

    def local_like(self, name: str) -> Tensor:
        """Zeros of this rank's part of parameter ``name`` (its shard's local shape; the
        whole shape for a parameter every rank holds), in the sharded parameter's dtype."""
        p = self.sharded[name]
        fp = self.fsdp.get(name)
        if fp is None:
            return torch.zeros_like(p)
        shape = list(p.shape)
        shape[fp.fsdp_placement.dim] = shard_rows(fp)[1]
        return torch.zeros(shape, dtype=p.dtype, device=fp.sharded_param.to_local().device)


def shard_rows(fp: Any) -> tuple[int, int]:
    """``(first index, length)`` of this rank's shard along the sharded dim (FSDP2 cuts
    the dim in ``world`` chunks of ``ceil(size / world)``, the last ones shorter or
    empty)."""
    dim = fp.fsdp_placement.dim
    size = fp._orig_size[dim]
    world, rank = fp.mesh_info.shard_mesh_size, fp.mesh_info.shard_mesh_rank
    step = -(-size // world)
    start = min(rank * step, size)
    return start, min(step, size - start)


def gatherer(units: list[nn.Module]) -> Any:
    """For an op's leaves: all-gather again (FSDP's ``unshard``) the units whose
    unsharded parameters among them were freed, so that the op can be replayed on them
    (they stay gathered until :func:`reshard_all`). ``None`` without units."""
    if not units:
        return None
    unit_of = {id(fp._unsharded_param): unit for unit in units for g in _groups(unit)
               for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")}

    def gather(leaves: list[Tensor]) -> None:
        for t in leaves:
            unit = unit_of.get(id(t))
            if unit is not None and _freed(t):
                unit.unshard()
    return gather


def reshard_all(model: nn.Module) -> None:
    """Free every unit's unsharded parameters (after a call that gathered some again).
    Local: no collective."""
    for unit in fsdp_units(model):
        unit.reshard()


def _groups(unit: nn.Module) -> list[Any]:
    state = unit._get_fsdp_state()
    return list(state._fsdp_param_groups)


def _freed(t: Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().size() == 0


def _initialise(units: list[nn.Module]) -> None:
    """FSDP creates the unsharded parameters at a unit's first all-gather: before the
    model's first forward, gather and free each unit once (the root's lazy
    initialisation first, as its forward would do)."""
    if all(hasattr(fp, "_unsharded_param") for u in units for g in _groups(u)
           for fp in g.fsdp_params):
        return
    for unit in units:
        state = unit._get_fsdp_state()
        if state._is_root is None:
            state._lazy_init()
    for unit in units:
        unit.unshard()
        unit.reshard()


def reduce_to_shards(sharding: Sharding, sums: dict[str, Tensor], world_group: Any = None
                     ) -> dict[str, Tensor]:
    """Sum full-shape tensors ``{name: tensor}`` over the ranks, leaving each rank
    with its shard of each (``{name: local tensor}``, the sharded parameter's local
    shape): one reduce-scatter per dtype over FSDP's mesh for the managed parameters,
    an all-reduce for those every rank holds whole."""
    import torch.distributed as dist

    out: dict[str, Tensor] = {}
    managed = [n for n in sums if n in sharding.fsdp]
    by_kind: dict[tuple, list[str]] = {}
    for name in managed:
        fp = sharding.fsdp[name]
        key = (sums[name].dtype, id(fp.mesh_info.shard_process_group))
        by_kind.setdefault(key, []).append(name)
    for names in by_kind.values():
        fps = [sharding.fsdp[n] for n in names]
        world = fps[0].mesh_info.shard_mesh_size
        group = fps[0].mesh_info.shard_process_group
        chunks = [_padded_chunks(sums[n], fp, world) for n, fp in zip(names, fps)]  # (world, m)
        flat = torch.cat(chunks, dim=1)  # (world, sum m): rank r's inputs in row r
        mine = flat.new_empty(flat.shape[1])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(mine, flat.reshape(-1), group=group)
        offset = 0
        for name, fp, c in zip(names, fps, chunks):
            size = c.shape[1]
            _, length = shard_rows(fp)
            dim = fp.fsdp_placement.dim
            padded = mine[offset : offset + size].view(_chunk_shape(sums[name].shape, dim, world))
            out[name] = padded.narrow(dim, 0, length)
            offset += size
    plain = [n for n in sums if n not in sharding.fsdp]
    if plain and world_group is not False and dist.is_initialized():
        for name in plain:
            dist.all_reduce(sums[name])
    for name in plain:
        out[name] = sums[name]
    return out


def _chunk_shape(shape: torch.Size, dim: int, world: int) -> tuple[int, ...]:
    s = list(shape)
    s[dim] = -(-s[dim] // world)
    return tuple(s)


def _padded_chunks(full: Tensor, fp: Any, world: int) -> Tensor:
    """``(world, m)``: row ``r`` the flattened chunk of ``full`` rank ``r`` keeps, padded
    with zeros to FSDP's padded shard shape."""
    dim = fp.fsdp_placement.dim
    shape = _chunk_shape(full.shape, dim, world)
    out = full.new_zeros((world, *shape))
    for r, piece in enumerate(torch.chunk(full, world, dim=dim)):
        if piece.shape[dim] == 0:
            continue
        out[r].narrow(dim, 0, piece.shape[dim]).copy_(piece)
    return out.view(world, -1)


def as_sharded_grad(p: nn.Parameter, local: Tensor) -> Tensor:
    """``local`` (this rank's shard) as the gradient of the sharded parameter ``p``: a
    ``DTensor`` with ``p``'s mesh, placements, shape and dtype, as FSDP itself writes
    ``p.grad`` (a plain parameter gets ``local`` as it is)."""
    from torch.distributed.tensor import DTensor

    local = local.to(p.dtype)
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local.contiguous(), p.device_mesh, p.placements,
                              shape=p.shape, stride=p.stride(), run_check=False)
