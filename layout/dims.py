"""Parallel dims: the degrees of the mesh axes, the one layout name format, and the one
``dp_shard = -1`` rule.

Pure (no torch, no I/O): the trainer builds its ``DeviceMesh`` from these, the offline
resharder computes target layouts from them without a process group.

* :meth:`ParallelDims.for_world_size` is the only place ``dp_shard`` is derived from a
  world size (the ``--dp-shard -1`` of the command line; torchtitan's
  ``ParallelDims._validate``); :meth:`ParallelDims.check_world_size` the only world-size check.
* :meth:`ParallelDims.describe` / :meth:`ParallelDims.parse` are the only layout name:
  ``pp2·dpr1·dps1·tp2``; ``parse`` also takes the short form ``2.1.1.2``
  (pp.dp_replicate.dp_shard.tp, as the benchmarks' ``--layout`` flags spell it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import ConfigError, LayoutError

#: Mesh axis names, major to minor (tp innermost so TP groups are neighbouring ranks).
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")
#: Prefix of each axis in :meth:`ParallelDims.describe`, in :data:`MESH_AXES` order.
_NAME_PREFIXES: tuple[str, ...] = ("pp", "dpr", "dps", "tp")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of the four mesh axes; the world size is their product.

    Attributes:
        pp: pipeline stages.
        dp_replicate: data-parallel replicas (DDP/HSDP replication).
        dp_shard: data-parallel shards (FSDP2 ZeRO-3 sharding).
        tp: tensor-parallel degree (innermost: neighbouring ranks).
        pipeline_split: layers per model chunk, one int per chunk (``pp * virtual_stages``
            of them) summing to num_layers; empty = as even as possible, earlier chunks
            taking the remainder.
        virtual_stages: model chunks per pipeline rank (Megatron's virtual pipeline, the
            interleaved 1F1B schedule of Narayanan et al. 2021): rank ``r`` holds chunks
            ``r, r + pp, r + 2*pp, ...``. Not a mesh axis: it moves layers between pipeline
            ranks, never changes a tensor's box or name.
        expert_parallel: expert-parallel degree, carved out of the dp_shard ranks (1 or
            ``dp_shard``): each rank holds ``E / ep`` whole experts, the box FSDP2 would give
            it along the expert dim, so checkpoints do not change; tokens reach their experts
            by all-gather over the group (Megatron's ``allgather`` token dispatcher).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pipeline_split: tuple[int, ...] = field(default=())
    virtual_stages: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        for axis in (*MESH_AXES, "virtual_stages", "expert_parallel"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{axis}={value!r}: must be an integer >= 1")
        if self.virtual_stages > 1 and self.pp < 2:
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs pp >= 2 (interleaved "
                              "pipeline chunks live on different pipeline ranks)")
        if self.expert_parallel not in (1, self.dp_shard) or (self.expert_parallel > 1 and self.dp_replicate > 1):
            raise ConfigError(f"expert_parallel={self.expert_parallel}: expert parallelism is carved out of the "
                              f"FSDP ranks; use 1 or dp_shard={self.dp_shard}, with dp_replicate=1")
        self.pipeline_split = tuple(int(n) for n in self.pipeline_split)
        if self.pipeline_split and len(self.pipeline_split) != self.num_chunks:
            raise ConfigError(
                f"pipeline_split={','.join(map(str, self.pipeline_split))} has "
                f"{len(self.pipeline_split)} stages but pp={self.pp} x virtual_stages="
                f"{self.virtual_stages} needs {self.num_chunks}")

    @property
    def num_chunks(self) -> int:
        """Pipeline model chunks ``pp * virtual_stages`` (the schedule's stages)."""
        return self.pp * self.virtual_stages

    def chunk_ids(self, pp_rank: int) -> tuple[int, ...]:
        """Model chunks pipeline rank ``pp_rank`` holds: ``r, r + pp, ...`` (Megatron's order)."""
        return tuple(range(pp_rank, self.num_chunks, self.pp))

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

    @classmethod
    def for_world_size(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp_replicate: int = 1,
                       dp_shard: int = -1, pipeline_split: tuple[int, ...] = (),
                       virtual_stages: int = 1, expert_parallel: int = 1) -> "ParallelDims":
        """The layout of a job with ``world_size`` ranks; ``dp_shard=-1`` takes the rest.

        ``dp_shard = world_size / (pp * dp_replicate * tp)`` when it is -1 (tp, pp and
        dp_replicate stay as given); otherwise the product must equal ``world_size``.

        Raises:
            LayoutError: the world size is not a multiple of ``pp * dp_replicate * tp``, or
                the fixed degrees need another world size (the message says what fits).
            ConfigError: a degree is not an integer >= 1 (or -1 for ``dp_shard``).
        """
        if dp_shard == -1:
            fixed = pp * dp_replicate * tp
            if fixed < 1 or world_size % fixed:
                raise LayoutError(f"world size {world_size} is not a multiple of pp*dp_replicate*tp={fixed} "
                                  f"(pp={pp}, dp_replicate={dp_replicate}, tp={tp}); run on a multiple "
                                  f"of {fixed} processes")
            dp_shard = world_size // fixed
        parallel = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                       pipeline_split=pipeline_split, virtual_stages=virtual_stages,
                       expert_parallel=expert_parallel)
        parallel.check_world_size(world_size)
        return parallel

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`~shardsmith.errors.LayoutError` unless this layout has ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(f"layout {self.describe()} needs {self.world_size} processes but the job has "
                              f"{world_size}; run {self.world_size} processes, or pass --dp-shard -1 to "
                              "let dp_shard follow the world size")

    def describe(self) -> str:
        """The layout name, e.g. ``pp2·dpr1·dps1·tp2`` (:meth:`parse` reads it back; the
        pipeline split is not part of the name)."""
        return "·".join(f"{prefix}{size}" for prefix, size in zip(_NAME_PREFIXES, self.shape))

    @classmethod
    def parse(cls, name: str) -> "ParallelDims":
        """Inverse of :meth:`describe`; also takes the short form ``pp.dpr.dps.tp``
        (``1.1.2.2``) and ``.`` or ``,`` between the named parts.

        Raises:
            ConfigError: ``name`` is neither form (the message shows both).
        """
        parts = [p.strip() for p in name.replace("·", ".").replace(",", ".").split(".")]
        sizes: list[str] = []
        if len(parts) == len(MESH_AXES):
            if all(p.isdigit() for p in parts):
                sizes = parts
            elif all(p.startswith(x) and p[len(x):].isdigit() for p, x in zip(parts, _NAME_PREFIXES)):
                sizes = [p[len(x):] for p, x in zip(parts, _NAME_PREFIXES)]
        if not sizes:
            raise ConfigError(f"layout name {name!r}: expected e.g. 'pp2·dpr1·dps1·tp2' or its short "
                              "form '2.1.1.2' (pp.dp_replicate.dp_shard.tp)")
        pp, dp_replicate, dp_shard, tp = (int(size) for size in sizes)
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field (``virtual_stages`` only when > 1, so layouts without
        it write the bytes they always wrote)."""
        out = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
               "tp": self.tp, "pipeline_split": list(self.pipeline_split)}
        if self.virtual_stages > 1:
            out["virtual_stages"] = self.virtual_stages
        if self.expert_parallel > 1:
            out["expert_parallel"] = self.expert_parallel
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ParallelDims":
        """Inverse of :meth:`to_json`."""
        return cls(pp=int(data["pp"]), dp_replicate=int(data["dp_replicate"]),
                   dp_shard=int(data["dp_shard"]), tp=int(data["tp"]),
                   pipeline_split=tuple(data.get("pipeline_split", ())),
                   virtual_stages=int(data.get("virtual_stages", 1)),
                   expert_parallel=int(data.get("expert_parallel", 1)))
