"""Integrity checks: does what is on storage match what the manifest says?

Two levels:

* :func:`check_file_once` — cheap, run by every load the first time it touches a data
  file: the file's size and its safetensors header (keys, dtypes, shapes, byte ranges)
  must agree with the manifest. Ranged reads then verify every byte they read against
  the per-chunk checksums (:func:`shardsmith.storage.formats.read_box`).
* :func:`verify_checkpoint` — everything, for ``shardsmith verify``: the manifest
  (schema, coverage of every logical tensor exactly once), and for every data file its
  presence, size, header, whole-file CRC-32C and every shard's chunk checksums, streamed
  in bounded blocks. All problems are collected, each naming its file.

Nothing here imports torch: the manifest's dtype names are safetensors' own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import CheckpointNotFound, IntegrityError, ManifestError
from shardsmith.storage.checksum import crc32c_update
from shardsmith.storage.commit import read_manifest
from shardsmith.storage.fs import Store
from shardsmith.storage.manifest import MANIFEST_NAME, Manifest, ShardRecord, TensorRecord
from shardsmith.storage.model_record import model_record_problems
from shardsmith.storage.safetensors import read_header

#: Bytes read per request when streaming a file for its checksums (bounds memory).
DEFAULT_BLOCK_NBYTES = 8 * 1024 * 1024


@dataclass
class Problem:
    """One thing wrong with one file of a checkpoint.

    Attributes:
        file: checkpoint-relative path (``manifest.json`` for manifest problems).
        what: what is wrong, in words.
    """

    file: str
    what: str


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`.

    Attributes:
        url: the step directory checked.
        step: its step (``None`` when the manifest could not be read).
        problems: every problem found, grouped by file in file order.
        num_files: data files checked.
        num_tensors: logical tensors in the manifest.
        nbytes_checked: data bytes read and checksummed.
        extra_files: files in the step directory that the manifest does not list
            (harmless leftovers, e.g. of an interrupted earlier save; not problems).
    """

    url: str
    step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_tensors: int = 0
    nbytes_checked: int = 0
    extra_files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    @property
    def bad_files(self) -> list[str]:
        """Each file with at least one problem, once, in report order."""
        return list(dict.fromkeys(p.file for p in self.problems))

    def to_json(self) -> dict[str, Any]:
        """JSON-safe summary (what ``shardsmith verify --json`` prints)."""
        return {"url": self.url, "step": self.step, "ok": self.ok, "num_files": self.num_files,
                "num_tensors": self.num_tensors, "nbytes_checked": self.nbytes_checked,
                "bad_files": self.bad_files,
                "problems": [{"file": p.file, "what": p.what} for p in self.problems],
                "extra_files": self.extra_files}


# ---- headers ------------------------------------------------------------------------------


def _same_ints(value: Any, want: list[int]) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value) and value == want


def shards_in_file(manifest: Manifest, file: str) -> list[tuple[str, TensorRecord, ShardRecord]]:
    """(fqn, tensor record, shard) of every non-empty shard stored in ``file``."""
    return [(fqn, rec, s) for fqn, rec in manifest.tensors.items() for s in rec.shards
            if s.file == file and s.nbytes]


def header_problems(manifest: Manifest, file: str, data_start: int, header: dict[str, Any]) -> list[str]:
    """Where a parsed safetensors header disagrees with the manifest (pure).

    Checks, for every shard the manifest places in ``file``: the entry exists under its
    key with the tensor's dtype, the box's lengths as shape, and exactly the manifest's
    byte range; that the header lists nothing else; and that its data region ends at the
    file's recorded size.
    """
    problems = []
    keys = set()
    for fqn, rec, s in shards_in_file(manifest, file):
        keys.add(s.key)
        entry = header.get(s.key)
        if not isinstance(entry, dict):
            problems.append(f"header has no entry {s.key!r} (tensor {fqn})")
            continue
        if entry.get("dtype") != rec.dtype:
            problems.append(f"header says {s.key!r} is {entry.get('dtype')!r:.20}, the manifest {rec.dtype}")
        if not _same_ints(entry.get("shape"), s.lengths):
            problems.append(f"header says {s.key!r} has shape {entry.get('shape')!r:.60}, the manifest "
                            f"box lengths {s.lengths}")
        want = [s.byte_offset - data_start, s.byte_offset - data_start + s.nbytes]
        if not _same_ints(entry.get("data_offsets"), want):
            problems.append(f"header says {s.key!r} lies at data_offsets {entry.get('data_offsets')!r:.60}, "
                            f"the manifest at {want} (bytes [{s.byte_offset}, {s.byte_offset + s.nbytes}))")
    extra = sorted(set(header) - keys - {"__metadata__"})
    if extra:
        problems.append(f"header lists entries the manifest does not: {extra[:5]}")
    ends = [e["data_offsets"][1] for k, e in header.items() if k in keys and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and type(e["data_offsets"][1]) is int]
    nbytes = manifest.files[file].nbytes
    if ends and not problems and data_start + max(ends) != nbytes:
        problems.append(f"header's data ends at byte {data_start + max(ends)} but the manifest "
                        f"records {nbytes} bytes")
    return problems


def _size_problem(size: int, want: int) -> str:
    kind = "truncated" if size < want else "oversized"
    return f"{kind}: {size} bytes on storage, the manifest records {want}"


def check_file_once(store: Store, manifest: Manifest, file: str, source: str = "") -> None:
    """Check a data file's size and safetensors header against the manifest, once per
    manifest object (remembered in ``manifest.checked_files``). Any rank may call it.

    Costs one size query and one or two small ranged reads per file; the data itself
    is verified chunk by chunk as it is read.

    Raises:
        IntegrityError: naming the file, when it is missing, truncated or oversized, or
            its header disagrees with the manifest.
    """
    if file in manifest.checked_files:
        return
    url = f"{source}/{file}" if source else store.url_of(file)
    want = manifest.files[file].nbytes
    try:
        size = store.size(file)
    except FileNotFoundError as exc:
        raise IntegrityError(f"{url}: missing, but the manifest lists it ({want} bytes); the checkpoint "
                             "is incomplete — resume from another step (`shardsmith ls`) or restore "
                             "the file") from exc
    if size != want:
        raise IntegrityError(f"{url}: {_size_problem(size, want)}; the file is damaged — resume from "
                             "another step (`shardsmith ls`) or restore it")
    if manifest.tensor_format == "safetensors":
        data_start, header = read_header(store, file, want)
        problems = header_problems(manifest, file, data_start, header)
        if problems:
            raise IntegrityError(f"{url}: safetensors header disagrees with the manifest: "
                                 + "; ".join(problems[:10]) + " — the file is damaged or was replaced; "
                                 "resume from another step or restore it")
    manifest.checked_files.add(file)


# ---- streaming checksums ------------------------------------------------------------------


@dataclass
class _Chunk:
    start: int          # absolute byte range in the file
    end: int
    expected: int
    shard: int          # index into the file's shard list
    crc: int = 0


def _file_chunks(manifest: Manifest, shards: list[tuple[str, TensorRecord, ShardRecord]]) -> list[_Chunk]:
    chunks = []
    for i, (_, _, s) in enumerate(shards):
        for c, expected in enumerate(s.crc32c):
            begin = s.byte_offset + c * manifest.chunk_nbytes
            chunks.append(_Chunk(begin, min(begin + manifest.chunk_nbytes, s.byte_offset + s.nbytes),
                                 expected, i))
    return sorted(chunks, key=lambda ch: ch.start)


def _stream_problems(store: Store, manifest: Manifest, file: str, size: int,
                     block_nbytes: int) -> tuple[list[str], int]:
    """Whole-file CRC-32C and every shard chunk's CRC-32C in one streaming pass.

    Returns (problems, bytes read). Memory: one block.
    """
    shards = shards_in_file(manifest, file)
    chunks = _file_chunks(manifest, shards)
    bad: dict[int, list[_Chunk]] = {}
    file_crc, pos, nxt = 0, 0, 0
    while pos < size:
        data = store.read_range(file, pos, min(pos + block_nbytes, size))
        if not data:
            break
        view = memoryview(data)
        end = pos + len(data)
        file_crc = crc32c_update(view, file_crc)
        while nxt < len(chunks) and chunks[nxt].start < end:
            ch = chunks[nxt]
            lo, hi = max(ch.start, pos), min(ch.end, end)
            if hi > lo:
                ch.crc = crc32c_update(view[lo - pos:hi - pos], ch.crc)
            if ch.end > end:
                break
            if ch.crc != ch.expected:
                bad.setdefault(ch.shard, []).append(ch)
            nxt += 1
        pos = end
    problems = []
    record = manifest.files[file]
    if pos == record.nbytes and int(file_crc) != record.crc32c:
        problems.append(f"whole-file CRC-32C is {int(file_crc):#010x}, the manifest records {record.crc32c:#010x}")
    for ch in chunks[nxt:]:
        bad.setdefault(ch.shard, []).append(ch)
    for i, chs in sorted(bad.items()):
        fqn, _, s = shards[i]
        past_end = sum(ch.end > pos for ch in chs)
        what = (f"{past_end} of them past the end of the file" if past_end else "checksum mismatch")
        problems.append(f"tensor {fqn} (key {s.key!r}): {len(chs)} of {len(s.crc32c)} checksum chunks "
                        f"bad ({what}), first at bytes [{chs[0].start}, {chs[0].end})")
    return problems, pos


def file_problems(store: Store, manifest: Manifest, file: str,
                  block_nbytes: int = DEFAULT_BLOCK_NBYTES) -> tuple[list[str], int]:
    """Everything wrong with one data file: presence, size, header, checksums.

    Returns (problems, bytes read).
    """
    want = manifest.files[file].nbytes
    try:
        size = store.size(file)
    except FileNotFoundError:
        return [f"missing (the manifest records {want} bytes)"], 0
    problems = [] if size == want else [_size_problem(size, want)]
    if manifest.tensor_format == "safetensors":
        try:
            data_start, header = read_header(store, file, min(size, want))
            problems += header_problems(manifest, file, data_start, header)
        except IntegrityError as exc:
            problems.append(str(exc).split(": ", 1)[-1])
    streamed, nbytes = _stream_problems(store, manifest, file, min(size, want), block_nbytes)
    return problems + streamed, nbytes


def verify_checkpoint(step_store: Store, *, block_nbytes: int = DEFAULT_BLOCK_NBYTES) -> VerifyReport:
    """Check a whole checkpoint step against its manifest; collects every problem.

    Checks the manifest (schema; every logical tensor's boxes inside its shape and
    covering it exactly once; byte ranges; every tensor's shape as the model record implies,
    see :mod:`shardsmith.storage.model_record`), then for every data file: present, size,
    safetensors header agreeing with the manifest (key -> dtype/shape/byte range),
    whole-file CRC-32C, and each shard's chunk CRC-32Cs. Files are streamed in blocks
    of ``block_nbytes``, so memory does not grow with file size. Single process.

    Args:
        step_store: the step directory (``.../step-NNNNNNNNN``).
        block_nbytes: bytes per ranged read while streaming.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when anything is wrong. A missing
        or invalid manifest is reported as a problem of ``manifest.json``.
    """
    report = VerifyReport(url=step_store.url)
    try:
        manifest = read_manifest(step_store)
    except CheckpointNotFound:
        report.problems.append(Problem(MANIFEST_NAME, "missing: the step is not committed"))
        return report
    except ManifestError as exc:
        report.problems.append(Problem(MANIFEST_NAME, str(exc)))
        return report
    report.step, report.num_tensors = manifest.step, len(manifest.tensors)
    report.problems += [Problem(MANIFEST_NAME, what) for what in model_record_problems(manifest)]
    for name in sorted(manifest.files):
        problems, nbytes = file_problems(step_store, manifest, name, block_nbytes)
        report.problems += [Problem(name, what) for what in problems]
        report.num_files += 1
        report.nbytes_checked += nbytes
    present = step_store.walk()
    report.extra_files = sorted(k for k in present if k not in manifest.files and k != MANIFEST_NAME)
    return report
