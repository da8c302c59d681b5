"""Scale-out: several processes convert one reshard plan together, coordinated through storage.

Every process computes the same plan (it is pure), takes its share of the target files
(:func:`assign_files`), converts them straight from and to storage, and publishes its
files' manifest records in ``<dst step>/.reshard-done-<rank>.json``. The coordinator
(rank 0) waits for every rank's record, then commits the manifest last, as in a save.
No process group is needed, so no torch: ranks and the attempt come from the
environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``) or from :func:`spawn_local` (``nproc``, ``--nproc-per-node``).
A rank that fails publishes its error, so the coordinator stops waiting and names it;
records of an earlier attempt are never mixed in (each carries its attempt id).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass

from shardsmith.errors import CheckpointError, ConfigError
from shardsmith.layout import lpt_assign
from shardsmith.reshard.planner import ReshardPlan, TargetFile
from shardsmith.reshard.stream import FileResult
from shardsmith.storage.manifest import FileRecord, ShardRecord
from shardsmith.storage.store import Store

DONE_PREFIX = ".reshard-done-"


@dataclass(frozen=True)
class Share:
    """Which process this is among those converting one plan.

    Attributes:
        rank: this process, ``0 <= rank < world_size``; rank 0 commits.
        world_size: processes converting the plan.
        attempt: names one launch of all processes (records of others are ignored).
    """

    rank: int = 0
    world_size: int = 1
    attempt: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"reshard rank {self.rank} of world size {self.world_size}: need "
                "0 <= rank < world_size (check RANK and WORLD_SIZE)"
            )

    @classmethod
    def launched(cls) -> "Share | None":
        """:meth:`from_env` when a launcher (torchrun, :func:`spawn_local`) set ``WORLD_SIZE``, else ``None``."""
        return cls.from_env() if "WORLD_SIZE" in os.environ else None

    @classmethod
    def from_env(cls) -> "Share":
        """The share torchrun (or :func:`spawn_local`) describes in the environment;
        a single process when ``WORLD_SIZE`` is unset."""
        env = os.environ
        attempt = env.get("SHARDSMITH_RESHARD_ATTEMPT") or (
            f"{env.get('TORCHELASTIC_RUN_ID', 'run')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            attempt=attempt,
        )


def assign_files(files: list[TargetFile], world_size: int) -> list[list[TargetFile]]:
    """Target files of each process: largest first to the least loaded (greedy
    longest-processing-time, Graham 1969), ties to the lowest rank; deterministic."""
    ranks = lpt_assign({f.name: f.nbytes for f in files}, world_size)
    out: list[list[TargetFile]] = [[] for _ in range(world_size)]
    for tf in sorted(files, key=lambda f: f.name):
        out[ranks[tf.name]].append(tf)
    return out


def done_name(rank: int) -> str:
    """Step-relative key of a rank's published records."""
    return f"{DONE_PREFIX}{rank:05d}.json"


def publish(
    dst: Store, share: Share, plan_id: str, results: list[FileResult], error: str = ""
) -> None:
    """Write this rank's file records (or its error) for the coordinator."""
    files = {
        r.name: {
            "nbytes": r.record.nbytes,
            "crc32c": r.record.crc32c,
            "sidecar": [r.sidecar.nbytes, r.sidecar.crc32c] if r.sidecar else None,
            "shards": {
                fqn: {**s.to_json(), "crc_index": s.crc_index} for fqn, s in r.shards.items()
            },
        }
        for r in results
    }
    dst.write(
        done_name(share.rank),
        json.dumps(
            {"attempt": share.attempt, "plan_id": plan_id, "error": error, "files": files}
        ).encode(),
    )


def _parse_done(raw: bytes, plan: ReshardPlan, rank: int, url: str) -> list[FileResult]:
    """Records a rank published, checked against the plan (names, boxes, byte ranges)."""
    expected = {tf.name: tf for tf in plan.files}
    out = []
    for name, f in json.loads(raw)["files"].items():
        tf = expected.get(name)
        shards = {fqn: ShardRecord(**rec) for fqn, rec in f["shards"].items()}
        if (
            tf is None
            or f["nbytes"] != tf.nbytes
            or set(shards) != {e.fqn for e in tf.entries}
            or any(
                (
                    shards[e.fqn].offsets,
                    shards[e.fqn].lengths,
                    shards[e.fqn].byte_offset,
                    shards[e.fqn].nbytes,
                )
                != (list(e.box.offsets), list(e.box.lengths), e.byte_offset, e.nbytes)
                for e in tf.entries
            )
        ):
            raise CheckpointError(
                f"{url}: rank {rank}'s records of {name} do not match the plan; "
                "were the ranks started with different options? Nothing was committed"
            )
        side = FileRecord(*f["sidecar"]) if f.get("sidecar") else None
        out.append(FileResult(name, FileRecord(f["nbytes"], f["crc32c"]), shards, False, side))
    return out


def gather(dst: Store, share: Share, plan: ReshardPlan, timeout_s: float) -> list[FileResult]:
    """Coordinator: wait until every rank has published for this attempt; all records.

    Raises:
        CheckpointError: a rank reported an error, published records that do not match the
            plan, or did not publish within ``timeout_s`` (each names the rank).
    """
    deadline, delay = time.monotonic() + timeout_s, 0.05
    found: dict[int, list[FileResult]] = {}
    while True:
        for rank in range(share.world_size):
            if rank in found:
                continue
            try:
                raw = dst.read(done_name(rank))
            except FileNotFoundError:
                continue
            data = json.loads(raw)
            if data.get("attempt") != share.attempt or data.get("plan_id") != plan.plan_id:
                continue  # left by an earlier attempt
            if data.get("error"):
                raise CheckpointError(
                    f"reshard rank {rank} failed: {data['error']}; nothing was "
                    "committed — run the same command again to resume"
                )
            found[rank] = _parse_done(raw, plan, rank, dst.url_of(done_name(rank)))
        if len(found) == share.world_size:
            return [r for rank in sorted(found) for r in found[rank]]
        if time.monotonic() > deadline:
            missing = sorted(set(range(share.world_size)) - set(found))
            raise CheckpointError(
                f"{dst.url}: ranks {missing} did not finish within {timeout_s:.0f}s; "
                "nothing was committed — run the same command again to resume"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def cleanup(dst: Store) -> None:
    """Delete the coordination and progress files (after the commit)."""
    for name in dst.list_dir():
        if name.startswith((DONE_PREFIX, ".reshard-progress")):
            dst.delete(name)


def spawn_local(
    command: list[str], share: Share, env: dict[str, str]
) -> dict[int, subprocess.Popen]:
    """Start ranks ``1 .. share.world_size - 1`` of ``share``'s attempt as local processes running
    ``command`` (with ``env`` added); the caller is rank 0. Returns rank -> process.

    Called by :func:`shardsmith.reshard.api.reshard` with ``nproc > 1`` (not under torchrun).
    """
    base = {
        **os.environ,
        **env,
        "WORLD_SIZE": str(share.world_size),
        "LOCAL_WORLD_SIZE": str(share.world_size),
        "SHARDSMITH_RESHARD_ATTEMPT": share.attempt,
    }
    return {
        r: subprocess.Popen(command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(1, share.world_size)
    }


def publish_for_dead(
    procs: dict[int, subprocess.Popen],
    dst: Store,
    share: Share,
    plan_id: str,
    stop: threading.Event,
    poll_s: float = 0.1,
) -> None:
    """Until ``stop`` is set: publish an error for each process of ``procs`` that exits non-zero
    without having published for this attempt (killed, crashed before :func:`publish`), so the
    coordinator's :func:`gather` names it instead of waiting out its timeout.

    Runs on a thread of the process that started ``procs`` (rank 0)."""
    pending = dict(procs)
    while pending and not stop.wait(poll_s):
        for rank, proc in list(pending.items()):
            code = proc.poll()
            if code is None:
                continue
            del pending[rank]
            if code and not _published(dst, rank, share.attempt):
                publish(
                    dst,
                    Share(rank, share.world_size, share.attempt),
                    plan_id,
                    [],
                    error=f"the process exited with code {code}",
                )


def _published(dst: Store, rank: int, attempt: str) -> bool:
    try:
        return json.loads(dst.read(done_name(rank))).get("attempt") == attempt
    except FileNotFoundError:
        return False
