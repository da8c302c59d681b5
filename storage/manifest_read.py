"""Reading a manifest from storage: all of it, or only the metadata of what a rank loads.

:class:`ManifestReader` reads a version-2 ``manifest.json`` by range: a probe of its first
bytes (the head's length), the head (configs, layout, state, file table, index), then only
the byte ranges of the tensors asked for, neighbours merged into one read
(:mod:`shardsmith.storage.manifest_v2` for the layout). What it read is validated as strictly
as a whole manifest (:func:`~shardsmith.storage.manifest_parse.parse_manifest`): schema,
paths, coverage, byte ranges, checksum counts; the commit validated the whole once. A
version-1 manifest has no index: it is read and parsed whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import MANIFEST_NAME, Manifest, TensorRecord
from shardsmith.storage.manifest_checks import err
from shardsmith.storage.manifest_parse import parse_manifest
from shardsmith.storage.manifest_v2 import PREFIX, Head, check_tensors, head_nbytes_of, parse_entry, parse_head

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
        if probe[:len(PREFIX)] != PREFIX:                    # version 1 (or not ours): parse it whole
            self.whole = parse_manifest(probe if len(probe) < PROBE_NBYTES else probe + self._read_rest(len(probe)),
                                        self.source)
            return
        nbytes = head_nbytes_of(probe, self.source)
        if len(probe) < nbytes:
            probe += self._read(len(probe), nbytes)
        self.head = parse_head(probe[:nbytes], self.source)
        self._spill = probe[nbytes:]                          # body bytes the probe already holds

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

    def _ranges(self, fqns: list[str]) -> list[tuple[int, int, list[str]]]:
        """Body byte runs holding ``fqns``' entries, neighbours merged."""
        assert self.head is not None
        runs: list[tuple[int, int, list[str]]] = []
        for fqn in sorted(fqns, key=lambda f: self.head.index[f][0]):   # type: ignore[union-attr]
            start, end = self.head.index[fqn]                          # type: ignore[union-attr]
            if runs and start - runs[-1][1] <= MERGE_GAP_NBYTES:
                runs[-1] = (runs[-1][0], end, runs[-1][2] + [fqn])
            else:
                runs.append((start, end, [fqn]))
        return runs

    def _fetch(self, start: int, end: int) -> bytes:
        """Body bytes ``[start, end)``, from the probe's spill when it holds them."""
        if end <= len(self._spill):
            return self._spill[start:end]
        assert self.head is not None
        data = self._read(self.head.nbytes + start, self.head.nbytes + end)
        if len(data) != end - start:
            raise err("index", f"body bytes [{start}, {end}) lie outside the document ({len(data)} of them "
                      "could be read)", self.source)
        return data

    def manifest(self, fqns: Iterable[str] | None = None) -> Manifest:
        """The manifest holding the tensors ``fqns`` that the step has (all with ``None``),
        validated; FQNs the step lacks are left out (``Manifest.tensor_names`` lists the step's).

        Raises:
            ManifestError: what was read is invalid or points outside the checkpoint.
        """
        if self.whole is not None:
            if fqns is None:
                return self.whole
            wanted = set(fqns)
            m = self.whole
            return Manifest(step=m.step, layout=m.layout, model=m.model, config=m.config, state=m.state,
                            tensors={f: t for f, t in m.tensors.items() if f in wanted}, files=m.files,
                            tensor_format=m.tensor_format, chunk_nbytes=m.chunk_nbytes, created=m.created,
                            version=m.version, all_tensors=tuple(m.tensors))
        assert self.head is not None
        names = list(self.head.index) if fqns is None else [f for f in dict.fromkeys(fqns) if f in self.head.index]
        tensors: dict[str, TensorRecord] = {}
        for start, end, members in self._ranges(names):
            data = self._fetch(start, end)
            with cycle_gc_paused():             # CPU only: the fetch above runs with the collector on
                for fqn in members:
                    lo, hi = self.head.index[fqn]
                    tensors[fqn] = parse_entry(data[lo - start:hi - start], fqn, self.head, self.source)
        with cycle_gc_paused():
            check_tensors(self.head, tensors, self.source, whole=False)
        return self.head.manifest(tensors, partial=fqns is not None)

    def iter_tensors(self, run_nbytes: int = STREAM_NBYTES) -> Iterator[tuple[str, TensorRecord]]:
        """Every tensor of a version-2 manifest in document order, each parsed and checked on
        its own (coverage, byte ranges, checksum counts), reading the body in runs of about
        ``run_nbytes``; checks that the index tiles the body. Memory: one run.

        Raises:
            ManifestError: an entry is invalid or the index does not tile the body.
        """
        assert self.head is not None
        items = list(self.head.index.items())
        pos, i = 0, 0
        while i < len(items):
            start, j = items[i][1][0], i + 1
            while j < len(items) and items[j][1][1] - start <= run_nbytes:
                j += 1
            end = items[j - 1][1][1]
            data = self._fetch(start, end + 1)
            for n, (fqn, (lo, hi)) in enumerate(items[i:j], start=i):
                sep = data[hi - start:hi - start + 1]
                if lo != pos or (n + 1 < len(items) and sep != b","):
                    raise err(f"index[{fqn!r:.120}]", f"bytes [{lo}, {hi}) of the tensors: expected an entry at "
                              f"{pos} followed by ','; the index does not tile the tensors", self.source)
                rec = parse_entry(data[lo - start:hi - start], fqn, self.head, self.source)
                check_tensors(self.head, {fqn: rec}, self.source, whole=False)
                yield fqn, rec
                pos = hi + 1
            i = j
        tail = self._read(self.head.nbytes + max(pos - 1, 0), self.head.nbytes + max(pos - 1, 0) + 3)
        if tail != b"}}":
            raise err("tensors", "the document does not end right after the last indexed tensor: every "
                      "tensor must be in the index", self.source)
