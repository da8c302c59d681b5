"""Reading a manifest from storage: all of it, or only the metadata of what a rank loads.

:class:`ManifestReader` reads a version-2 ``manifest.json`` by range: a probe of its first
bytes (the head's length), the head (configs, layout, state, file table, index), then only
the byte ranges of the tensors asked for, neighbours merged into one read
(:mod:`shardsmith.storage.manifest.v2` for the layout). What it read is validated as strictly
as a whole manifest (:func:`~shardsmith.storage.manifest.parse.parse_manifest`): schema,
paths, coverage, byte ranges, checksum counts; the commit validated the whole once. A
version-1 manifest has no index: it is read and parsed whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from shardsmith.layout import Box
from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.manifest.checks import err
from shardsmith.storage.manifest.grid import (
    GRID_BLOCK,
    Grid,
    block_span,
    cells_for,
    parse_blocks,
    parse_grid,
)
from shardsmith.storage.manifest.parse import parse_manifest
from shardsmith.storage.manifest.records import MANIFEST_NAME, Manifest, TensorRecord
from shardsmith.storage.manifest.v2 import (
    GRIDS_START,
    Head,
    check_tensors,
    grids_tiling_problem,
    head_nbytes_of,
    indexed_version,
    parse_entry,
    parse_head,
    parse_tensor_at,
    shard_parser,
)
from shardsmith.storage.store.fs import Store

#: First read of a manifest: the whole head of a small step in one request.
PROBE_NBYTES = 64 * 1024
#: Body bytes per read when streaming every tensor (:meth:`ManifestReader.iter_tensors`).
STREAM_NBYTES = 4 * 2**20
#: Ranges of wanted tensors closer than this are fetched in one read (the gap is read too).
MERGE_GAP_NBYTES = 16 * 1024


@dataclass
class ReadCount:
    """Metadata reads of one reader: requests and bytes."""

    num_reads: int = 0
    nbytes: int = 0


class ManifestReader:
    """The manifest of one committed step, read piecewise. Any rank; not thread-safe.

    Args:
        store: the step directory.
        source: URL for messages (default: the manifest's).

    Raises:
        FileNotFoundError: no ``manifest.json`` (the step is not committed).
        ManifestError: the head (or a version-1 document) is invalid.
    """

    def __init__(self, store: Store, source: str = "") -> None:
        self.store = store
        self.source = source or store.url_of(MANIFEST_NAME)
        self.count = ReadCount()
        self.whole: Manifest | None = None
        self.head: Head | None = None
        probe = self._read(0, PROBE_NBYTES)
        if not indexed_version(probe):  # version 1 (or not ours): parse it whole
            self.whole = parse_manifest(
                probe if len(probe) < PROBE_NBYTES else probe + self._read_rest(len(probe)),
                self.source,
            )
            return
        nbytes = head_nbytes_of(probe, self.source)
        if len(probe) < nbytes:
            probe += self._read(len(probe), nbytes)
        self.head = parse_head(probe[:nbytes], self.source)
        self._spill = probe[nbytes:]  # body bytes the probe already holds

    def _read(self, start: int, end: int) -> bytes:
        data = self.store.read_range(MANIFEST_NAME, start, end)
        self.count.num_reads += 1
        self.count.nbytes += len(data)
        return data

    def _read_rest(self, start: int) -> bytes:
        data = self.store.read(MANIFEST_NAME)[start:]
        self.count.num_reads += 1
        self.count.nbytes += len(data)
        return data

    @property
    def tensor_names(self) -> list[str]:
        """Every tensor FQN of the step."""
        if self.whole is not None:
            return list(self.whole.tensors)
        assert self.head is not None
        return list(self.head.index)

    def _runs(self, spans: Mapping[Any, tuple[int, ...]]) -> Iterator[tuple[bytes, int, list[Any]]]:
        """(bytes, start, keys) of body byte runs holding ``spans`` (key -> [start, end)),
        neighbours closer than :data:`MERGE_GAP_NBYTES` fetched in one read."""
        runs: list[tuple[int, int, list[Any]]] = []
        for key in sorted(spans, key=lambda k: spans[k][0]):
            start, end = spans[key]
            if runs and start - runs[-1][1] <= MERGE_GAP_NBYTES:
                runs[-1] = (runs[-1][0], max(end, runs[-1][1]), runs[-1][2] + [key])
            else:
                runs.append((start, end, [key]))
        for start, end, keys in runs:
            yield self._fetch(start, end), start, keys

    def _fetch(self, start: int, end: int) -> bytes:
        """Body bytes ``[start, end)``, from the probe's spill when it holds them."""
        if end <= len(self._spill):
            return self._spill[start:end]
        assert self.head is not None
        data = self._read(self.head.nbytes + start, self.head.nbytes + end)
        if len(data) != end - start:
            raise err(
                "index",
                f"body bytes [{start}, {end}) lie outside the document ({len(data)} of them "
                "could be read)",
                self.source,
            )
        return data

    def manifest(self, fqns: Iterable[str] | Mapping[str, Box] | None = None) -> Manifest:
        """The manifest holding the tensors ``fqns`` that the step has (all with ``None``),
        validated; FQNs the step lacks are left out (``Manifest.tensor_names`` lists the step's).
        With a mapping FQN -> box (global elements), a tensor saved with a shard grid (version 3,
        :mod:`shardsmith.storage.manifest.grid`) holds only the shards its box intersects.

        Raises:
            ManifestError: what was read is invalid or points outside the checkpoint.
        """
        if self.whole is not None:
            if fqns is None:
                return self.whole
            wanted = set(fqns)
            m = self.whole
            return Manifest(
                step=m.step,
                layout=m.layout,
                model=m.model,
                config=m.config,
                state=m.state,
                tensors={f: t for f, t in m.tensors.items() if f in wanted},
                files=m.files,
                tensor_format=m.tensor_format,
                chunk_nbytes=m.chunk_nbytes,
                created=m.created,
                version=m.version,
                all_tensors=tuple(m.tensors),
            )
        assert self.head is not None
        names = (
            list(self.head.index)
            if fqns is None
            else [f for f in dict.fromkeys(fqns) if f in self.head.index]
        )
        boxes = fqns if isinstance(fqns, Mapping) else {}
        gridded = {f: boxes[f] for f in names if f in boxes and len(self.head.index[f]) == 4}
        tensors = self._cells(gridded)
        for data, start, members in self._runs(
            {f: self.head.index[f][:2] for f in names if f not in gridded}
        ):
            with cycle_gc_paused():  # CPU only: the fetch above runs with the collector on
                for fqn in members:
                    lo, hi = self.head.index[fqn][:2]
                    tensors[fqn] = parse_entry(
                        data[lo - start : hi - start], fqn, self.head, self.source
                    )
        with cycle_gc_paused():
            check_tensors(self.head, tensors, self.source, whole=False, partial=gridded)
        return self.head.manifest(tensors, partial=fqns is not None)

    def _cells(self, boxes: dict[str, Box]) -> dict[str, TensorRecord]:
        """The records of the grid cells each box intersects: the grid entries (one run per
        stage), then the blocks of records holding those cells."""
        assert self.head is not None
        index = self.head.index
        grids: dict[str, Grid] = {}
        blocks: dict[tuple[str, int], tuple[int, int]] = {}
        for data, start, members in self._runs({f: index[f][2:] for f in boxes}):
            for fqn in members:
                grids[fqn] = parse_grid(
                    data[index[fqn][2] - start : index[fqn][3] - start],
                    fqn,
                    index[fqn][1] - index[fqn][0],
                    self.source,
                )
        for fqn, grid in grids.items():
            for b in sorted({c // GRID_BLOCK for c in cells_for(grid, boxes[fqn])}):
                lo, hi = block_span(grid, b)
                blocks[(fqn, b)] = (index[fqn][0] + lo, index[fqn][0] + hi)
        pieces: dict[str, dict[int, bytes]] = {f: {} for f in grids}
        for data, start, keys in self._runs(blocks):
            for fqn, b in keys:
                lo, hi = blocks[(fqn, b)]
                pieces[fqn][b] = data[lo - start : hi - start]
        out = {}
        with cycle_gc_paused():
            for fqn, grid in grids.items():
                records = parse_blocks(
                    pieces[fqn],
                    grid,
                    fqn,
                    shard_parser(fqn, grid.dtype, self.head, self.source),
                    self.source,
                )
                out[fqn] = TensorRecord(
                    shape=grid.shape,
                    dtype=grid.dtype,
                    shards=[records[c] for c in cells_for(grid, boxes[fqn])],
                )
        return out

    def iter_tensors(self, run_nbytes: int = STREAM_NBYTES) -> Iterator[tuple[str, TensorRecord]]:
        """Every tensor of a version-2 or -3 manifest in document order, each parsed and checked
        on its own (coverage, byte ranges, checksum counts), reading the body in runs of about
        ``run_nbytes`` (with the grid entries of the run's tensors); checks that the index tiles
        the body. Memory: one run.

        Raises:
            ManifestError: an entry is invalid or the index does not tile the body.
        """
        assert self.head is not None
        items = list(self.head.index.items())
        pos, i = 0, 0
        last_grid = max((span[3] for _, span in items if len(span) == 4), default=-1)
        while i < len(items):
            start, j = items[i][1][0], i + 1
            while j < len(items) and items[j][1][1] - start <= run_nbytes:
                j += 1
            body = _Pieces(self._fetch(start, items[j - 1][1][1] + 1), start)
            body.add_grids(self, [span for _, span in items[i:j] if len(span) == 4], last_grid)
            for n, (fqn, span) in enumerate(items[i:j], start=i):
                lo, hi = span[0], span[1]
                if lo != pos or (n + 1 < len(items) and body[hi : hi + 1] != b","):
                    raise err(
                        f"index[{fqn!r:.120}]",
                        f"bytes [{lo}, {hi}) of the tensors: expected an entry at "
                        f"{pos} followed by ','; the index does not tile the tensors",
                        self.source,
                    )
                rec = parse_tensor_at(body, fqn, span, self.head, self.source)
                check_tensors(self.head, {fqn: rec}, self.source, whole=False)
                yield fqn, rec
                pos = hi + 1
            i = j
        self._check_tail(max(pos - 1, 0))

    def _check_tail(self, tensors_end: int) -> None:
        """After the last tensor entry: ``}}`` (version 2), or the grids, tiling, then ``}}``."""
        assert self.head is not None
        problem, end = grids_tiling_problem(self.head, tensors_end), tensors_end
        if self.head.version >= 3 and not problem:
            if self._fetch(tensors_end, tensors_end + len(GRIDS_START)) != GRIDS_START:
                problem = (
                    "expected '},\"grids\":{' right after the last indexed tensor: every tensor must be in "
                    "the index"
                )
            spans = [span for span in self.head.index.values() if len(span) == 4]
            end = spans[-1][3] if spans else tensors_end + len(GRIDS_START)
        if problem or self._read(self.head.nbytes + end, self.head.nbytes + end + 3) != b"}}":
            raise err(
                "tensors",
                problem
                or "the document does not end right after the last indexed tensor (or "
                "grid): every tensor must be in the index",
                self.source,
            )


class _Pieces:
    """Body bytes fetched in pieces, sliced by body offsets (what :func:`parse_tensor_at` reads)."""

    def __init__(self, data: bytes, start: int) -> None:
        self.pieces = [(start, data)]

    def add_grids(
        self, reader: ManifestReader, spans: list[tuple[int, ...]], last_end: int
    ) -> None:
        """The grid entries of ``spans`` (one read), each with the byte after it: ``,``, or
        ``}`` after the last grid of the document (ending at ``last_end``)."""
        if spans:
            lo, hi = spans[0][2], spans[-1][3] + 1
            data = reader._fetch(lo, hi)
            if any(
                data[s[3] - lo : s[3] - lo + 1] != (b"}" if s[3] == last_end else b",")
                for s in spans
            ):
                raise err("grids", "grid entries must be separated by ','", reader.source)
            self.pieces.append((lo, data))

    def __getitem__(self, key: slice) -> bytes:
        for start, data in self.pieces:
            if start <= key.start and key.stop <= start + len(data):
                return data[key.start - start : key.stop - start]
        raise IndexError(f"body bytes [{key.start}, {key.stop}) were not fetched")
