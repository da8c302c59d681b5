"""Context parallelism on the device mesh: the group, the FSDP mesh over dp_shard × cp, and
attaching the group to a model's attention."""

from __future__ import annotations

import weakref

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardsmith.layout import FSDP_AXES, FSDP_MESH_DIM, ParallelDims
from shardsmith.trainer.context_parallel.attention import ContextParallel

#: The flattened dp_shard × cp mesh of each global mesh (slicing a flattened dim out of the
#: root mesh again is deprecated in torch; HSDP with cp still does, for its 2-D mesh).
_FLATTENED: "weakref.WeakKeyDictionary[DeviceMesh, DeviceMesh]" = weakref.WeakKeyDictionary()


def context_parallel(mesh: DeviceMesh, dims: ParallelDims) -> ContextParallel | None:
    """This rank's :class:`ContextParallel` from the global mesh, or None when ``cp == 1``."""
    if dims.cp == 1:
        return None
    sub = mesh["cp"]
    return ContextParallel(sub.get_group(), dims.cp, sub.get_local_rank())


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard`` × ``cp`` flattened into one dim
    (:data:`~shardsmith.layout.dims.FSDP_MESH_DIM`, dp_shard major, as the plan's boxes
    assume), with ``dp_replicate`` in front for HSDP. Every rank calls it (the flatten
    creates a process group); calling it again reuses the flattened dim."""
    if dims.cp == 1:
        return mesh["dp_replicate", FSDP_AXES[0]] if dims.dp_replicate > 1 else mesh[FSDP_AXES[0]]
    if mesh not in _FLATTENED:  # torch keeps the flattened mesh; we hand it back
        _FLATTENED[mesh] = mesh[FSDP_AXES]._flatten(FSDP_MESH_DIM)
    return mesh["dp_replicate", FSDP_MESH_DIM] if dims.dp_replicate > 1 else _FLATTENED[mesh]


def attach(model: nn.Module, cp: ContextParallel | None) -> None:
    """Give the model (one stage or chunk) and each of its attention modules the cp group
    (``cp`` attribute, None = no context parallelism). In place; local."""
    from shardsmith.trainer.model import Attention, Transformer

    for module in model.modules():
        if isinstance(module, (Attention, Transformer)):
            module.cp = cp
