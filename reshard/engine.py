"""Offline resharding: execute a :mod:`~shardsmith.reshard.planner` plan, streaming, resumable.

No process group and no torch (unless ``--dtype`` converts): each tensor's slabs are
assembled from verified ranged reads of the source on a thread pool, within a byte budget;
a local target file gets them written at their offsets by those threads (a slab that is a
run of a source file read, verified and written block by block), any other is streamed.
Checksums are computed on the fly; several target files are written at once:

    peak buffer <= max(max_buffer, the largest single slab)   (see ``Slab.buffer_nbytes``)

a slab being at most one ``max_buffer // 8`` cut of a tensor shard (or one row of it).

Resuming: a rerun of the same plan re-checks the files an interrupted run finished
(:mod:`shardsmith.reshard.progress`). The manifest is written last
(:func:`shardsmith.storage.commit.commit`), so nothing half-done ever looks committed.

Scale-out: several processes (torchrun, or ``--nproc-per-node``) each convert a share of
the target files and rank 0 commits (:mod:`shardsmith.reshard.scaleout`).
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator

import numpy as np

import shardsmith.storage.formats.safetensors as safetensors
from shardsmith.reshard.planner import PlanEntry, ReshardPlan, TargetFile
from shardsmith.reshard.posix_copy import copy_slab_verified, write_assembled_at, write_slab_at
from shardsmith.reshard.progress import PROGRESS_NAME, ReshardReport, load_progress, save_progress
from shardsmith.reshard.scaleout import Share, assign_files, cleanup, gather, publish
from shardsmith.reshard.slabs import Slab
from shardsmith.reshard.stream import BufferBudget, BufferPool, FileResult, assemble_slab
from shardsmith.storage import (
    ChunkedCrc,
    crc32c,
    crc32c_update,
    ensure_not_committed,
    rewritten_state,
    step_dir,
)
from shardsmith.storage.commit import commit
from shardsmith.storage.manifest import (
    FileRecord,
    Manifest,
    ManifestBuilder,
    ShardRecord,
    sidecar_name,
    write_sidecar,
)
from shardsmith.storage.store import Store, preallocate, sweep_stale_tmp

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """Another file failed; this one stops early."""


@dataclass
class _Executor:
    """Runs one plan: file tasks on ``files`` threads, slab reads on ``reads`` threads."""

    plan: ReshardPlan
    src: Store
    dst: Store
    files: list[TargetFile]
    progress_name: str
    progress: Callable[[int], None] | None = None
    report: ReshardReport = field(default_factory=lambda: ReshardReport(0, ""))
    budget: BufferBudget = field(init=False)
    pool: BufferPool = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reads: ThreadPoolExecutor | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.budget = BufferBudget(self.plan.options.max_buffer_nbytes)
        self.pool = BufferPool(self.plan.options.max_buffer_nbytes)

    def _count(self, **deltas: int) -> None:
        with self.lock:
            for name, value in deltas.items():
                setattr(self.report, name, getattr(self.report, name) + value)
        done = deltas.get("nbytes_written", 0) + deltas.get("nbytes_verified", 0)
        if self.progress is not None and done:
            self.progress(done)

    def _read(
        self, slab: Slab, entry: PlanEntry
    ) -> tuple[np.ndarray, np.ndarray | None, list[int] | None]:
        """(slab bytes, pool buffer to give back, their chunk CRCs when the verified source's serve)."""
        out = assemble_slab(
            self.src, self.plan.source, slab, entry, self.pool, self.plan.options.chunk_nbytes
        )
        self._count(
            nbytes_read=sum(p.read_nbytes for p in slab.pieces), nbytes_needed=slab.src_nbytes
        )
        return out

    def run_file(self, tf: TargetFile, kept: dict[str, Any] | None) -> FileResult:
        """Keep ``tf`` if a previous run finished it and it still checks out, else write it."""
        if kept is not None:
            result = self._verify(tf, kept)
            if result is not None:
                return result
        return self._write(tf)

    def _write(self, tf: TargetFile) -> FileResult:
        if self.dst.local_path(tf.name) is not None:
            return self._write_at_offsets(tf)

        def counted() -> Iterator[tuple[int, np.ndarray, list[int] | None]]:
            for i, data, known in self._slab_stream(tf):
                yield i, data, known
                self._count(nbytes_written=len(data))

        record, crcs = safetensors.write_stream(
            self.dst,
            tf.name,
            tf.header,
            counted(),
            len(tf.entries),
            self.plan.options.chunk_nbytes,
            tf.nbytes,
        )
        self._count(num_files=1, nbytes_written=len(tf.header))
        shards = _records(tf, crcs)
        return FileResult(tf.name, record, shards, True, write_sidecar(self.dst, tf.name, shards))

    def _write_at_offsets(self, tf: TargetFile) -> FileResult:
        """A local target file: each slab is written at its offset by the read thread that read
        it (``pwrite``), several at once, so the copies of one file use every
        core; this thread only combines the slabs' chunk CRCs in file order. The file appears
        (renamed into place) only when every slab is written."""
        chunk = self.plan.options.chunk_nbytes
        crcs = [ChunkedCrc(chunk) for _ in tf.entries]
        with self.dst.open_writer(tf.name) as f:
            f.write(tf.header)
            f.flush()
            os.ftruncate(f.fileno(), tf.nbytes)
            preallocate(
                f.fileno(), tf.nbytes, self.dst.url_of(tf.name)
            )  # ENOSPC now, not gigabytes in
            slabs = self._slab_stream(
                tf, functools.partial(self._read_and_write, f.fileno(), threading.Lock())
            )
            try:
                for i, pieces, nbytes in slabs:
                    crcs[i].add(pieces)
                    self._count(nbytes_written=nbytes)
            finally:
                slabs.close()  # waits for the slabs in flight: none writes after the file closes
        file_crc = crc32c(tf.header)
        for c in crcs:
            file_crc = c.extend_crc(file_crc)
        self._count(num_files=1, nbytes_written=len(tf.header))
        shards = _records(tf, [c.finish() for c in crcs])
        return FileResult(
            tf.name,
            FileRecord(nbytes=tf.nbytes, crc32c=file_crc),
            shards,
            True,
            write_sidecar(self.dst, tf.name, shards),
        )

    def _read_and_write(
        self, out: int, lock: Any, slab: Slab, entry: PlanEntry
    ) -> tuple[list[tuple[int, int]], None, int]:
        """Task of :meth:`_write_at_offsets`: (the slab's CRC pieces, no buffer, bytes written)."""
        chunk = self.plan.options.chunk_nbytes
        pieces = copy_slab_verified(self.src, self.plan.source, slab, entry, out, chunk, lock)
        if pieces is None:
            pieces = write_assembled_at(
                self.src, self.plan.source, slab, entry, out, chunk, self.pool, lock
            )
        if pieces is not None:
            self._count(
                nbytes_read=sum(p.read_nbytes for p in slab.pieces), nbytes_needed=slab.src_nbytes
            )
            return pieces, None, slab.nbytes
        data, buf, known = self._read(slab, entry)
        try:
            pieces = write_slab_at(out, entry, slab, data, known, chunk, lock)
        finally:
            if buf is not None:
                self.pool.give(buf)
        return pieces, None, sum(n for _, n in pieces)

    def _guarded(
        self, task: Callable[[Slab, PlanEntry], tuple[Any, Any, Any]], slab: Slab, entry: PlanEntry
    ) -> tuple[Any, Any, Any]:
        """Run a read task unless a slab has failed; a failure stops every queued task at once
        (each would otherwise run its own retries against a storage that is gone)."""
        if self.stop.is_set():
            raise _Stopped()
        try:
            return task(slab, entry)
        except Exception as exc:
            with self.lock:
                self.error = (
                    self.error or exc
                )  # raised by run() even if a stream saw _Stopped first
            self.stop.set()
            raise

    def _slab_stream(
        self, tf: TargetFile, task: Callable[[Slab, PlanEntry], tuple[Any, Any, Any]] | None = None
    ) -> Generator[tuple[int, Any, Any], None, None]:
        """Yield (entry index, slab bytes, their chunk CRCs or None) in file order, reading
        ahead within the budget; with ``task``, what it returned (its second item, a pool
        buffer or ``None``, is given back here) instead of :meth:`_read`'s."""
        assert self.reads is not None
        task = task or self._read
        work = deque((i, s) for i, e in enumerate(tf.entries) for s in e.slabs)
        pending: deque[tuple[int, int, Future]] = deque()
        try:
            while work or pending:
                while work and self.budget.acquire(work[0][1].buffer_nbytes, block=not pending):
                    i, slab = work.popleft()
                    pending.append(
                        (
                            i,
                            slab.buffer_nbytes,
                            self.reads.submit(self._guarded, task, slab, tf.entries[i]),
                        )
                    )
                i, cost, fut = pending.popleft()
                buf = None
                try:
                    data, buf, known = fut.result()
                    if self.stop.is_set():
                        raise _Stopped()
                    yield i, data, known  # the writer is done with it on resume
                except Exception:
                    self.stop.set()  # every stream stops reading at once
                    raise
                finally:
                    if buf is not None:
                        self.pool.give(buf)
                    self.budget.release(cost)
        finally:
            for _, cost, fut in pending:
                fut.cancel()
                if not fut.cancelled() and fut.exception() is None:  # waits: its buffer is held
                    held = fut.result()[1]
                    if held is not None:
                        self.pool.give(held)
                self.budget.release(cost)

    def _verify(self, tf: TargetFile, kept: dict[str, Any]) -> FileResult | None:
        """Re-read a file a previous run finished; its records if size and CRC-32C still
        match, else ``None`` (it will be written again)."""
        try:
            size = self.dst.size(tf.name)
        except FileNotFoundError:
            size = -1
        if size != tf.nbytes or kept.get("nbytes") != tf.nbytes:
            log.warning(
                "%s: %d bytes, expected %d; writing it again",
                self.dst.url_of(tf.name),
                size,
                tf.nbytes,
            )
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
            log.warning(
                "%s: checksum differs from the interrupted run's; writing it again",
                self.dst.url_of(tf.name),
            )
            return None
        self._count(num_skipped=1, nbytes_verified=len(header))
        shards = _records(
            tf, [c.finish() for c in crcs]
        )  # the sidecar is rewritten from the CRCs just read
        return FileResult(
            tf.name,
            FileRecord(tf.nbytes, file_crc),
            shards,
            False,
            write_sidecar(self.dst, tf.name, shards),
        )

    def run(self, on_file_done: Callable[[str], None] | None) -> list[FileResult]:
        """This process's target files, ``workers`` at a time; progress saved after each."""
        kept = load_progress(self.dst, self.plan.plan_id, {tf.name for tf in self.files})
        results: dict[str, FileResult] = {}
        workers = self.plan.options.threads(
            self.src.capabilities.node_local and self.dst.capabilities.node_local
        )
        with (
            ThreadPoolExecutor(workers, "reshard-read") as reads,
            ThreadPoolExecutor(max(1, min(workers, len(self.files))), "reshard-file") as files,
        ):
            self.reads = reads
            futures = {files.submit(self.run_file, tf, kept.get(tf.name)): tf for tf in self.files}
            try:
                for fut in as_completed(futures):
                    if not fut.cancelled() and isinstance(fut.exception(), _Stopped):
                        continue  # stopped by another file's error, raised below
                    result = fut.result()
                    results[result.name] = result
                    save_progress(self.dst, self.progress_name, self.plan.plan_id, results)
                    if on_file_done is not None:
                        on_file_done(result.name)
                if self.error is not None:
                    raise self.error
            except BaseException:
                self.stop.set()
                for fut in futures:
                    fut.cancel()
                raise
        self.report.peak_buffer_nbytes = self.budget.peak
        return [results[tf.name] for tf in self.files]


def _records(tf: TargetFile, crcs: list[list[int]]) -> dict[str, ShardRecord]:
    return safetensors.shard_records(
        tf.name, [(e.fqn, e.box, e.nbytes) for e in tf.entries], len(tf.header), crcs
    )


def build_manifest(
    plan: ReshardPlan, results: list[FileResult], target_root_url: str = "", source_url: str = ""
) -> Manifest:
    """The target manifest: the source's configs and state (its run, with the source as
    ``parent``), the plan's tensors, the files' records; the config's ``checkpoint.url`` names
    ``target_root_url`` (when given), not the source's run."""
    builder = ManifestBuilder.relayout(
        plan.source, plan.dims, plan.tensors, chunk_nbytes=plan.options.chunk_nbytes
    )
    config = builder.manifest.config
    if target_root_url and isinstance(config.get("checkpoint"), dict):
        config["checkpoint"] = {**config["checkpoint"], "url": target_root_url}
    for r in results:
        builder.add_file(r.name, r.record, r.shards, sidecar=r.sidecar)
    manifest = builder.build()
    manifest.state = rewritten_state(manifest.state, source_url, plan.source.step, "reshard")
    return manifest


def execute(
    plan: ReshardPlan,
    src: Store,
    dst_root: Store,
    *,
    share: Share | None = None,
    progress: Callable[[int], None] | None = None,
    on_file_done: Callable[[str], None] | None = None,
    wait_timeout_s: float = 24 * 3600.0,
) -> ReshardReport:
    """Write this process's share of ``plan`` under ``dst_root`` (``<dst_root>/step-NNNNNNNNN``);
    the coordinator (rank 0, or the only process) commits once every share is written.

    Every process of a scale-out calls it with the same plan and its own ``share``.

    Args:
        plan: from :func:`shardsmith.reshard.planner.plan_reshard`.
        src: the source step directory.
        dst_root: the target checkpoint root.
        share: rank, world size and attempt (:class:`~shardsmith.reshard.scaleout.Share`);
            default: the only process.
        progress: called with byte increments (written or re-verified) from worker threads.
        on_file_done: called with each finished file's name after its progress is saved.
        wait_timeout_s: how long the coordinator waits for the other ranks.

    Raises:
        TargetCommitted: the target step is already committed. CheckpointError: another rank failed.
        IntegrityError: a source byte does not match its checksum.
        StorageError / OSError: reading or writing failed; a rerun resumes.
    """
    t0 = time.perf_counter()
    share = share or Share()
    dst = dst_root.child(step_dir(plan.source.step))
    ensure_not_committed(dst)
    created = _new_local_dirs(dst)
    dst_path = dst.local_path("")
    if dst_path and not created:
        sweep_stale_tmp(dst_path)  # a killed run's hidden temporary files
    mine = assign_files(plan.files, share.world_size)[share.rank]
    progress_name = (
        PROGRESS_NAME if share.world_size == 1 else f".reshard-progress-{share.rank:05d}.json"
    )
    executor = _Executor(
        plan, src, dst, mine, progress_name, progress, ReshardReport(plan.source.step, dst.url)
    )
    try:
        results = executor.run(on_file_done)
    except BaseException as exc:
        if share.world_size > 1:
            publish(dst, share, plan.plan_id, [], error=f"{type(exc).__name__}: {exc}")
        _remove_if_empty(created)  # a refused reshard leaves no empty directories
        raise
    if share.world_size > 1:
        publish(dst, share, plan.plan_id, results)
        if share.rank != 0:
            executor.report.seconds = time.perf_counter() - t0
            return executor.report
        results = gather(dst, share, plan, wait_timeout_s)
    _commit(plan, dst_root, dst, results, src.url)
    executor.report.num_target_files = len(results)  # the whole target, every rank's
    executor.report.target_nbytes = sum(r.record.nbytes for r in results)
    executor.report.committed = True
    executor.report.seconds = time.perf_counter() - t0
    return executor.report


def _new_local_dirs(dst: Store) -> list[str]:
    """The local directories a reshard into ``dst`` would create that do not exist yet
    (``shards/``, the step directory, the target root and its missing parents), deepest
    first; [] on object stores, which have no directories."""
    path = dst.local_path("shards")
    out: list[str] = []
    while path is not None and not os.path.exists(path) and os.path.dirname(path) != path:
        out.append(os.path.normpath(path))
        path = os.path.dirname(os.path.normpath(path))
    return out


def _remove_if_empty(paths: list[str]) -> None:
    """Remove each of ``paths`` (deepest first) that is an empty directory; files written
    there stay, so a rerun keeps them."""
    for path in paths:
        try:
            os.rmdir(path)
        except OSError:
            pass


def _commit(
    plan: ReshardPlan, dst_root: Store, dst: Store, results: list[FileResult], source_url: str
) -> None:
    """Manifest last (after dropping shard files no plan file names), then clean up."""
    order = {tf.name: i for i, tf in enumerate(plan.files)}
    manifest = build_manifest(
        plan, sorted(results, key=lambda r: order[r.name]), dst_root.url, source_url
    )
    wanted = {posixpath.basename(n) for r in results for n in (r.name, sidecar_name(r.name))}
    for name in dst.list_dir("shards"):
        if name not in wanted:  # left by an earlier, other plan
            dst.delete(f"shards/{name}")
    commit(dst_root, manifest)  # validates coverage and file sizes, then writes the manifest
    cleanup(dst)
