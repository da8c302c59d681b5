"""Asynchronous checkpointing: training is blocked at most while state is copied to host.

:class:`AsyncCheckpointer` keeps one set of host staging buffers (allocated at the
first save, reused afterwards, pinned when CUDA is present) and, per save, copies the
tensors this rank writes into them (the *snapshot*), then serializes, checksums, uploads
and commits in a background thread, using a separate gloo process group for the
commit's collectives so they never interleave with training collectives.

The snapshot itself runs either in :meth:`~AsyncCheckpointer.save` (the default: the
caller is blocked for one copy of its state) or, once :meth:`~AsyncCheckpointer.overlap_with`
has been given the optimizer, in the background thread too: ``save`` then returns at
once, the copy overlaps the next forward/backward (which read but never write parameters
and optimizer state), and the optimizer's next ``step`` waits for the copy to finish (a
step pre-hook), so the snapshot is exactly the state ``save`` was called with. On CUDA
the copy runs on its own stream, ordered after the work queued before ``save``.

At most one save is in flight: the next :meth:`save` and :meth:`wait` join it first.
A background failure is logged when it happens, never committed, and raised as
:class:`~shardsmith.errors.SaveError` by the next :meth:`save` or :meth:`wait`; except that,
given ``on_failure``, a failure every rank agrees on (:class:`~shardsmith.errors.SaveNotCommitted`)
goes to that callback instead (the caller decides whether the run goes on).

``save`` itself makes no collective call: what the ranks must agree on (this rank's RNG
state, clearing a step saved before) is exchanged in the background part
(:func:`~shardsmith.trainer.checkpoint.save_load.write_and_commit`), on this saver's own group.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardsmith.errors import SaveError, SaveNotCommitted
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.storage import crash_point, step_dir
from shardsmith.storage.manifest import MANIFEST_NAME
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.local_tier import LocalTier, replicate
from shardsmith.trainer.checkpoint.save_load import (
    SaveResult,
    WritePlan,
    plan_local_writes,
    write_and_commit,
)
from shardsmith.trainer.parallel import device_type

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """One rank's async saver. Construct on every rank at the same time (creates a group).

    Args:
        root: checkpoint root store.
        model_cfg, dims: model and layout.
        on_commit: called in the background thread after a successful commit.
        on_failure: called in the background thread with ``(step, error, blocked seconds)``
            when a persistent save failed on every rank alike (:class:`SaveNotCommitted`);
            :meth:`wait` then raises nothing for it. None: :meth:`wait` raises it.
        tensor_format, zarr_codec: see :func:`~shardsmith.trainer.checkpoint.save_load.write_and_commit`.
        local: the node-local tier (:mod:`shardsmith.trainer.checkpoint.local_tier`): a save given a
            ``local_doc`` stages every box this rank holds, writes them there first (and to
            the buddy), then the persistent subset to ``root`` from the same host buffers.

    Attributes:
        snapshot_wait_seconds: total time callers waited for background snapshots
            (:meth:`wait_snapshot`, e.g. in the optimizer's step pre-hook).
    """

    def __init__(
        self,
        root: Store,
        model_cfg: ModelConfig,
        dims: ParallelDims,
        on_commit: Callable[[SaveResult], None] | None = None,
        *,
        tensor_format: str = "safetensors",
        zarr_codec: str = "",
        local: LocalTier | None = None,
        on_failure: Callable[[int, SaveNotCommitted, float], None] | None = None,
    ) -> None:
        self.root, self.model_cfg, self.dims, self.local = root, model_cfg, dims, local
        self.on_failure = on_failure
        self.tensor_format, self.zarr_codec = tensor_format, zarr_codec
        self.group = dist.new_group(backend="gloo")
        self.on_commit = on_commit
        self.overlap_snapshot = False
        self.snapshot_wait_seconds = 0.0
        self._staging: dict[str, torch.Tensor] = {}
        self._snapshot_done = threading.Event()
        self._snapshot_done.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream = (
            torch.cuda.Stream() if device_type() == "cuda" else None
        )  # not on the CPU fallback
        self._waited = 0.0
        self.last_result: SaveResult | None = None
        self.last_local_seconds = 0.0

    def overlap_with(self, optimizer: torch.optim.Optimizer) -> None:
        """Take snapshots in the background from now on; ``optimizer.step`` waits for the
        snapshot in flight before it changes anything (a step pre-hook).

        Only call it when nothing but this optimizer's steps modifies the saved tensors
        between a :meth:`save` and the next one (anything else must call
        :meth:`wait_snapshot` or :meth:`wait` first, as a rollback's load does).
        """
        optimizer.register_step_pre_hook(lambda *_: self.wait_snapshot())
        self.overlap_snapshot = True

    def _stage(self, plan: WritePlan, ready: Any) -> WritePlan:
        """Copy the tensors to write into reused host buffers (the snapshot).

        ``ready``: a CUDA event recorded on the caller's stream at :meth:`save` (or None);
        the copies run on this saver's stream after it."""
        pin = self._stream is not None
        entries = []
        if self._stream is not None:  # a new thread starts on device 0: stay on this rank's own GPU
            torch.cuda.set_device(self._stream.device)
        with torch.cuda.stream(self._stream) if pin else contextlib.nullcontext():
            if ready is not None:
                assert self._stream is not None
                self._stream.wait_event(ready)
            for fqn, t, box in plan.entries:
                buf = self._staging.get(fqn)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                    self._staging[fqn] = buf
                buf.copy_(t.detach(), non_blocking=pin)
                entries.append((fqn, buf, box))
        if self._stream is not None:
            self._stream.synchronize()
        return WritePlan(plan.step, plan.specs, entries)

    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        *,
        config: dict[str, Any],
        state: dict[str, Any],
        persistent: bool = True,
        local_doc: dict[str, Any] | None = None,
        started: float | None = None,
        rng: dict[str, Any] | None = None,
    ) -> float:
        """Snapshot and start a background save. Collective over all ranks (same arguments'
        kinds on every rank: ``persistent`` and whether ``local_doc`` is given).

        Without :meth:`overlap_with` the snapshot is taken before this returns; with it, in the
        background (that optimizer's next step waits for it).

        Args:
            persistent: write and commit the step under ``root``.
            local_doc: the rank manifest (:meth:`LocalTier.rank_doc`): also write the step to
                the local tier, and to the buddy rank. Needs ``local``.
            started: ``time.perf_counter()`` when the caller's blocking began (None: now).
            rng: this rank's RNG entry (see ``save_load.write_and_commit``).

        Returns:
            Seconds the caller was blocked (since ``started``: waiting for the previous save +
            planning + the snapshot when it is not overlapped + starting the background thread).

        Raises:
            SaveError: the previous background save failed.
            CheckpointError: the tensors do not match the sharding plan.
        """
        t0 = time.perf_counter()
        self.wait()
        plan = (
            plan_local_writes(step, tensors, self.model_cfg, self.dims, dist.get_rank(self.group))
            if persistent
            else None
        )
        local_plan = (
            self.local.plan(step, tensors)
            if self.local is not None and local_doc is not None
            else None
        )
        staged = local_plan or plan  # the local plan holds the persistent one's boxes
        assert staged is not None, "save() with neither tier"
        self._waited = 0.0
        self._snapshot_done.clear()
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        if not self.overlap_snapshot:
            crash_point("async.before_snapshot", step=step)  # test hooks (storage/crashpoints.py)
            try:
                staged = self._stage(staged, ready)
            finally:
                self._snapshot_done.set()
        blocked: list[float] = []  # the caller's time and this call's, filled once started
        handed_over = threading.Event()
        job = (staged, plan, local_doc, config, {"state": state, "rng": rng}, blocked, t0, ready)
        self._thread = threading.Thread(
            target=self._run, args=(*job, handed_over), name=f"shardsmith-save-{step}", daemon=True
        )
        self._thread.start()  # waits for the thread to run: part of the caller's blocked time
        now = time.perf_counter()
        blocked += [now - (t0 if started is None else started), now - t0]
        handed_over.set()
        return blocked[0]

    def _run(
        self,
        staged: WritePlan,
        plan: WritePlan | None,
        local_doc: dict[str, Any] | None,
        config: dict[str, Any],
        state: dict[str, Any],  # {"state": manifest state, "rng": this rank's entry}
        blocked: list[float],
        t0: float,
        ready: Any,
        handed_over: threading.Event,
    ) -> None:
        try:
            if not self._snapshot_done.is_set():
                crash_point("async.before_snapshot", step=staged.step)
                try:
                    staged = self._stage(staged, ready)
                finally:
                    self._snapshot_done.set()
            crash_point("async.after_snapshot", step=staged.step)
            if local_doc is not None:
                self._write_local(staged, local_doc)
            if plan is None:
                return
            buffers = {fqn: t for fqn, t, _ in staged.entries}
            plan = WritePlan(
                plan.step, plan.specs, [(fqn, buffers[fqn], box) for fqn, _, box in plan.entries]
            )
            nbytes = write_and_commit(
                self.root,
                plan,
                model_cfg=self.model_cfg,
                dims=self.dims,
                config=config,
                state=state["state"],
                group=self.group,
                tensor_format=self.tensor_format,
                zarr_codec=self.zarr_codec,
                rng=state["rng"],
            )
            handed_over.wait()  # ``blocked`` is filled once save() is back from starting this thread
            self.last_result = SaveResult(
                plan.step,
                nbytes,
                time.perf_counter() - t0,
                blocked[0] + self._waited,
                blocked[1] + self._waited,
            )
            crash_point("async.after_commit")
            if self.on_commit is not None:
                self.on_commit(self.last_result)
        except SaveNotCommitted as exc:  # every rank alike: on_failure decides (else wait raises)
            if self.on_failure is None:
                self._error = self._failure(staged.step, plan is not None, exc)
            else:
                handed_over.wait()
                self.on_failure(staged.step, exc, blocked[0] + self._waited)
        except BaseException as exc:  # never dies silently: logged now, raised by the next call
            self._error = self._failure(staged.step, plan is not None, exc)

    def _failure(self, step: int, persistent: bool, exc: BaseException) -> BaseException:
        """Log a background save's failure as what happened, and return what :meth:`wait` raises.

        Rank 0 writes the manifest before it tells the others; a rank that fails after that
        (the confirmation never came, a dead peer, the ``on_commit`` callback) did not fail to
        save: the step is committed, and the line and the error say so instead of "failed".
        """
        if persistent and self._committed(step):
            log.warning(
                "step %d is committed (rank 0 wrote its manifest), but this rank failed after the "
                "commit: %s: %s",
                step,
                type(exc).__name__,
                exc,
            )
            return SaveError(
                f"checkpoint step {step} is committed (complete and loadable); after the commit "
                f"this rank failed: {type(exc).__name__}: {exc}"
            )
        log.error("background save of step %d failed: %s", step, exc)
        return exc

    def _committed(self, step: int) -> bool:
        """True when ``step``'s manifest is in the persistent root (False if that cannot be told)."""
        try:
            return self.root.exists(f"{step_dir(step)}/{MANIFEST_NAME}")
        except Exception:  # the store itself failing: say nothing we do not know
            return False

    def _write_local(self, staged: WritePlan, local_doc: dict[str, Any]) -> None:
        """The local tier: this rank's files, then (with replicas) the exchange with the buddies."""
        assert self.local is not None
        t0 = time.perf_counter()
        files = self.local.write(staged, local_doc)
        if self.local.replicas:
            crash_point("local.before_replicate", step=staged.step)
            replicate(self.local, staged.step, files, self.group)
        self.last_local_seconds = time.perf_counter() - t0

    def wait_snapshot(self) -> None:
        """Block until the save in flight (if any) has copied its tensors; then they may change."""
        if not self._snapshot_done.is_set():
            t0 = time.perf_counter()
            self._snapshot_done.wait()
            self._waited += time.perf_counter() - t0
            self.snapshot_wait_seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the in-flight save (if any) finishes; raise its failure.

        Raises:
            SaveError: the background save failed (not committed, unless a peer or the
                ``on_commit`` callback failed after the commit: the message says which).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, SaveError):
                raise exc
            # Not a SaveError: a peer or the on_commit callback failed, possibly after the commit.
            raise SaveError(
                f"background checkpoint save failed: {type(exc).__name__}: {exc}; its step "
                "may or may not be committed (`shardsmith ls` tells), the newest committed "
                "step is complete either way"
            ) from exc
