"""What a job does when a persistent save fails: a line and a retry, never the run, until a
stated number of failures in a row (DESIGN.md, fourth round: "a healthy run outlives its
storage").

A save that fails before its commit (the object store down, throttled past the retries,
access revoked, the disk full) fails on every rank alike
(:class:`~shardsmith.errors.SaveNotCommitted`: the outcome is broadcast), so every rank counts
it the same way and the decision to stop, taken when the next save or the end of the run joins
the save in flight, is the same on every rank without another collective. Nothing of the
failed step is committed (readers ignore its directory; retention collects it); the next
interval saves again, and the node-local tier goes on saving meanwhile. Megatron-LM users
asked for this in 2025 ("Distributed Checkpoint Saving Fault-Tolerant (Weak Dependency)",
NVIDIA/Megatron-LM#1435).

A save that commits is followed by the retention (:func:`retention_after_commit`): old and
incomplete steps deleted, each said once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from shardsmith.errors import SaveError
from shardsmith.storage import gc_after_commit
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.config import CheckpointConfig

log = logging.getLogger(__name__)


class SaveOutcomes:
    """The consecutive failed persistent saves of one rank's job.

    Args:
        max_failed: ``checkpoint.max_failed_saves``: this many failures in a row stop the job.
        rank: this rank (rank 0 logs the one line per failure).
        event: the metrics.jsonl channel (``save_failed`` events).

    Attributes:
        failed_in_row: persistent saves failed since the last commit.
        failed_step, error: the newest failed step and its cause (None / "" after a commit).
        committed: the newest step committed or loaded by this job and its URL (None: none).
    """

    def __init__(self, max_failed: int, rank: int, event: Callable[[dict[str, Any]], None]) -> None:
        self.max_failed, self.rank, self.event = max_failed, rank, event
        self.failed_in_row = 0
        self.failed_step: int | None = None
        self.error = ""
        self.committed: tuple[int, str] | None = None
        self._lock = threading.Lock()

    def failed(self, step: int, exc: BaseException, blocked_seconds: float) -> None:
        """Record a failed save of ``step`` (any thread; every rank calls it alike): one line
        on rank 0 naming the cause, and a ``save_failed`` event."""
        with self._lock:
            self.failed_in_row += 1
            self.failed_step, self.error = step, str(exc)
            count = self.failed_in_row
        if self.rank == 0:
            then = "the job stops" if count >= self.max_failed else "the next save retries"
            log.error(
                "%s; %s (%d in a row, --max-failed-saves %d)", exc, then, count, self.max_failed
            )
        self.event(
            {
                "event": "save_failed",
                "step": step,
                "error": str(exc),
                "consecutive": count,
                "max_failed_saves": self.max_failed,
                "blocked_seconds": round(blocked_seconds, 4),
            }
        )

    def succeeded(self, step: int, url: str) -> None:
        """A commit of ``step`` at ``url`` (or a load of it): the count starts over."""
        with self._lock:
            self.failed_in_row, self.failed_step, self.error = 0, None, ""
            self.committed = (step, url)

    def newest(self) -> str:
        """``step N (URL)`` of the newest committed step, for messages."""
        if self.committed is None:
            return "no step of this job is committed"
        return f"the newest committed step is {self.committed[0]} ({self.committed[1]})"

    def check(self, *, final: bool) -> None:
        """After the save in flight was joined (every rank at the same point): stop the job
        when ``max_failed`` saves failed in a row, or (``final``: the end of the run, a
        preemption) when the last one failed.

        Raises:
            SaveError: naming the failed step, its cause and the newest committed step.
        """
        if self.failed_step is None:
            return
        if final:
            raise SaveError(
                f"the final checkpoint (step {self.failed_step}) failed and is not committed: "
                f"{self.error}; {self.newest()}"
            )
        if self.failed_in_row >= self.max_failed:
            raise SaveError(
                f"{self.failed_in_row} checkpoint saves in a row failed (--max-failed-saves "
                f"{self.max_failed}), the last of step {self.failed_step}: {self.error}; "
                f"{self.newest()}: fix the storage, then resume from it"
            )


def retention_after_commit(
    root: Store, ckpt: CheckpointConfig, runs: set[str] | None
) -> dict[str, Any] | None:
    """Rank 0, after a commit: delete what ``--keep-last``/``--keep-every`` leave out and the
    incomplete steps (:func:`~shardsmith.storage.gc.gc_after_commit`, never raising on storage
    trouble), of the runs ``runs``.

    Returns:
        The ``gc`` event of what was deleted (``deleted_steps``; ``deleted``: each step's URL
        and why), which the console says as one line per step; None when nothing was.
    """
    gone = []

    def note(decision: Any) -> None:
        if decision.delete:
            gone.append(decision)

    gc_after_commit(
        root,
        keep_last=ckpt.keep_last or None,
        keep_every=ckpt.keep_every or None,
        runs=runs,
        on_decision=note,
    )
    if not gone:
        return None
    return {
        "event": "gc",
        "deleted_steps": [d.step for d in gone],
        "deleted": [{"url": root.url_of(d.name), "reason": d.reason} for d in gone],
    }
