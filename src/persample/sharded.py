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

import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

from .walk import picked_modules


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` was applied to, outermost
    first (``named_modules()`` order); empty for an unsharded model.

    Raises:
        ValueError: ``model`` is or contains an FSDP1 ``FullyShardedDataParallel``.
    """
    if "torch.distributed.fsdp" not in sys.modules:
        # nothing was sharded in this process (importing FSDP costs ~1 s: not on a
        # first call that does not need it)
        return []
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: F401
    except ImportError:  # a torch built without distributed support
        return []
    return picked_modules(model, _fsdp_unit)


def _fsdp_unit(name: str, m: nn.Module) -> bool:
    """Is ``m`` an FSDP2 unit (``fully_shard`` swaps its class)? Raises for FSDP1's
    wrapper."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(m, FullyShardedDataParallel):
        raise ValueError(
            f"module '{name or type(m).__name__}' is wrapped in FSDP1's "
            "FullyShardedDataParallel, whose flat parameters cannot be split by "
            "sample: shard the model with FSDP2 instead, "
            "torch.distributed.fsdp.fully_shard(block) for each block and then "
            "fully_shard(model)")
    return isinstance(m, FSDPModule)


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

    Attributes (``{name: ...}``, ``named_parameters()`` order):
        sharded: ``{name: parameter}`` as the optimizer holds it (a ``DTensor`` for a
            parameter FSDP manages, else the plain parameter every rank holds whole).
        working: ``{name: parameter}`` as the forward reads it (the unsharded plain
            tensor, in ``MixedPrecisionPolicy.param_dtype``, or the plain parameter).
        fsdp, unit_of: FSDP's record of each managed parameter, and its unit.
    """

    def __init__(self, model: nn.Module, units: list[nn.Module]):
        self.units = units
        _initialise(units)
        managed = {}  # id of either form -> (FSDPParam, unit)
        for fp, unit in _fsdp_params(units):
            managed[id(fp.sharded_param)] = managed[id(fp._unsharded_param)] = (fp, unit)
        self.sharded: dict[str, nn.Parameter] = {}
        self.working: dict[str, nn.Parameter] = {}
        self.fsdp: dict[str, Any] = {}  # name -> FSDPParam
        self.unit_of: dict[str, nn.Module] = {}
        for name, p in model.named_parameters():
            if id(p) in managed:
                fp, unit = managed[id(p)]
                if not fp.sharded_param.requires_grad:
                    continue
                self.sharded[name], self.working[name] = fp.sharded_param, fp._unsharded_param
                self.fsdp[name], self.unit_of[name] = fp, unit
            elif p.requires_grad:
                self.sharded[name] = self.working[name] = p

    def groups(self) -> list[list[int]]:
        """The ids of the working parameters, one list per unit (in the units' order),
        then one of those every rank holds whole: the order every rank sums and reduces
        them in."""
        found = [[id(p) for n, p in self.working.items() if self.unit_of.get(n) is unit]
                 for unit in self.units]
        found.append([id(p) for n, p in self.working.items() if n not in self.fsdp])
        return [group for group in found if group]

    def local_like(self, name: str, dtype: torch.dtype) -> Tensor:
        """Zeros for this rank's part of parameter ``name`` (its shard's local shape; the
        whole shape for a parameter every rank holds), in ``dtype``."""
        p = self.sharded[name]
        shape = list(p.shape)
        fp = self.fsdp.get(name)
        if fp is not None:
            shape[fp.fsdp_placement.dim] = shard_rows(fp)[1]
        return torch.zeros(shape, dtype=dtype, device=p.device)


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
    unit_of = {id(fp._unsharded_param): unit for fp, unit in _fsdp_params(units)
               if hasattr(fp, "_unsharded_param")}

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


def _fsdp_params(units: list[nn.Module]) -> list[tuple[Any, nn.Module]]:
    """FSDP's record (``FSDPParam``) of every parameter the units manage, with its unit."""
    return [(fp, unit) for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups
            for fp in group.fsdp_params]


def _freed(t: Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().size() == 0


def _initialise(units: list[nn.Module]) -> None:
    """FSDP creates the unsharded parameters at a unit's first all-gather: before the
    model's first forward, gather and free each unit once (the root's lazy
    initialisation first, as its forward would do)."""
    if all(hasattr(fp, "_unsharded_param") for fp, _ in _fsdp_params(units)):
        return
    for unit in units:
        state = unit._get_fsdp_state()
        if state._is_root is None:
            state._lazy_init()
    for unit in units:
        unit.unshard()
        unit.reshard()


def reduce_to_shards(sharding: Sharding, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum full-shape tensors ``{name: tensor}`` over the ranks, leaving each rank
    with its shard of each (``{name: local tensor}``, the sharded parameter's local
    shape): one reduce-scatter per dtype over FSDP's mesh for the managed parameters,
    an all-reduce for those every rank holds whole."""
    import torch.distributed as dist

    out: dict[str, Tensor] = {}
    by_kind: dict[tuple, list[str]] = {}
    for name in sums:
        if name in sharding.fsdp:
            group = sharding.fsdp[name].mesh_info.shard_process_group
            by_kind.setdefault((sums[name].dtype, id(group)), []).append(name)
        else:  # every rank holds it whole
            if dist.is_initialized():
                dist.all_reduce(sums[name])
            out[name] = sums[name]
    for names in by_kind.values():
        info = sharding.fsdp[names[0]].mesh_info
        world = info.shard_mesh_size
        shapes = [_chunk_shape(sharding.fsdp[n], world) for n in names]  # each rank's
        sizes = [math.prod(shape) for shape in shapes]
        packed = sums[names[0]].new_zeros(world, sum(sizes))  # rank r's inputs in row r
        offset = 0
        for name, shape, size in zip(names, shapes, sizes):
            dim = sharding.fsdp[name].fsdp_placement.dim
            for r, piece in enumerate(torch.chunk(sums[name], world, dim=dim)):
                if piece.numel():
                    slot = packed[r, offset : offset + size].view(shape)
                    slot.narrow(dim, 0, piece.shape[dim]).copy_(piece)
            offset += size
        mine = packed.new_empty(packed.shape[1])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(mine, packed.view(-1), group=info.shard_process_group)
        for name, shape, piece in zip(names, shapes, mine.split(sizes)):
            fp = sharding.fsdp[name]
            out[name] = piece.view(shape).narrow(fp.fsdp_placement.dim, 0, shard_rows(fp)[1])
    return out


def _chunk_shape(fp: Any, world: int) -> tuple[int, ...]:
    """FSDP's padded shard shape of a parameter: its sharded dim cut in ``world``."""
    shape = list(fp._orig_size)
    dim = fp.fsdp_placement.dim
    shape[dim] = -(-shape[dim] // world)
    return tuple(shape)


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
