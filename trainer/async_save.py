"""Asynchronous checkpointing: training is blocked only while state is copied to host.

:class:`AsyncCheckpointer` keeps one set of host staging buffers (allocated at the
first save, reused afterwards, pinned when CUDA is present), copies the tensors this
rank writes into them (the only blocking part), then serializes, checksums, uploads
and commits in a background thread, using a separate gloo process group for the
commit's collectives so they never interleave with training collectives.

At most one save is in flight: the next :meth:`save` and :meth:`wait` join it first.
A background failure is logged when it happens, never committed, and raised as
:class:`~shardsmith.errors.SaveError` by the next :meth:`save` or :meth:`wait`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardsmith.errors import SaveError
from shardsmith.reshard.layout import ModelConfig, ParallelDims
from shardsmith.storage.fs import Store
from shardsmith.trainer.checkpoint import SaveResult, WritePlan, plan_local_writes, write_and_commit

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """One rank's async saver. Construct on every rank at the same time (creates a group).

    Args:
        root: checkpoint root store.
        model_cfg, dims: model and layout.
        on_commit: called in the background thread after a successful commit.
    """

    def __init__(self, root: Store, model_cfg: ModelConfig, dims: ParallelDims,
                 on_commit: Callable[[SaveResult], None] | None = None) -> None:
        self.root, self.model_cfg, self.dims = root, model_cfg, dims
        self.group = dist.new_group(backend="gloo")
        self.on_commit = on_commit
        self._staging: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_result: SaveResult | None = None

    def _stage(self, plan: WritePlan) -> WritePlan:
        """Copy the tensors to write into reused host buffers (the blocking part)."""
        pin = torch.cuda.is_available()
        entries = []
        for fqn, t, box in plan.entries:
            buf = self._staging.get(fqn)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._staging[fqn] = buf
            buf.copy_(t.detach(), non_blocking=pin)
            entries.append((fqn, buf, box))
        if pin:
            torch.cuda.synchronize()
        return WritePlan(plan.step, plan.specs, entries)

    def save(self, step: int, tensors: dict[str, torch.Tensor], *, config: dict[str, Any],
             state: dict[str, Any]) -> float:
        """Snapshot and start a background save. Collective over all ranks.

        Returns:
            Seconds the caller was blocked (waiting for the previous save + the snapshot).

        Raises:
            SaveError: the previous background save failed.
        """
        t0 = time.perf_counter()
        self.wait()
        plan = self._stage(plan_local_writes(step, tensors, self.model_cfg, self.dims, dist.get_rank()))
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._run, args=(plan, config, state, blocked, t0),
                                        name=f"shardsmith-save-{step}", daemon=True)
        self._thread.start()
        return blocked

    def _run(self, plan: WritePlan, config: dict[str, Any], state: dict[str, Any], blocked: float,
             t0: float) -> None:
        try:
            nbytes = write_and_commit(self.root, plan, model_cfg=self.model_cfg, dims=self.dims,
                                      config=config, state=state, group=self.group)
            self.last_result = SaveResult(plan.step, nbytes, time.perf_counter() - t0, blocked)
            if self.on_commit is not None:
                self.on_commit(self.last_result)
        except BaseException as exc:  # never dies silently: logged now, raised by the next call
            log.error("background save of step %d failed: %s", plan.step, exc)
            self._error = exc

    def wait(self) -> None:
        """Block until the in-flight save (if any) finishes; raise its failure.

        Raises:
            SaveError: the background save failed (it was not committed).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, SaveError):
                raise exc
            raise SaveError(f"background checkpoint save failed and was not committed: "
                            f"{type(exc).__name__}: {exc}") from exc
