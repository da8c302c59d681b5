"""Parallel dims: the degrees of the mesh axes, and the one layout name format.

Pure (no torch, no I/O): the trainer builds its ``DeviceMesh`` from these, the offline
resharder computes target layouts from them without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import ConfigError, LayoutError

#: Mesh axis names, major to minor (tp innermost so TP groups are neighbouring ranks).
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of the four mesh axes; the world size is their product.

    Attributes:
        pp: pipeline stages.
        dp_replicate: data-parallel replicas (DDP/HSDP replication).
        dp_shard: data-parallel shards (FSDP2 ZeRO-3 sharding).
        tp: tensor-parallel degree (innermost: neighbouring ranks).
        pipeline_split: layers per stage, one int per stage summing to num_layers;
            empty = as even as possible, earlier stages taking the remainder.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pipeline_split: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{axis}={value!r}: must be an integer >= 1")
        self.pipeline_split = tuple(int(n) for n in self.pipeline_split)
        if self.pipeline_split and len(self.pipeline_split) != self.pp:
            raise ConfigError(
                f"pipeline_split={','.join(map(str, self.pipeline_split))} has "
                f"{len(self.pipeline_split)} stages but pp={self.pp}")

    @classmethod
    def for_world_size(cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, tp: int = 1,
                       pipeline_split: tuple[int, ...] = ()) -> "ParallelDims":
        """The layout whose ``dp_shard`` takes the rest of ``world_size`` (``--dp-shard -1``,
        as torchtitan's ``dp_shard=-1``): ``world_size / (pp * dp_replicate * tp)``.

        Raises:
            LayoutError: ``world_size`` is not a positive multiple of ``pp * dp_replicate * tp``.
        """
        fixed = pp * dp_replicate * tp
        if world_size < 1 or fixed < 1 or world_size % fixed:
            raise LayoutError(f"world size {world_size} is not a multiple of pp*dp_replicate*tp = "
                              f"{pp}*{dp_replicate}*{tp} = {fixed}; use a world size (--nproc-per-node) "
                              f"that is a multiple of {fixed}")
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=world_size // fixed, tp=tp,
                   pipeline_split=pipeline_split)

    @property
    def world_size(self) -> int:
        """Number of ranks ``pp * dp_replicate * dp_shard * tp``."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Total data-parallel degree ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in :data:`MESH_AXES` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (row-major over :data:`MESH_AXES`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out: dict[str, int] = {}
        for axis, size in zip(reversed(MESH_AXES), reversed(self.shape)):
            out[axis] = rank % size
            rank //= size
        return {axis: out[axis] for axis in MESH_AXES}

    def rank_of(self, coords: dict[str, int]) -> int:
        """Global rank of mesh coordinates (inverse of :meth:`coords`)."""
        rank = 0
        for axis, size in zip(MESH_AXES, self.shape):
            rank = rank * size + coords[axis]
        return rank

    def describe(self) -> str:
        """Short human form, e.g. ``pp2·dpr1·dps1·tp2``."""
        return f"pp{self.pp}·dpr{self.dp_replicate}·dps{self.dp_shard}·tp{self.tp}"

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "tp": self.tp, "pipeline_split": list(self.pipeline_split)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ParallelDims":
        """Inverse of :meth:`to_json`."""
        return cls(pp=int(data["pp"]), dp_replicate=int(data["dp_replicate"]),
                   dp_shard=int(data["dp_shard"]), tp=int(data["tp"]),
                   pipeline_split=tuple(data.get("pipeline_split", ())))
