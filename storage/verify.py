"""Integrity checks: does what is on storage match what the manifest says?

Two levels:

* :func:`~shardsmith.storage.manifest.file_checks.check_file_once` — cheap, run by every load the
  first time it touches a data file (size and safetensors header); ranged reads then verify
  every byte they read against the per-chunk checksums.
* :func:`verify_checkpoint` — everything, for ``shardsmith verify``: the manifest
  (schema, coverage of every logical tensor exactly once), and for every file its
  presence, size, header, whole-file CRC-32C and every shard's chunk checksums, streamed
  in bounded blocks. All problems are collected, each naming its file. A version-2
  manifest is streamed too: tensor by tensor, then a few files at a time, so memory stays
  bounded by one pass's file metadata and the read blocks, whatever the step's size; files
  may be split over worker processes.

Nothing here imports torch: the manifest's dtype names are safetensors' own.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import CheckpointNotFound, ManifestError
from shardsmith.storage.commit import open_manifest
from shardsmith.storage.manifest.file_checks import (
    DEFAULT_BLOCK_NBYTES,
    FileShard,
    check_file_once,
    file_problems,
    shards_in_file,
)
from shardsmith.storage.manifest.model_record import model_record_problems
from shardsmith.storage.manifest.read import ManifestReader
from shardsmith.storage.manifest.records import MANIFEST_NAME, Manifest, TensorRecord
from shardsmith.storage.manifest.v2 import check_files
from shardsmith.storage.store.fs import Store

__all__ = [
    "Problem",
    "VerifyReport",
    "verify_checkpoint",
    "check_file_once",
    "shards_in_file",
    "DEFAULT_BLOCK_NBYTES",
]
#: Files whose shard records one pass of a version-2 verify holds at once (bounds memory).
FILES_PER_PASS = 256


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
        return {
            "url": self.url,
            "step": self.step,
            "ok": self.ok,
            "num_files": self.num_files,
            "num_tensors": self.num_tensors,
            "nbytes_checked": self.nbytes_checked,
            "bad_files": self.bad_files,
            "problems": [{"file": p.file, "what": p.what} for p in self.problems],
            "extra_files": self.extra_files,
        }


# ---- one worker: a list of files, a few at a time ------------------------------------------


def _by_file(tensors: dict[str, TensorRecord], files: set[str]) -> dict[str, list[FileShard]]:
    out: dict[str, list[FileShard]] = {f: [] for f in files}
    for fqn, rec in tensors.items():
        for s in rec.shards:
            if s.file in out and s.nbytes:
                out[s.file].append((fqn, rec.dtype, s))
    return out


def _check_pass(
    reader: ManifestReader, files: list[str], block_nbytes: int
) -> list[tuple[str, str, int]]:
    """One pass of a version-2 verify: stream every tensor, keep the shards of ``files``,
    check them across tensors (shared bytes, sidecar ranges), then each file's bytes."""
    assert reader.head is not None
    wanted, kept = set(files), {}
    for fqn, rec in reader.iter_tensors():
        shards = [s for s in rec.shards if s.file in wanted]
        if shards:
            kept[fqn] = TensorRecord(shape=rec.shape, dtype=rec.dtype, shards=shards)
    out: list[tuple[str, str, int]] = []
    try:
        check_files(reader.head, kept, reader.source)
    except ManifestError as exc:
        out.append((MANIFEST_NAME, str(exc), 0))
    manifest = reader.head.manifest(kept, partial=False)
    for name, file_shards in _by_file(kept, wanted).items():
        problems, nbytes = file_problems(reader.store, manifest, name, file_shards, block_nbytes)
        out += [(name, what, 0) for what in problems] + [("", "", nbytes)]
    return out


def _check_files(
    store: Store, files: list[str], block_nbytes: int, files_per_pass: int
) -> list[tuple[str, str, int]]:
    """One worker's files: (file, problem, 0) of each problem and ("", "", bytes read) of each file."""
    reader = ManifestReader(store)
    out = []
    for i in range(0, len(files), files_per_pass):
        out += _check_pass(reader, files[i : i + files_per_pass], block_nbytes)
    return out


def _check_files_at(
    url: str,
    storage_options: dict[str, Any],
    files: list[str],
    block_nbytes: int,
    files_per_pass: int,
) -> list[tuple[str, str, int]]:
    """:func:`_check_files` in a worker process (the store rebuilt from its URL)."""
    return _check_files(Store(url, storage_options), files, block_nbytes, files_per_pass)


def _check_v1(
    step_store: Store, manifest: Manifest, block_nbytes: int
) -> list[tuple[str, str, int]]:
    """Every file of a version-1 manifest (already parsed whole)."""
    by_file = _by_file(manifest.tensors, set(manifest.files))
    out = []
    for name in sorted(manifest.files):
        problems, nbytes = file_problems(step_store, manifest, name, by_file[name], block_nbytes)
        out += [(name, what, 0) for what in problems] + [("", "", nbytes)]
    return out


def _split(files: dict[str, Any], workers: int) -> list[list[str]]:
    """Files over ``workers`` lists of about equal bytes (largest first to the lightest)."""
    groups: list[list[str]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(groups)
    for name in sorted(files, key=lambda n: (-files[n].nbytes, n)):
        i = load.index(min(load))
        groups[i].append(name)
        load[i] += files[name].nbytes
    return [sorted(g) for g in groups if g]


def verify_checkpoint(
    step_store: Store,
    *,
    block_nbytes: int = DEFAULT_BLOCK_NBYTES,
    workers: int = 1,
    files_per_pass: int = FILES_PER_PASS,
) -> VerifyReport:
    """Check a whole checkpoint step against its manifest; collects every problem.

    Checks the manifest (schema; every logical tensor's boxes inside its shape and
    covering it exactly once; byte ranges; checksum sidecar ranges; every tensor's shape as the
    model record implies, see :mod:`shardsmith.storage.manifest.model_record`), then for every file:
    present, size, safetensors header agreeing with the manifest (key -> dtype/shape/byte
    range), whole-file CRC-32C, and each shard's chunk CRC-32Cs. Files are streamed in
    blocks of ``block_nbytes``; a version-2 manifest is streamed tensor by tensor and its
    files checked ``files_per_pass`` at a time, so memory does not grow with the step.

    Args:
        step_store: the step directory (``.../step-NNNNNNNNN``).
        block_nbytes: bytes per ranged read while streaming.
        workers: processes the files are split over (version 2; each reads the manifest itself).
        files_per_pass: files whose records one pass holds.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when anything is wrong. A missing
        or invalid manifest is reported as a problem of ``manifest.json``.
    """
    report = VerifyReport(url=step_store.url)
    try:
        reader = open_manifest(step_store)
        if reader.whole is not None:
            manifest = reader.whole
            report.step, report.num_tensors, files = (
                manifest.step,
                len(manifest.tensors),
                manifest.files,
            )
            found = _check_v1(step_store, manifest, block_nbytes)
        else:
            assert reader.head is not None
            report.step, report.num_tensors = reader.head.data["step"], len(reader.head.index)
            files = reader.head.files
            groups = _split(files, workers)
            if len(groups) <= 1:
                found = [
                    r
                    for g in groups
                    for r in _check_files(step_store, g, block_nbytes, files_per_pass)
                ]
            else:
                args = [
                    (step_store.url, step_store.storage_options, g, block_nbytes, files_per_pass)
                    for g in groups
                ]
                with ProcessPoolExecutor(len(groups)) as pool:
                    found = [r for part in pool.map(_check_files_at, *zip(*args)) for r in part]
        report.problems += [Problem(MANIFEST_NAME, what) for what in _model_problems(reader)]
    except CheckpointNotFound:
        report.problems.append(Problem(MANIFEST_NAME, "missing: the step is not committed"))
        return report
    except ManifestError as exc:
        report.problems.append(Problem(MANIFEST_NAME, str(exc)))
        return report
    _fill(report, found, files)
    present = step_store.walk()
    report.extra_files = sorted(k for k in present if k not in files and k != MANIFEST_NAME)
    return report


def _model_problems(reader: ManifestReader) -> list[str]:
    """The model record checked against every tensor's shape; a version-2 manifest is streamed
    for the shapes (no shard records kept)."""
    if reader.whole is not None:
        return model_record_problems(reader.whole)
    assert reader.head is not None
    shapes = {
        fqn: TensorRecord(shape=rec.shape, dtype=rec.dtype) for fqn, rec in reader.iter_tensors()
    }
    return model_record_problems(reader.head.manifest(shapes, partial=False))


def _fill(report: VerifyReport, found: list[tuple[str, str, int]], files: dict[str, Any]) -> None:
    """Problems grouped by file in file order (the manifest's first), files and bytes counted."""
    order = {name: i for i, name in enumerate(sorted(files))}
    problems = [Problem(f, what) for f, what, _ in found if f]
    seen = set()
    for p in sorted(problems, key=lambda p: (p.file != MANIFEST_NAME, order.get(p.file, -1))):
        if (p.file, p.what) not in seen:
            seen.add((p.file, p.what))
            report.problems.append(p)
    report.num_files = len(files)
    report.nbytes_checked = sum(n for f, _, n in found if not f)
