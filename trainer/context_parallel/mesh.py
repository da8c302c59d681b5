"""Context parallelism on the device mesh: the group, the FSDP mesh over dp_shard × cp, and
attaching the group to a model's attention."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardsmith.layout import ParallelDims
from shardsmith.layout.dims import FSDP_AXES, FSDP_MESH_DIM
from shardsmith.trainer.context_parallel.attention import ContextParallel


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
        shard = FSDP_AXES[0]
    else:
        shard = FSDP_MESH_DIM
        try:
            mesh[FSDP_MESH_DIM]
        except (KeyError, RuntimeError, ValueError):
            mesh[FSDP_AXES]._flatten(FSDP_MESH_DIM)
    return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


def attach(model: nn.Module, cp: ContextParallel | None) -> None:
    """Give the model (one stage or chunk) and each of its attention modules the cp group
    (``cp`` attribute, None = no context parallelism). In place; local."""
    from shardsmith.trainer.model import Attention, Transformer

    for module in model.modules():
        if isinstance(module, (Attention, Transformer)):
            module.cp = cp
