"""What a reshard did (:class:`ReshardReport`), and resuming an interrupted one:
``<dst step>/.reshard-progress*.json`` records each finished target file (size, CRC-32C)
under the plan's id; a rerun of the same plan re-checks those files instead of rewriting
them (:mod:`shardsmith.reshard.engine`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from shardsmith.reshard.stream import FileResult
from shardsmith.storage.store import Store

log = logging.getLogger(__name__)

#: the progress file of a one-process reshard (process ``r`` of several: ``.reshard-progress-000rr.json``).
PROGRESS_NAME = ".reshard-progress.json"


@dataclass
class ReshardReport:
    """What a reshard did.

    Attributes:
        step, target: the step and the target step directory's URL.
        num_files: target files written (by this process); num_skipped: files kept from an
            interrupted run (by this process).
        num_target_files / target_nbytes: files and bytes of the whole committed target, every
            rank's (set by the process that commits).
        nbytes_written: bytes written; nbytes_verified: bytes re-read to check kept files.
        nbytes_read / nbytes_needed: source bytes read (chunk-aligned) / bytes used.
        peak_buffer_nbytes: the executor's buffer high-water mark (its accounting).
        seconds: wall time.
        committed: this process committed the result (rank 0, or the only process).
        verified: with ``verify``, the diff of the result against the source
            (a :class:`~shardsmith.reshard.diff.DiffReport`; its ``equal`` says whether they agree).
    """

    step: int
    target: str
    num_files: int = 0
    num_skipped: int = 0
    nbytes_written: int = 0
    num_target_files: int = 0
    target_nbytes: int = 0
    nbytes_verified: int = 0
    nbytes_read: int = 0
    nbytes_needed: int = 0
    peak_buffer_nbytes: int = 0
    seconds: float = 0.0
    committed: bool = False
    verified: Any = None


def load_progress(dst: Store, plan_id: str, mine: set[str]) -> dict[str, dict[str, Any]]:
    """Files of ``mine`` (this process's share) that an interrupted run of the same plan
    finished (any rank's progress file): name -> {nbytes, crc32c}. Other ranks of this very
    run may already have saved progress for their own files: those are not counted."""
    kept: dict[str, dict[str, Any]] = {}
    for name in dst.list_dir():
        if not name.startswith(".reshard-progress"):
            continue
        try:
            data = json.loads(dst.read(name))
        except (FileNotFoundError, ValueError):
            log.warning("%s is unreadable; its files will be written again", dst.url_of(name))
            continue
        if (
            not isinstance(data, dict)
            or data.get("plan_id") != plan_id
            or not isinstance(data.get("files"), dict)
        ):
            log.warning(
                "%s belongs to a different reshard (source, layout or options changed); "
                "its files will be written again",
                dst.url_of(name),
            )
            continue
        kept.update({k: v for k, v in data["files"].items() if isinstance(v, dict) and k in mine})
    if kept:
        log.info(
            "resuming: %s written by an interrupted run",
            "1 target file was" if len(kept) == 1 else f"{len(kept)} target files were",
        )
    return kept


def save_progress(dst: Store, name: str, plan_id: str, results: dict[str, FileResult]) -> None:
    """Record the finished files of ``results`` (size, CRC-32C) under ``plan_id`` in ``name``."""
    files = {n: {"nbytes": r.record.nbytes, "crc32c": r.record.crc32c} for n, r in results.items()}
    dst.write(name, json.dumps({"plan_id": plan_id, "files": files}, indent=1).encode())
