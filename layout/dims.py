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
* :data:`MESH_AXIS_TABLE` is the one list of mesh axes: adding an axis is one row there and
  one field of :class:`ParallelDims` (``tests`` check the two agree); every other module
  iterates :data:`MESH_AXES` instead of spelling axes out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from math import prod
from typing import Any

from shardsmith.errors import ConfigError, LayoutError


class MeshAxisName(str, enum.Enum):
    """A mesh axis's name, typed (as torchtitan's ``MeshAxisName``). Members are strings:
    they compare, hash, format and serialize as the plain name, so dicts, manifests and
    ``DeviceMesh`` dim names keyed by either agree (member names equal their values for that)."""

    pp = "pp"
    dp_replicate = "dp_replicate"
    dp_shard = "dp_shard"
    cp = "cp"
    tp = "tp"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh.

    Attributes:
        name: the :class:`ParallelDims` field and the ``DeviceMesh`` dim name.
        short: its prefix in layout names (:meth:`ParallelDims.describe`).
        optional: named in layout names, manifests and the short form only when its degree
            is not 1, so layouts without it keep the names and bytes they always had.
    """

    name: MeshAxisName
    short: str
    optional: bool = False


#: The mesh axes, major to minor (tp innermost so TP groups are neighbouring ranks).
#: Expert parallelism is not an axis: it is carved out of ``dp_shard`` (see
#: :attr:`ParallelDims.expert_parallel`); virtual pipeline stages neither.
MESH_AXIS_TABLE: tuple[MeshAxis, ...] = (
    MeshAxis(MeshAxisName.pp, "pp"),
    MeshAxis(MeshAxisName.dp_replicate, "dpr"),
    MeshAxis(MeshAxisName.dp_shard, "dps"),
    MeshAxis(MeshAxisName.cp, "cp", optional=True),
    MeshAxis(MeshAxisName.tp, "tp"),
)
#: The axes FSDP2 shards parameters over, flattened in this order into one mesh dim named
#: :data:`FSDP_MESH_DIM` (torchtitan's ``dp_shard_cp``): parameters are replicated over
#: ``cp`` for compute, so sharding them over it too costs nothing and keeps every
#: checkpoint box a function of ``dp_shard * cp`` alone.
FSDP_AXES: tuple[str, ...] = (MeshAxisName.dp_shard, MeshAxisName.cp)
FSDP_MESH_DIM = "dp_shard_cp"
#: Mesh axis names in :data:`MESH_AXIS_TABLE` order.
MESH_AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXIS_TABLE)
#: Fields a layout name spells after the mesh axes when above 1, with their prefixes.
EXTRA_NAME_PARTS: tuple[tuple[str, str], ...] = (("virtual_stages", "v"), ("expert_parallel", "ep"))
#: Axes every layout name, manifest and short form spells (the non-optional ones).
REQUIRED_AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXIS_TABLE if not a.optional)
#: How model chunks are laid on pipeline ranks (torch's ``generate_stage_to_rank_mapping``
#: styles): ``loop`` (Megatron's interleaving) or ``v`` (ZB-V, DualPipeV).
PIPELINE_STYLES: tuple[str, ...] = ("loop", "v")
#: The layout name's last part for ``pipeline_style="v"`` (after the virtual stages).
V_STYLE_NAME_PART = "vshape"


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of the mesh axes (:data:`MESH_AXIS_TABLE`); the world size is their product.

    Attributes:
        pp: pipeline stages.
        dp_replicate: data-parallel replicas (DDP/HSDP replication).
        dp_shard: data-parallel shards (FSDP2 ZeRO-3 sharding).
        cp: context-parallel degree: each rank of a cp group holds a slice of every
            sequence (load-balanced causal chunks, :mod:`shardsmith.trainer.context_parallel`);
            parameters are replicated over it and FSDP shards over ``dp_shard * cp``.
        tp: tensor-parallel degree (innermost: neighbouring ranks).
        pipeline_split: layers per model chunk, one int per chunk (``pp * virtual_stages``
            of them) summing to num_layers; empty = as even as possible, earlier chunks
            taking the remainder.
        virtual_stages: model chunks per pipeline rank (Megatron's virtual pipeline, the
            interleaved 1F1B schedule of Narayanan et al. 2021): rank ``r`` holds chunks
            ``r, r + pp, r + 2*pp, ...``. Not a mesh axis: it moves layers between pipeline
            ranks, never changes a tensor's box or name.
        pipeline_style: ``loop`` (the above) or ``v``: the V shape of the ZB-V and
            DualPipeV schedules (Qi et al. 2024 sec. 6; DeepSeek-V3 report sec. 3.2.1), rank
            ``r`` holding chunks ``r, 2*pp - 1 - r``, then ``2*pp + r, 4*pp - 1 - r``, ...
            (torch's ``generate_stage_to_rank_mapping(style="v")``): pipeline rank 0 holds
            the first and the last chunk. Needs ``virtual_stages >= 2``; like virtual
            stages it moves layers between ranks, never a tensor's box or name.
        expert_parallel: expert-parallel degree, carved out of the dp_shard ranks (1 or
            ``dp_shard``): each rank holds ``E / ep`` whole experts, the box FSDP2 would give
            it along the expert dim, so checkpoints do not change; tokens reach their experts
            by all-gather over the group (Megatron's ``allgather`` token dispatcher).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pipeline_split: tuple[int, ...] = field(default=())
    virtual_stages: int = 1
    expert_parallel: int = 1
    pipeline_style: str = "loop"

    def __post_init__(self) -> None:
        for axis in (*MESH_AXES, "virtual_stages", "expert_parallel"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{axis}={value!r}: must be an integer >= 1")
        if self.virtual_stages > 1 and self.pp < 2:
            raise ConfigError(
                f"virtual_stages={self.virtual_stages} needs pp >= 2 (interleaved "
                "pipeline chunks live on different pipeline ranks)"
            )
        if self.pipeline_style not in PIPELINE_STYLES or (
            self.pipeline_style == "v" and self.virtual_stages < 2
        ):
            raise ConfigError(
                f"pipeline_style={self.pipeline_style!r}: use 'loop', or 'v' with "
                f"virtual_stages >= 2 (virtual_stages={self.virtual_stages})"
            )
        if self.expert_parallel not in (1, self.dp_shard) or (
            self.expert_parallel > 1 and self.dp_replicate > 1
        ):
            raise ConfigError(
                f"expert_parallel={self.expert_parallel}: expert parallelism is carved out of the "
                f"FSDP ranks; use 1 or dp_shard={self.dp_shard}, with dp_replicate=1"
            )
        if self.expert_parallel > 1 and self.cp > 1:
            raise ConfigError(
                f"expert_parallel={self.expert_parallel} with cp={self.cp}: expert parallelism "
                "does not compose with context parallelism yet; use one of them"
            )
        self.pipeline_split = tuple(int(n) for n in self.pipeline_split)
        if self.pipeline_split and len(self.pipeline_split) != self.num_chunks:
            raise ConfigError(
                f"pipeline_split={','.join(map(str, self.pipeline_split))} has "
                f"{len(self.pipeline_split)} stages but pp={self.pp} x virtual_stages="
                f"{self.virtual_stages} needs {self.num_chunks}"
            )

    @property
    def num_chunks(self) -> int:
        """Pipeline model chunks ``pp * virtual_stages`` (the schedule's stages)."""
        return self.pp * self.virtual_stages

    def chunk_ids(self, pp_rank: int) -> tuple[int, ...]:
        """Model chunks pipeline rank ``pp_rank`` holds, ascending: ``r, r + pp, ...``
        (Megatron's order) or, with ``pipeline_style="v"``, ``r, 2*pp - 1 - r, ...``."""
        if self.pipeline_style == "loop":
            return tuple(range(pp_rank, self.num_chunks, self.pp))
        return tuple(
            k * self.pp + (pp_rank if k % 2 == 0 else self.pp - 1 - pp_rank)
            for k in range(self.virtual_stages)
        )

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank holding model chunk ``chunk`` (inverse of :meth:`chunk_ids`).

        Raises:
            ValueError: ``chunk`` is outside ``range(num_chunks)``.
        """
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk} outside range({self.num_chunks})")
        k, j = divmod(chunk, self.pp)
        return j if self.pipeline_style == "loop" or k % 2 == 0 else self.pp - 1 - j

    @property
    def world_size(self) -> int:
        """Number of ranks: the product of every mesh axis's degree."""
        return prod(self.shape)

    @property
    def dp(self) -> int:
        """Total data-parallel degree ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Degree FSDP2 shards parameters over: ``dp_shard * cp`` (:data:`FSDP_AXES`)."""
        return self.dp_shard * self.cp

    def fsdp_index(self, coords: dict[str, int]) -> int:
        """Index of ``coords`` along the flattened :data:`FSDP_AXES` (``dp_shard`` major)."""
        return coords["dp_shard"] * self.cp + coords.get("cp", 0)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_AXES` order."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def dp_rank(self, coords: dict[str, int]) -> int:
        """Data-parallel rank of mesh coordinates: which slice of each global batch they feed
        (``dp_replicate`` major, ``dp_shard`` minor), in ``range(dp)``."""
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

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
        """Global rank of mesh coordinates (inverse of :meth:`coords`); an optional axis
        missing from ``coords`` is at 0."""
        rank = 0
        for axis, size in zip(MESH_AXES, self.shape):
            rank = rank * size + (
                coords.get(axis, 0) if axis not in REQUIRED_AXES else coords[axis]
            )
        return rank

    @classmethod
    def for_world_size(
        cls,
        world_size: int,
        *,
        dp_shard: int = -1,
        pipeline_split: tuple[int, ...] = (),
        virtual_stages: int = 1,
        expert_parallel: int = 1,
        pipeline_style: str = "loop",
        **axes: int,
    ) -> "ParallelDims":
        """The layout of a job with ``world_size`` ranks; ``dp_shard=-1`` takes the rest.

        ``axes`` are the degrees of the other mesh axes (``tp=2, pp=4``; absent ones are 1).
        ``dp_shard = world_size / (product of the others)`` when it is -1 (the others stay as
        given); otherwise the product of all must equal ``world_size``.

        Raises:
            LayoutError: the world size is not a multiple of the other axes' product, or
                the fixed degrees need another world size (the message says what fits).
            ConfigError: a degree is not an integer >= 1 (or -1 for ``dp_shard``), or an
                unknown axis is named.
        """
        unknown = sorted(set(axes) - set(MESH_AXES))
        if unknown:
            raise ConfigError(f"unknown mesh axes {unknown}; known: {list(MESH_AXES)}")
        if dp_shard == -1:
            fixed = prod(axes.values())
            shown = [
                a
                for a in MESH_AXES
                if a != "dp_shard" and (a in REQUIRED_AXES or axes.get(a, 1) != 1)
            ]
            if fixed < 1 or world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not a multiple of {'*'.join(shown)}={fixed} "
                    f"({', '.join(f'{a}={axes.get(a, 1)}' for a in shown)}); run on a multiple "
                    f"of {fixed} processes"
                )
            dp_shard = world_size // fixed
        parallel = cls(
            **axes,
            dp_shard=dp_shard,
            pipeline_split=pipeline_split,
            virtual_stages=virtual_stages,
            expert_parallel=expert_parallel,
            pipeline_style=pipeline_style,
        )
        parallel.check_world_size(world_size)
        return parallel

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`~shardsmith.errors.LayoutError` unless this layout has ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(
                f"layout {self.describe()} needs {self.world_size} processes but the job has "
                f"{world_size}; run {self.world_size} processes, or pass --dp-shard -1 to "
                "let dp_shard follow the world size"
            )

    def describe(self) -> str:
        """The layout name, e.g. ``pp2·dpr1·dps1·tp2``, then virtual stages and expert
        parallelism when above 1 (``pp2·dpr1·dps4·tp1·ep4``), then ``vshape`` for the V
        pipeline style (``pp2·dpr1·dps1·tp1·v2·vshape``; :meth:`parse` reads it back;
        the pipeline split is not part of the name)."""
        parts = [
            f"{a.short}{getattr(self, a.name)}"
            for a in MESH_AXIS_TABLE
            if not a.optional or getattr(self, a.name) != 1
        ]
        parts += [
            f"{short}{getattr(self, name)}"
            for name, short in EXTRA_NAME_PARTS
            if getattr(self, name) > 1
        ]
        if self.pipeline_style == "v":
            parts.append(V_STYLE_NAME_PART)
        return "·".join(parts)

    @classmethod
    def parse(cls, name: str) -> "ParallelDims":
        """Inverse of :meth:`describe`; also takes the short form ``pp.dpr.dps.tp``
        (``1.1.2.2``) and ``.`` or ``,`` between the named parts.

        Raises:
            ConfigError: ``name`` is neither form (the message shows both).
        """
        parts = [p.strip() for p in name.replace("·", ".").replace(",", ".").split(".")]
        sizes: dict[str, Any] = {}  # axis -> degree
        if all(p.isdigit() for p in parts) and len(parts) in (len(REQUIRED_AXES), len(MESH_AXES)):
            axes = REQUIRED_AXES if len(parts) == len(REQUIRED_AXES) else MESH_AXES
            sizes = {axis: int(p) for axis, p in zip(axes, parts)}
        else:
            rest = list(parts)
            for a in MESH_AXIS_TABLE:  # in table order; optional axes may be absent
                if rest and rest[0].startswith(a.short) and rest[0][len(a.short) :].isdigit():
                    sizes[a.name] = int(rest.pop(0)[len(a.short) :])
                elif not a.optional:
                    sizes = {}
                    break
            for field_name, short in EXTRA_NAME_PARTS if sizes else ():
                if rest and rest[0].startswith(short) and rest[0][len(short) :].isdigit():
                    sizes[field_name] = int(rest.pop(0)[len(short) :])
            if sizes and rest == [V_STYLE_NAME_PART]:
                rest.pop()
                sizes["pipeline_style"] = "v"
            sizes = sizes if not rest else {}
        if not sizes:
            raise ConfigError(
                f"layout name {name!r}: expected e.g. 'pp2·dpr1·dps1·tp2' or its short "
                f"form '2.1.1.2' ({'.'.join(REQUIRED_AXES)}, or all of "
                f"{'.'.join(MESH_AXES)})"
            )
        return cls(**sizes)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict of every field (optional axes, ``virtual_stages`` and
        ``expert_parallel`` only when not 1, ``pipeline_style`` only when not ``loop``, so
        layouts without them write the bytes they always wrote)."""
        out: dict[str, Any] = {
            a.name: getattr(self, a.name)
            for a in MESH_AXIS_TABLE
            if not a.optional or getattr(self, a.name) != 1
        }
        out["pipeline_split"] = list(self.pipeline_split)
        if self.virtual_stages > 1:
            out["virtual_stages"] = self.virtual_stages
        if self.expert_parallel > 1:
            out["expert_parallel"] = self.expert_parallel
        if self.pipeline_style != "loop":
            out["pipeline_style"] = self.pipeline_style
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ParallelDims":
        """Inverse of :meth:`to_json` (a missing optional axis is 1)."""
        axes = {
            a.name: int(data[a.name] if not a.optional else data.get(a.name, 1))
            for a in MESH_AXIS_TABLE
        }
        return cls(
            **axes,
            pipeline_split=tuple(data.get("pipeline_split", ())),
            virtual_stages=int(data.get("virtual_stages", 1)),
            expert_parallel=int(data.get("expert_parallel", 1)),
            pipeline_style=str(data.get("pipeline_style", "loop")),
        )
