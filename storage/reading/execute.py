"""Load-time read execution: run planned reads concurrently through the Store, verify, scatter.

:func:`read_safetensors_boxes` (reached through :func:`shardsmith.storage.formats.registry.read_boxes`)
plans with :mod:`shardsmith.storage.reading.ranges`, reads each coalesced range with one
:meth:`~shardsmith.storage.store.fs.Store.read_into` (local ``preadv`` / ranged GET, under the
store's retries), verifies every chunk with :func:`~shardsmith.storage.checksum.verify_chunks`
before use, and copies scratch pieces into place.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from typing import Sequence

import torch

from shardsmith.errors import IntegrityError
from shardsmith.layout import DTYPE_NBYTES, Box, row_major_strides
from shardsmith.storage.checksum import require_full_read, verify_chunks
from shardsmith.storage.formats.tensor_files import TORCH_DTYPES
from shardsmith.storage.manifest.file_checks import check_file_once
from shardsmith.storage.manifest.records import Manifest
from shardsmith.storage.manifest.sidecar import load_chunk_crcs
from shardsmith.storage.reading.ranges import ReadPart, ScratchPiece, coalesce, plan_piece
from shardsmith.storage.reading.spans import intersections
from shardsmith.storage.store.fs import Store

# How many reads run at once, whether reads of one file may overlap and how much scratch a
# call holds all come from the store's capabilities
# (:func:`shardsmith.storage.store.capabilities.capabilities_of`): node-local page-cache disks read
# each file as one task in file order, shared filesystems and object stores keep many ranged
# reads in flight, within a file too.


@dataclass
class ReadStats:
    """Bytes read from storage vs bytes the caller needed, for read amplification;
    ``tensors_shared``: tensors whose union a group of ranks read once
    (:func:`shardsmith.trainer.checkpoint.shared_reads.load_into_siblings`)."""

    nbytes_read: int = 0
    nbytes_needed: int = 0
    tensors_shared: int = 0


def _fill_from_scratch(piece: ScratchPiece) -> None:
    """Copy a verified scratch piece into its place in ``out``."""
    dtype = piece.out.dtype
    raw = piece.scratch[piece.first : piece.last]
    if piece.first % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()  # realign (odd chunk sizes only)
    elems = raw.view(dtype)
    # elems covers the saved box's row-major storage from the intersection's first element:
    # view it through the saved box's strides.
    src = (
        elems.as_strided(piece.common.lengths, row_major_strides(piece.saved.lengths))
        if piece.common.lengths
        else elems.view(())
    )
    piece.out[piece.common.relative_to(piece.box)] = src


def _run_reads(store: Store, parts: list[ReadPart], chunk: int, source: str) -> int:
    """Read and verify all parts, concurrently; returns bytes read."""

    def one(read: list[ReadPart]) -> int:
        start, end = read[0].start, read[-1].end
        url = f"{source}/{read[0].shard.file}"
        got = store.read_into(read[0].shard.file, start, [d for p in read for d in p.dests])
        require_full_read(got, end - start, start, url)
        for p in read:
            verify_chunks(p.shard, p.c0, p.dests, chunk, url)
        return got

    reads = coalesce(parts)
    caps = store.capabilities
    if caps.concurrent_reads_per_file:
        tasks = [[r] for r in reads]
    else:  # one task per file, its reads in file order
        tasks = [
            list(g) for _, g in groupby(reads, key=lambda r: r[0].shard.file)
        ]  # coalesce sorts by file
    if len(tasks) <= 1:
        return sum(one(r) for t in tasks for r in t)
    with ThreadPoolExecutor(min(caps.read_workers, len(tasks))) as pool:
        return sum(pool.map(lambda t: sum(one(r) for r in t), tasks))


def destination(fqn: str, box: Box, dtype_name: str, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a read of ``box`` fills: ``out`` after checking its shape and dtype, or a new one.

    Raises:
        ValueError: ``out`` does not have shape ``box.lengths`` and the tensor's dtype.
    """
    dtype = TORCH_DTYPES[dtype_name]
    if out is None:
        return torch.empty(box.lengths, dtype=dtype)
    if tuple(out.shape) != box.lengths or out.dtype != dtype:
        raise ValueError(
            f"read_box({fqn!r}): destination is {out.dtype} {tuple(out.shape)}, the box "
            f"needs {dtype} {box.lengths}"
        )
    return out


@dataclass
class _Batch:
    """Reads planned but not yet run, and the scratch bytes they hold."""

    store: Store
    chunk_nbytes: int
    source: str
    stats: ReadStats | None
    parts: list[ReadPart] = field(default_factory=list)
    pieces: list[ScratchPiece] = field(default_factory=list)
    scratch_nbytes: int = 0
    free: list[torch.Tensor] = field(default_factory=list)  # scratch of flushed pieces

    @property
    def scratch_limit(self) -> int:
        return self.store.capabilities.scratch_nbytes

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A 1-d ``uint8`` scratch buffer of ``nbytes``: the smallest free one that fits, else new."""
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if not fits:
            return torch.empty(nbytes, dtype=torch.uint8)
        return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))[:nbytes]

    def add(self, piece: ScratchPiece | None, parts: list[ReadPart]) -> None:
        self.parts += parts
        if piece is not None:
            self.pieces.append(piece)
            self.scratch_nbytes += piece.scratch.numel()
        if self.scratch_nbytes > self.scratch_limit:
            self.flush()

    def flush(self) -> None:
        """Fetch the chunk CRCs of the shards about to be read (version 2: from their sidecars),
        run the planned reads (verified), then fill the scratch pieces into place."""
        load_chunk_crcs(self.store, self.chunk_nbytes, [p.shard for p in self.parts], self.source)
        nbytes = _run_reads(self.store, self.parts, self.chunk_nbytes, self.source)
        for piece in self.pieces:
            _fill_from_scratch(piece)
        kept = sum(b.numel() for b in self.free)
        for piece in self.pieces:  # reused by the next pieces
            whole = piece.scratch if piece.scratch._base is None else piece.scratch._base
            if kept + whole.numel() <= self.scratch_limit:
                self.free.append(whole)
                kept += whole.numel()
        if self.stats is not None:
            self.stats.nbytes_read += nbytes
        self.parts, self.pieces, self.scratch_nbytes = [], [], 0


def read_safetensors_boxes(
    store: Store,
    manifest: Manifest,
    requests: Sequence[tuple[str, Box, torch.Tensor | None]],
    stats: ReadStats | None = None,
    source: str = "",
) -> list[torch.Tensor]:
    """Assemble several boxes of logical tensors from a safetensors checkpoint's shards in one go.

    For every (request, saved shard) intersection only the checksum chunks holding needed
    bytes are read (row segments of strided intersections when the gaps are long), ranges
    of a file that touch are coalesced, the reads run concurrently, and every byte read is
    verified against the manifest's chunk checksums before it is used. Contiguous pieces
    are read straight into their destination (no intermediate copy). Any rank; thread-safe
    across calls.

    Args:
        store: the step directory's store (shard file paths are relative to it).
        manifest: the parsed manifest of that step.
        requests: (fqn, global box in elements, destination or ``None``); a destination has
            shape ``box.lengths`` and the tensor's dtype (it is overwritten).
        stats: optional counters updated with bytes read and needed.
        source: URL for messages (default: the store's).

    Returns:
        One tensor per request, of shape ``box.lengths`` (the destination when given).

    Raises:
        KeyError: an fqn is not in the checkpoint.
        ValueError: a destination has the wrong shape or dtype.
        IntegrityError: a read byte does not match its checksum, or a file it touches is
            truncated, oversized or has a safetensors header that disagrees with the manifest,
            or the saved shards do not cover a box.
    """
    source = source or store.url
    batch = _Batch(store, manifest.chunk_nbytes, source, stats)
    outs: list[torch.Tensor] = []
    for fqn, box, out in requests:
        rec = manifest.tensors[fqn]
        itemsize = DTYPE_NBYTES[rec.dtype]
        out = destination(fqn, box, rec.dtype, out)
        outs.append(out)
        out = out.detach()  # same memory; writable under autograd
        filled = 0
        for shard, saved, common in intersections(rec, box):
            check_file_once(store, manifest, shard.file, source)  # size + header, once per file
            batch.add(
                *plan_piece(
                    shard, saved, common, box, out, itemsize, manifest.chunk_nbytes, batch.scratch
                )
            )
            filled += common.numel
            if stats is not None:
                stats.nbytes_needed += common.numel * itemsize
        if filled != box.numel:
            raise IntegrityError(
                f"{source}: saved shards of {fqn!r} cover {filled} of the "
                f"{box.numel} elements of box {box}"
            )
    batch.flush()
    return outs
