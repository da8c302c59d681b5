"""Offline resharding: execute a :mod:`~shardsmith.reshard.planner` plan, streaming, resumable.

No process group and no torch (unless ``--dtype`` converts): every target file is
written front to back as a stream (header from the plan, then each tensor's slabs as
they are assembled from verified ranged reads of the source), its checksums computed
on the fly. Reads run ahead on a thread pool within a byte budget, and several target
files are written at once, so I/O overlaps while memory stays bounded:

    peak buffer <= max(max_buffer, the largest single slab)   (see ``Slab.buffer_nbytes``)

a slab being at most one ``max_buffer // 8`` cut of a tensor shard (or one row of it).

Resuming: after each target file, ``<dst step>/.reshard-progress.json`` records its size
and CRC-32C under the plan's id. A rerun of the same plan re-reads and re-checks those
files instead of rewriting them (a file that no longer matches is written again). The
manifest is written last (:func:`shardsmith.storage.commit.commit`), so nothing
half-done ever looks committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any, Callable, Iterator

import crc32c as _crc32c
import numpy as np
from numpy.lib.stride_tricks import as_strided

from shardsmith.errors import CheckpointError, IntegrityError, LayoutError
from shardsmith.reshard.layout import ParallelDims
from shardsmith.reshard.planner import Piece, PlanEntry, ReshardOptions, ReshardPlan, Slab, TargetFile, plan_reshard
from shardsmith.storage.checksum import crc32c
from shardsmith.storage.commit import commit, parse_step_dir, read_manifest, step_dir
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import DTYPE_NBYTES, MANIFEST_NAME, FileRecord, Manifest, ShardRecord, TensorRecord
from shardsmith.storage.verify import check_file_once

log = logging.getLogger(__name__)

PROGRESS_NAME = ".reshard-progress.json"
_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}   # element-size views: dtype-agnostic copies


@dataclass
class ReshardReport:
    """What a reshard did.

    Attributes:
        step, target: the step and the target step directory's URL.
        num_files: target files written; num_skipped: files kept from an interrupted run.
        nbytes_written: bytes written; nbytes_verified: bytes re-read to check kept files.
        nbytes_read / nbytes_needed: source bytes read (chunk-aligned) / bytes used.
        peak_buffer_nbytes: the executor's buffer high-water mark (its accounting).
        seconds: wall time.
    """

    step: int
    target: str
    num_files: int = 0
    num_skipped: int = 0
    nbytes_written: int = 0
    nbytes_verified: int = 0
    nbytes_read: int = 0
    nbytes_needed: int = 0
    peak_buffer_nbytes: int = 0
    seconds: float = 0.0


class BufferBudget:
    """A byte-counting semaphore: a reservation is admitted when it fits in ``capacity``
    or when nothing else is held (so one slab larger than the budget still runs, alone).
    ``peak`` is the high-water mark of bytes held."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, block: bool = True) -> bool:
        """Reserve ``nbytes``; returns False (without reserving) when it does not fit and
        ``block`` is False."""
        with self._cond:
            while self.in_use and self.in_use + nbytes > self.capacity:
                if not block:
                    return False
                self._cond.wait()
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            assert self.in_use >= 0, self.in_use
            self._cond.notify_all()


class ChunkedCrc:
    """CRC-32C of each consecutive ``chunk_nbytes`` piece of a byte stream fed in any
    pieces (equals :func:`shardsmith.storage.checksum.chunk_crc32c` of the whole)."""

    def __init__(self, chunk_nbytes: int) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.done: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_nbytes - self._fill)
            self._crc = crc32c_update(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.chunk_nbytes:
                self.done.append(self._crc)
                self._crc, self._fill = 0, 0

    def finish(self) -> list[int]:
        return self.done + ([self._crc] if self._fill else [])


def crc32c_update(data: Any, value: int) -> int:
    """CRC-32C of ``data`` continuing from the CRC ``value`` of the bytes before it."""
    return int(_crc32c.crc32c(data, value))


def _read_piece(src: Store, manifest: Manifest, piece: Piece) -> bytes:
    """Read a piece's chunk-aligned range and verify every chunk against the manifest
    (and, the first time a file is touched, its size and header).

    Raises:
        IntegrityError: missing, short or oversized file, header or checksum mismatch
            (names the file and byte range).
    """
    shard, chunk_nbytes = piece.shard, manifest.chunk_nbytes
    check_file_once(src, manifest, shard.file)
    data = src.read_range(shard.file, shard.byte_offset + piece.read_start,
                          shard.byte_offset + piece.read_end)
    if len(data) != piece.read_nbytes:
        raise IntegrityError(f"{src.url_of(shard.file)}: truncated — expected {piece.read_nbytes} bytes "
                             f"at offset {shard.byte_offset + piece.read_start}, got {len(data)}; "
                             "restore the file or reshard another step")
    view = memoryview(data)
    for i in range(0, len(data), chunk_nbytes):
        c = (piece.read_start + i) // chunk_nbytes
        if crc32c(view[i:i + chunk_nbytes]) != shard.crc32c[c]:
            raise IntegrityError(f"{src.url_of(shard.file)}: checksum mismatch in {shard.key!r} bytes "
                                 f"[{c * chunk_nbytes}, {c * chunk_nbytes + len(view[i:i + chunk_nbytes])}) "
                                 "— the file is corrupt; restore it or reshard another step")
    return data


def assemble_slab(src: Store, manifest: Manifest, slab: Slab, entry: PlanEntry) -> np.ndarray:
    """The slab's bytes in the target dtype, as a contiguous 1-d ``uint8`` array.

    Each piece is read, verified, and copied through a strided view of the source
    shard's row-major storage into the slab; pieces are read one at a time.
    """
    itemsize = DTYPE_NBYTES[entry.src_dtype]
    raw = _RAW[itemsize]
    out = np.empty(slab.box.lengths, dtype=raw)
    for piece in slab.pieces:
        data = _read_piece(src, manifest, piece)
        seg = np.frombuffer(data, dtype=np.uint8, count=piece.last - piece.first,
                            offset=piece.first - piece.read_start).view(raw)
        strides = [itemsize] * len(piece.saved.lengths)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * piece.saved.lengths[d + 1]
        out[piece.common.relative_to(slab.box)] = as_strided(seg, piece.common.lengths, strides,
                                                             writeable=False)
        del data, seg
    if entry.dtype != entry.src_dtype:
        out = convert_dtype(out, entry.src_dtype, entry.dtype)
    return out.reshape(-1).view(np.uint8)


def convert_dtype(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Convert raw elements between float dtypes with torch's rounding (round to nearest
    even), returning raw elements of ``dst``. Imports torch only when called."""
    import torch

    from shardsmith.storage.shards import TORCH_DTYPES

    converted = torch.from_numpy(raw).view(TORCH_DTYPES[src]).to(TORCH_DTYPES[dst])
    return converted.view(torch.uint8).numpy().view(_RAW[DTYPE_NBYTES[dst]])


@dataclass
class FileResult:
    """A finished target file: its manifest records; ``written`` False when kept."""

    name: str
    record: FileRecord
    shards: dict[str, ShardRecord]
    written: bool


class _Stopped(Exception):
    """Another file failed; this one stops early."""


@dataclass
class _Executor:
    """Runs one plan: file tasks on ``files`` threads, slab reads on ``reads`` threads."""

    plan: ReshardPlan
    src: Store
    dst: Store
    progress: Callable[[int], None] | None = None
    report: ReshardReport = field(default_factory=lambda: ReshardReport(0, ""))
    budget: BufferBudget = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reads: ThreadPoolExecutor | None = None

    def __post_init__(self) -> None:
        self.budget = BufferBudget(self.plan.options.max_buffer_nbytes)

    def _count(self, **deltas: int) -> None:
        with self.lock:
            for name, value in deltas.items():
                setattr(self.report, name, getattr(self.report, name) + value)
        done = deltas.get("nbytes_written", 0) + deltas.get("nbytes_verified", 0)
        if self.progress is not None and done:
            self.progress(done)

    def _read(self, slab: Slab, entry: PlanEntry) -> np.ndarray:
        data = assemble_slab(self.src, self.plan.source, slab, entry)
        self._count(nbytes_read=sum(p.read_nbytes for p in slab.pieces), nbytes_needed=slab.src_nbytes)
        return data

    def run_file(self, tf: TargetFile, kept: dict[str, Any] | None) -> FileResult:
        """Keep ``tf`` if a previous run finished it and it still checks out, else write it."""
        if kept is not None:
            result = self._verify(tf, kept)
            if result is not None:
                return result
        return self._write(tf)

    def _write(self, tf: TargetFile) -> FileResult:
        crcs = [ChunkedCrc(self.plan.options.chunk_nbytes) for _ in tf.entries]
        file_crc = crc32c(tf.header)
        with target_stream(self.dst, tf.name, tf.nbytes) as f:
            f.write(tf.header)
            for i, data in self._slab_stream(tf):
                f.write(data)
                crcs[i].update(data)
                file_crc = crc32c_update(data, file_crc)
                self._count(nbytes_written=len(data))
                del data
        self._count(num_files=1, nbytes_written=len(tf.header))
        return FileResult(tf.name, FileRecord(tf.nbytes, file_crc), _records(tf, crcs), True)

    def _slab_stream(self, tf: TargetFile):  # type: ignore[no-untyped-def]
        """Yield (entry index, slab bytes) in file order, reading ahead within the budget."""
        assert self.reads is not None
        work = deque((i, s) for i, e in enumerate(tf.entries) for s in e.slabs)
        pending: deque[tuple[int, int, Future]] = deque()
        try:
            while work or pending:
                while work and self.budget.acquire(work[0][1].buffer_nbytes, block=not pending):
                    i, slab = work.popleft()
                    pending.append((i, slab.buffer_nbytes,
                                    self.reads.submit(self._read, slab, tf.entries[i])))
                i, cost, fut = pending.popleft()
                try:
                    data = fut.result()
                    if self.stop.is_set():
                        raise _Stopped()
                    yield i, data
                finally:
                    data = None
                    self.budget.release(cost)
        finally:
            for _, cost, fut in pending:
                fut.cancel()
                if not fut.cancelled():
                    fut.exception()                    # wait: its buffer is still held
                self.budget.release(cost)

    def _verify(self, tf: TargetFile, kept: dict[str, Any]) -> FileResult | None:
        """Re-read a file a previous run finished; its records if size and CRC-32C still
        match, else ``None`` (it will be written again)."""
        try:
            size = self.dst.size(tf.name)
        except FileNotFoundError:
            size = -1
        if size != tf.nbytes or kept.get("nbytes") != tf.nbytes:
            log.warning("%s: %d bytes, expected %d; writing it again", self.dst.url_of(tf.name), size, tf.nbytes)
            return None
        chunk = self.plan.options.chunk_nbytes
        header = self.dst.read_range(tf.name, 0, len(tf.header))
        file_crc, crcs = crc32c(header), [ChunkedCrc(chunk) for _ in tf.entries]
        for i, e in enumerate(tf.entries):
            for start in range(e.byte_offset, e.byte_offset + e.nbytes, chunk):
                end = min(start + chunk, e.byte_offset + e.nbytes)
                self.budget.acquire(end - start)
                try:
                    data = self.dst.read_range(tf.name, start, end)
                    crcs[i].update(data)
                    file_crc = crc32c_update(data, file_crc)
                finally:
                    self.budget.release(end - start)
                self._count(nbytes_verified=end - start)
        if header != tf.header or file_crc != kept.get("crc32c"):
            log.warning("%s: checksum differs from the interrupted run's; writing it again",
                        self.dst.url_of(tf.name))
            return None
        self._count(num_skipped=1, nbytes_verified=len(header))
        return FileResult(tf.name, FileRecord(tf.nbytes, file_crc), _records(tf, crcs), False)

    def run(self, on_file_done: Callable[[str], None] | None) -> list[FileResult]:
        """Every target file, ``workers`` at a time; progress saved after each."""
        kept = _load_progress(self.dst, self.plan.plan_id)
        results: dict[str, FileResult] = {}
        workers = self.plan.options.workers
        with ThreadPoolExecutor(workers, "reshard-read") as reads, \
                ThreadPoolExecutor(max(1, min(workers, len(self.plan.files))), "reshard-file") as files:
            self.reads = reads
            futures = {files.submit(self.run_file, tf, kept.get(tf.name)): tf for tf in self.plan.files}
            try:
                for fut in as_completed(futures):
                    result = fut.result()
                    results[result.name] = result
                    _save_progress(self.dst, self.plan.plan_id, results)
                    if on_file_done is not None:
                        on_file_done(result.name)
            except BaseException:
                self.stop.set()
                for fut in futures:
                    fut.cancel()
                raise
        self.report.peak_buffer_nbytes = self.budget.peak
        return [results[tf.name] for tf in self.plan.files]


@contextlib.contextmanager
def target_stream(dst: Store, key: str, nbytes: int) -> Iterator[IO[bytes]]:
    """A file to write ``key`` front to back; it appears only when the block exits cleanly.

    :meth:`Store.open_writer`: local, a hidden temporary file renamed into place; S3, a
    multipart upload of parallel, individually retried parts (sized for ``nbytes``),
    completed on success and aborted on error; other backends, fsspec's file committed
    on success.
    """
    with dst.open_writer(key, nbytes_hint=nbytes) as f:
        yield f


def _records(tf: TargetFile, crcs: list[ChunkedCrc]) -> dict[str, ShardRecord]:
    return {e.fqn: ShardRecord(offsets=list(e.box.offsets), lengths=list(e.box.lengths), file=tf.name,
                               key=e.fqn, byte_offset=e.byte_offset, nbytes=e.nbytes, crc32c=c.finish())
            for e, c in zip(tf.entries, crcs)}


def _load_progress(dst: Store, plan_id: str) -> dict[str, dict[str, Any]]:
    """Files an interrupted run of the same plan finished: name -> {nbytes, crc32c}."""
    try:
        data = json.loads(dst.read(PROGRESS_NAME))
    except FileNotFoundError:
        return {}
    except ValueError:
        log.warning("%s is unreadable; starting over", dst.url_of(PROGRESS_NAME))
        return {}
    if not isinstance(data, dict) or data.get("plan_id") != plan_id or not isinstance(data.get("files"), dict):
        log.warning("%s belongs to a different reshard (source, layout or options changed); "
                    "starting over", dst.url_of(PROGRESS_NAME))
        return {}
    log.info("resuming: %d target files already written by an interrupted run", len(data["files"]))
    return {k: v for k, v in data["files"].items() if isinstance(v, dict)}


def _save_progress(dst: Store, plan_id: str, results: dict[str, FileResult]) -> None:
    files = {name: {"nbytes": r.record.nbytes, "crc32c": r.record.crc32c} for name, r in results.items()}
    dst.write(PROGRESS_NAME, json.dumps({"plan_id": plan_id, "files": files}, indent=1).encode())


def build_manifest(plan: ReshardPlan, results: list[FileResult]) -> Manifest:
    """The target manifest: the source's configs and state, the plan's tensors, the files' records."""
    src = plan.source
    tensors = {fqn: TensorRecord(shape=list(shape), dtype=dtype) for fqn, (shape, dtype) in plan.tensors.items()}
    files: dict[str, FileRecord] = {}
    for r in results:
        files[r.name] = r.record
        for fqn, rec in r.shards.items():
            tensors[fqn].shards.append(rec)
    for t in tensors.values():
        t.shards.sort(key=lambda s: s.offsets)
    config = dict(src.config)
    if "parallel" in config:
        config["parallel"] = plan.dims.to_json()
    return Manifest(step=src.step, layout={**plan.dims.to_json(), "world_size": plan.dims.world_size},
                    model=src.model, config=config, state=src.state, tensors=tensors, files=files,
                    chunk_nbytes=plan.options.chunk_nbytes,
                    created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def execute(plan: ReshardPlan, src: Store, dst_root: Store, *,
            progress: Callable[[int], None] | None = None,
            on_file_done: Callable[[str], None] | None = None) -> ReshardReport:
    """Write and commit ``plan`` under ``dst_root`` (``<dst_root>/step-NNNNNNNNN``).

    Args:
        plan: from :func:`shardsmith.reshard.planner.plan_reshard`.
        src: the source step directory.
        dst_root: the target checkpoint root.
        progress: called with byte increments (written or re-verified) from worker threads.
        on_file_done: called with each finished file's name after its progress is saved.

    Raises:
        CheckpointError: the target step is already committed.
        IntegrityError: a source byte does not match its checksum.
        StorageError / OSError: reading or writing failed; a rerun resumes.
    """
    t0 = time.perf_counter()
    dst = dst_root.child(step_dir(plan.source.step))
    if dst.exists(MANIFEST_NAME):
        raise CheckpointError(f"{dst.url} is already a committed checkpoint; delete it or choose "
                              "another target")
    executor = _Executor(plan, src, dst, progress, ReshardReport(plan.source.step, dst.url))
    results = executor.run(on_file_done)
    manifest = build_manifest(plan, results)
    wanted = {posixpath.basename(tf.name) for tf in plan.files}
    for name in dst.list_dir("shards"):
        if name not in wanted:                                      # left by an earlier, other plan
            dst.delete(f"shards/{name}")
    commit(dst_root, manifest)          # validates coverage and file sizes, then writes the manifest
    dst.delete(PROGRESS_NAME)
    executor.report.seconds = time.perf_counter() - t0
    return executor.report


def split_step_url(url: str) -> tuple[str, int | None]:
    """``/x/run/step-000000040`` -> (``/x/run``, 40); a root URL gives (url, None)."""
    url = url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    step = parse_step_dir(name)
    return (url[: -len(name) - 1] or "/", step) if step is not None else (url, None)


def target_root(dst_url: str, step: int, storage_options: dict | None = None) -> Store:
    """The root store of a target given as a root or as ``.../step-NNNNNNNNN`` of ``step``.

    Raises:
        LayoutError: the URL names another step.
    """
    root_url, dst_step = split_step_url(dst_url)
    if dst_step is not None and dst_step != step:
        raise LayoutError(f"target {dst_url} names step {dst_step} but the source is step {step}; "
                          f"name the target {step_dir(step)} or give its root")
    return Store(root_url, storage_options)


def reshard(src: Store, dst_url: str, dims: ParallelDims, *, options: ReshardOptions | None = None,
            storage_options: dict | None = None, progress: Callable[[int], None] | None = None,
            on_file_done: Callable[[str], None] | None = None) -> ReshardReport:
    """Write the checkpoint in step directory ``src`` again under layout ``dims`` and commit it.

    Args:
        src: the source step directory (committed).
        dst_url: target step directory (``.../step-NNNNNNNNN``, the source's step) or a root.
        dims: target layout.
        options: dtype, model-only, buffer, workers (:class:`ReshardOptions`).
        storage_options: fsspec options of the target.
        progress, on_file_done: see :func:`execute`.

    Returns:
        A :class:`ReshardReport`.

    Raises:
        LayoutError: ``dims`` does not fit the model, or ``dst_url`` names another step.
        CheckpointNotFound / ManifestError / IntegrityError: bad source.
        CheckpointError: the target is already committed.
    """
    manifest = read_manifest(src)
    plan = plan_reshard(manifest, dims, options, src.url)
    return execute(plan, src, target_root(dst_url, manifest.step, storage_options),
                   progress=progress, on_file_done=on_file_done)
