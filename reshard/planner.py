"""The reshard planner: (source manifest, target layout, options) -> where every byte goes.

Pure: no I/O, no torch. The plan lists, for every target file, its entries (fqn,
target box, dtype) in file order, each cut into *slabs* along dim 0 (consecutive
rows of the target box, so a slab's bytes are contiguous in the target file), and
for each slab the *pieces*: the byte range of a source file to read (widened to the
source's checksum chunks, exactly what is verified) and the global box it supplies.

The safetensors header of every target file is computed here from shapes and dtypes
alone, so the executor writes each file front to back, tensor by tensor. Header
layout follows the safetensors format
(https://github.com/huggingface/safetensors#format): 8-byte little-endian header
length, compact JSON ``{key: {dtype, shape, data_offsets}}`` padded with spaces to
a multiple of 8, then the data; entries ordered like ``safetensors.torch.save``
(dtype alignment descending, then key), so a reshard writes the same bytes as a
save in the target layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from shardsmith.errors import ConfigError, LayoutError
from shardsmith.layout import (
    DTYPE_NBYTES,
    FLOAT_DTYPES,
    Box,
    ModelConfig,
    ParallelDims,
    checkpoint_specs,
    has_optim_state,
    optim_state_of,
    shard_file_name,
    write_assignment,
)
from shardsmith.reshard.slabs import Slab, cut_slabs
from shardsmith.storage import DEFAULT_CHUNK_NBYTES
from shardsmith.storage.formats import encode_header, file_order
from shardsmith.storage.manifest import Manifest, check_model_record
from shardsmith.storage.store import usable_cores

MiB = 1024 * 1024


#: The most threads :func:`default_workers` gives one process: each may also be writing a target
#: file, and a file uploaded to an object store holds up to ``DEFAULT_MAX_CONCURRENCY + 1``
#: parts in memory beyond the read buffer.
MAX_AUTO_WORKERS = 16


def default_workers(cores: int, local: bool, processes: int = 1) -> int:
    """Threads of one reshard process when ``--workers`` is not given.

    Between node-local files the copy is CPU-bound with no latency to hide, so one thread per
    core this process has to itself (``cores // processes``); to or from any other storage
    (object store, network or parallel filesystem) each thread waits on one ranged request at
    a time, so two per core, and at least 4 however few the cores. Never more than
    :data:`MAX_AUTO_WORKERS`. Re-measure: ``python bench/reshard_bench.py --gb 2 --workers N``.

    Args:
        cores: usable CPUs of the node (:func:`usable_cores`).
        local: source and target are both local files.
        processes: reshard processes sharing the node's cores (``--nproc-per-node``).
    """
    share = max(1, cores // max(1, processes))
    return min(MAX_AUTO_WORKERS, share if local else max(4, 2 * share))


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """What a reshard produces and how much memory it may use.

    Attributes:
        dtype: convert floating tensors to this safetensors dtype (``BF16``, ``F16``,
            ``F32``); ``None`` keeps each tensor's saved dtype. ``optim.step.*``
            counters stay as saved (bf16 cannot count past 256 exactly).
        model_only: drop the optimizer state (``optim.*``).
        chunk_nbytes: checksum chunk size of the target, bytes.
        max_buffer_nbytes: bytes of slabs held in memory at once (read-ahead budget).
        workers: I/O threads (reads) and target files written concurrently (between local
            files at most one per core: :meth:`threads`); 0 = from the cores and the storage
            (:func:`default_workers`).
        slab_nbytes: bytes per slab (rows of a tensor shard assembled at once); 0 = an
            eighth of the buffer (so ~4 slabs, each with its read span, are in flight),
            clamped to [1 MiB, 64 MiB].
    """

    dtype: str | None = None
    model_only: bool = False
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES
    max_buffer_nbytes: int = 256 * MiB
    workers: int = 0
    slab_nbytes: int = 0

    def threads(self, local: bool, processes: int = 1) -> int:
        """Read threads to run: :attr:`workers`, at most one per usable core for a copy between
        local files (CPU-bound, no latency to hide: more only contend for the cores); with
        ``workers`` 0, :func:`default_workers` for ``processes`` reshard processes on this node."""
        cores = usable_cores()
        if not self.workers:
            return default_workers(cores, local, processes)
        return max(1, min(self.workers, cores)) if local else self.workers

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"reshard dtype={self.dtype!r}: choose one of {list(FLOAT_DTYPES)}")
        for name in ("chunk_nbytes", "max_buffer_nbytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"reshard {name}={getattr(self, name)}: must be >= 1")
        if self.workers < 0:
            raise ConfigError(
                f"reshard workers={self.workers}: must be >= 1 (or 0: from the cores and the storage)"
            )
        if self.slab_nbytes < 0:
            raise ConfigError(f"reshard slab_nbytes={self.slab_nbytes}: must be >= 0 (0 = auto)")

    @property
    def slab_target_nbytes(self) -> int:
        """Bytes per slab actually planned (see ``slab_nbytes``)."""
        return self.slab_nbytes or max(MiB, min(64 * MiB, self.max_buffer_nbytes // 8))


@dataclass(frozen=True)
class PlanEntry:
    """One tensor shard of a target file: ``fqn``'s ``box`` at ``byte_offset``."""

    fqn: str
    box: Box
    src_dtype: str
    dtype: str
    byte_offset: int
    nbytes: int
    slabs: tuple[Slab, ...]


@dataclass(frozen=True)
class TargetFile:
    """A target shard file: header bytes, then its entries' data in order."""

    name: str
    rank: int
    header: bytes
    entries: tuple[PlanEntry, ...]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(e.nbytes for e in self.entries)


@dataclass
class ReshardPlan:
    """Everything a reshard will do; built by :func:`plan_reshard`, pure data.

    Attributes:
        source: the source manifest.
        dims: the target layout.
        options: the options planned with.
        tensors: target fqn -> (shape, dtype) of every logical tensor written.
        files: target files in rank order.
        dropped: source tensors not in the target (optimizer state with ``model_only``).
    """

    source: Manifest
    dims: ParallelDims
    options: ReshardOptions
    tensors: dict[str, tuple[tuple[int, ...], str]]
    files: list[TargetFile]
    dropped: list[str]

    @property
    def nbytes_write(self) -> int:
        """Bytes of all target files."""
        return sum(f.nbytes for f in self.files)

    @property
    def nbytes_read(self) -> int:
        """Bytes of source data the executor reads (chunk-aligned ranges)."""
        return sum(p.read_nbytes for s in self.slabs() for p in s.pieces)

    @property
    def largest_shard_nbytes(self) -> int:
        """Largest single tensor shard, source or target, bytes."""
        src = max((s.nbytes for t in self.source.tensors.values() for s in t.shards), default=0)
        dst = max((e.nbytes for f in self.files for e in f.entries), default=0)
        return max(src, dst)

    @property
    def peak_buffer_nbytes(self) -> int:
        """Upper bound of the executor's buffer: ``max_buffer`` or one slab if larger."""
        largest = max((s.buffer_nbytes for s in self.slabs()), default=0)
        return max(
            min(self.options.max_buffer_nbytes, sum(s.buffer_nbytes for s in self.slabs())), largest
        )

    def slabs(self) -> list[Slab]:
        return [s for f in self.files for e in f.entries for s in e.slabs]

    @property
    def plan_id(self) -> str:
        """Hash naming what the target files will contain (source identity, layout,
        boxes, headers); a resumed run reuses files only when it is unchanged."""
        h = hashlib.sha256()
        h.update(
            json.dumps(
                {
                    "step": self.source.step,
                    "chunk": self.options.chunk_nbytes,
                    "src": {n: [f.nbytes, f.crc32c] for n, f in sorted(self.source.files.items())},
                },
                sort_keys=True,
            ).encode()
        )
        for f in self.files:
            h.update(f.name.encode() + f.header)
            for e in f.entries:
                h.update(json.dumps([e.fqn, e.box.to_json(), e.src_dtype]).encode())
        return h.hexdigest()[:32]


def target_dtype(fqn: str, saved: str, options: ReshardOptions) -> str:
    """The dtype ``fqn`` is written in: ``options.dtype`` for floats, except step counters."""
    if options.dtype and saved in FLOAT_DTYPES and not optim_state_of(fqn) == "step":
        return options.dtype
    return saved


def _check_source(manifest: Manifest, specs: dict, source_url: str) -> None:
    problems = []
    for fqn, spec in specs.items():
        rec = manifest.tensors.get(fqn)
        if rec is None or tuple(rec.shape) != spec.shape:
            problems.append(
                f"{fqn} is {'missing' if rec is None else tuple(rec.shape)}, "
                f"the model config needs {spec.shape}"
            )
    if problems:
        raise LayoutError(
            f"{source_url}: {len(problems)} tensors do not fit the model config: "
            + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
        )


def plan_reshard(
    manifest: Manifest,
    dims: ParallelDims,
    options: ReshardOptions | None = None,
    source_url: str = "source",
) -> ReshardPlan:
    """Plan the conversion of a checkpoint to layout ``dims``. Pure; any process may call it.

    Target files, their entries and writers come from the sharding plan
    (:func:`shardsmith.layout.sharding.write_assignment`), so the result has the files,
    keys and boxes a job saving directly in ``dims`` would write.

    Args:
        manifest: the source step's manifest.
        dims: target layout.
        options: dtype, model-only, chunk size, buffer (see :class:`ReshardOptions`).
        source_url: used in error messages.

    Returns:
        The :class:`ReshardPlan`.

    Raises:
        LayoutError: ``dims`` does not fit the model (heads, kv heads, FFN width or vocab
            not divisible by tp, layers not splittable into pp stages ...), or a source
            tensor is missing or has the wrong shape.
        CheckpointMismatch: the manifest's model record contradicts its tensors (names the
            fields behind each wrong shape).
    """
    options = options or ReshardOptions()
    check_model_record(manifest, source_url)  # a record that lies names its field
    model = ModelConfig.from_json(manifest.model)
    with_optim = not options.model_only and has_optim_state(manifest.tensors)
    specs = checkpoint_specs(model, dims, with_optimizer=with_optim)  # validates the layout
    _check_source(manifest, specs, source_url)
    specs = {
        fqn: dataclasses.replace(s, dtype=target_dtype(fqn, manifest.tensors[fqn].dtype, options))
        for fqn, s in specs.items()
    }
    files = []
    for rank, items in write_assignment(specs, dims).items():
        if items:
            files.append(_plan_file(manifest, rank, items, specs, options))
    tensors = {fqn: (s.shape, s.dtype) for fqn, s in specs.items()}
    dropped = sorted(set(manifest.tensors) - set(specs))
    return ReshardPlan(manifest, dims, options, tensors, files, dropped)


def _plan_file(
    manifest: Manifest,
    rank: int,
    items: list[tuple[str, Box]],
    specs: dict,
    options: ReshardOptions,
) -> TargetFile:
    """Header and entries of the file written by target ``rank``."""
    items = sorted(items, key=lambda it: file_order(it[0], specs[it[0]].dtype))
    sizes = [
        (fqn, specs[fqn].dtype, box.lengths, box.numel * DTYPE_NBYTES[specs[fqn].dtype])
        for fqn, box in items
    ]
    header, offsets = encode_header(sizes)
    entries = tuple(
        PlanEntry(
            fqn,
            box,
            manifest.tensors[fqn].dtype,
            dtype,
            len(header) + off,
            nbytes,
            cut_slabs(manifest, fqn, box, dtype, options.slab_target_nbytes),
        )
        for (fqn, box), (_, dtype, _, nbytes), off in zip(items, sizes, offsets)
    )
    return TargetFile(shard_file_name(rank), rank, header, entries)
