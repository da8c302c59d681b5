"""Checkpoint policy of a training job: when to save, what to resume from, and what a
load restores (the :class:`CheckpointPolicy`, as torchtitan's ``CheckpointManager``).

How bytes are written and read (plan, shard files, manifest, commit) is
:mod:`shardsmith.trainer.checkpoint.save_load` and :mod:`shardsmith.trainer.checkpoint.async_save`; this
module only calls them. Every method that saves or loads is collective: every rank calls
it, in the same order.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from shardsmith.errors import IntegrityError, SaveNotCommitted, TrainingDiverged
from shardsmith.layout import bounding_box, checkpoint_specs, rank_boxes
from shardsmith.storage import (
    check_new_run_root,
    open_manifest,
    remove_runs_except,
    resolve_checkpoint,
    step_dir,
)
from shardsmith.storage.formats import DTYPE_NAMES
from shardsmith.storage.manifest import Manifest, ManifestReader
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint.local_tier import LocalTier
from shardsmith.trainer.checkpoint.run_checks import (
    RunIdentity,
    check_before_load,
    reset_due,
    resume_changes,
)
from shardsmith.trainer.checkpoint.save_load import (
    ReadStats,
    SaveResult,
    finish_upcast,
    init_optimizer_state,
    model_state_tensors,
    raise_agreed,
    save_checkpoint,
    upcast_staging,
)
from shardsmith.trainer.checkpoint.save_outcomes import SaveOutcomes, retention_after_commit
from shardsmith.trainer.checkpoint.shared_reads import (
    load_into_replicas,
    share_reader,
    shares_reads,
)
from shardsmith.trainer.checkpoint.train_state import TrainState
from shardsmith.trainer.comm import any_rank, broadcast_text, gather_json
from shardsmith.trainer.rng import apply_rng, rank_rng_entry

if TYPE_CHECKING:
    from shardsmith.trainer.checkpoint.recovery import StaticManifest
    from shardsmith.trainer.config import TrainConfig

log = logging.getLogger(__name__)

#: Receives one metrics.jsonl record (see :class:`shardsmith.trainer.observe.metrics.EventLog`).
EventFn = Callable[[dict[str, Any]], None]


class CheckpointPolicy:
    """When a job saves, what it resumes from, and what a load restores.

    Construct on every rank at the same time (with ``async_save`` it creates a process
    group). Reports ``save``, ``gc``, ``resume``, ``init_from`` and ``rollback`` events.

    Args:
        cfg: the run's config (``checkpoint``, ``model``, ``parallel``, ``seed``, ``fault``).
        state: this rank's :class:`TrainState` (loads write into it).
        rank, coords: this rank and its mesh coordinates.
        replica_group: the ``dp_replicate`` process group (HSDP replicas) or None: loads from
            the persistent tier read each tensor once per group and broadcast it
            (:func:`~shardsmith.trainer.checkpoint.shared_reads.load_into_replicas`).
        sibling_group: the ``tp`` process group or None: there, tensors whose saved chunks
            several members would read (a load that raises TP) are read once per group
            (:func:`~shardsmith.trainer.checkpoint.shared_reads.load_into_siblings`).
        restarts: torchrun's restart count (see :func:`choose_resume`).
        event: where records go (rank 0 writes them).

    Attributes:
        root: the checkpoint root, None without ``checkpoint.url``.
        last_saved_step: step of the newest checkpoint saved or loaded by this job (-1: none).
        resumed_from: the persistent-tier step :meth:`resume` loaded (None: none).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        state: TrainState,
        *,
        rank: int,
        coords: dict[str, int],
        restarts: int,
        event: EventFn,
        replica_group: Any = None,
        sibling_group: Any = None,
    ) -> None:
        self.cfg, self.state, self.rank, self.coords = cfg, state, rank, coords
        self.replica_group, self.sibling_group = replica_group, sibling_group
        self.restarts, self.event = restarts, event
        ckpt = cfg.checkpoint
        self.root = Store(ckpt.url, ckpt.storage_options) if ckpt.url else None
        self.last_saved_step = -1
        self._source: tuple[tuple[Store, int] | None] | None = None
        self.resumed_from: tuple[Store, int] | None = None
        self.run = RunIdentity(
            id=broadcast_text(RunIdentity.new_id() if rank == 0 else ""), seed=cfg.seed
        )
        self.checkpointer: AsyncCheckpointer | None = None
        self.outcomes = SaveOutcomes(ckpt.max_failed_saves, rank, event)  # failed saves in a row
        self._config = cfg.to_json()  # the manifests' config: fixed for the run, built once
        self.local = LocalTier(cfg, rank) if ckpt.local_ckpt else None  # the node-local tier
        if self.root is not None and ckpt.async_save:
            self.checkpointer = AsyncCheckpointer(
                self.root,
                cfg.model,
                cfg.parallel,
                on_commit=self._on_commit,
                tensor_format=ckpt.tensor_format,
                zarr_codec=ckpt.zarr_codec,
                local=self.local,
                on_failure=self._on_failure,
            )
            self.checkpointer.overlap_with(state.optimizer)  # snapshot overlaps fwd/bwd; step waits

    # ---- saving ---------------------------------------------------------------------------

    def interval_due(self, step: int) -> bool:
        """True when either tier asks for a save after ``step`` (see :meth:`persistent_due`)."""
        return self.persistent_due(step) or (self.local is not None and self.local.due(step))

    def persistent_due(self, step: int) -> bool:
        """True when ``checkpoint.save_interval`` asks for a persistent save after ``step``."""
        interval = self.cfg.checkpoint.save_interval
        return self.root is not None and bool(interval) and step % interval == 0

    def final_due(self, *, preempted: bool = False) -> bool:
        """True when the end of the run (``save_final``) or a ``preempted`` one should save the
        current step (not saved yet, or its save failed); joins the save in flight first."""
        self.wait()
        return (
            self.root is not None
            and (self.cfg.checkpoint.save_final or preempted)
            and self.state.step != self.last_saved_step
        )

    def save(self, *, persistent: bool = True) -> None:
        """Checkpoint the current step (collective). With ``async_save`` this returns after
        the host snapshot and the commit happens in the background (see :meth:`wait`).
        ``persistent=False``: the local tier only (its interval is due; no collective).
        The local tier is written too whenever its interval is due.

        No collective before it returns (async): RNG states and clearing a step saved before
        are agreed in the background (``save_load.write_and_commit``). A failed save is an
        event and one line, and the run goes on (:mod:`.save_outcomes`).

        Raises:
            SaveError: see :meth:`wait`.
        """
        assert self.root is not None
        state, cfg, t0 = self.state, self.cfg, time.perf_counter()
        self.wait()
        init_optimizer_state(state.model, state.optimizer)
        tensors = model_state_tensors(state.model, state.optimizer)
        local = (
            self.local.rank_doc(
                state.step,
                state={**state.state_json(), "run": self.run.to_json()},
                config=self._config,
            )
            if self.local and self.local.due(state.step)
            else None
        )
        saved = {**state.state_json(), "run": self.run.to_json()} if persistent else {}
        rng = rank_rng_entry(self.rank, self.coords) if persistent else None
        if persistent:
            self.last_saved_step = state.step
        if self.checkpointer is not None:
            self.checkpointer.save(
                state.step,
                tensors,
                config=self._config,
                state=saved,
                persistent=persistent,
                local_doc=local,
                started=t0,
                rng=rng,
            )
            return
        try:
            result = save_checkpoint(
                self.root,
                state.step,
                tensors,
                model_cfg=cfg.model,
                dims=cfg.parallel,
                config=self._config,
                state=saved,
                tensor_format=cfg.checkpoint.tensor_format,
                zarr_codec=cfg.checkpoint.zarr_codec,
                rng=rng,
            )
        except SaveNotCommitted as exc:
            self._on_failure(state.step, exc, time.perf_counter() - t0)
            self.outcomes.check(final=False)
            return
        self._on_commit(result)

    def lose_local_node(self) -> None:
        """Test hook (``SHARDSMITH_TEST_LOSE_NODE_AT``): wait for the save in flight, then
        delete this node's local tier, as if its disk were gone."""
        if self.local is not None:
            self.wait()
            shutil.rmtree(self.local.root.root, ignore_errors=True)

    def wait(self, *, final: bool = False) -> None:
        """Join the save in flight (every rank decides alike here).

        Raises:
            SaveError: ``checkpoint.max_failed_saves`` saves failed in a row, or (``final``:
                the end of the run, a preemption) the last one did; or a background save
                failed in a way the ranks may not agree on.
        """
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.outcomes.check(final=final)

    def _on_failure(self, step: int, exc: SaveNotCommitted, blocked_seconds: float) -> None:
        """A persistent save every rank saw fail (the saving thread, or the caller when sync)."""
        self.outcomes.failed(step, exc, blocked_seconds)
        self.last_saved_step = self.outcomes.committed[0] if self.outcomes.committed else -1

    def _on_commit(self, result: SaveResult) -> None:
        """After a commit (in the saving thread): log it; rank 0 collects old and incomplete steps."""
        self.event(
            {
                "event": "save",
                "step": result.step,
                "url": self.root.url_of(step_dir(result.step)) if self.root else "",
                "nbytes": result.nbytes,
                "seconds": round(result.seconds, 4),
                "blocked_seconds": round(result.blocked_seconds, 6),  # sub-ms: microseconds
                "saver_blocked_seconds": round(result.saver_blocked_seconds, 6),
            }
        )
        self.outcomes.succeeded(
            result.step, self.root.url_of(step_dir(result.step)) if self.root else ""
        )
        if self.rank == 0 and self.root is not None:
            gone = retention_after_commit(self.root, self.cfg.checkpoint, self.run.lineage())
            if gone:
                self.event(gone)

    # ---- loading --------------------------------------------------------------------------

    def resume_source(self) -> tuple[Store, int] | None:
        """The persistent-tier step a start loads: the launcher's ``checkpoint.resume_step``,
        or after a restart rank 0's choice (collective once, then remembered; see
        :func:`~shardsmith.trainer.checkpoint.recovery.persistent_source`)."""
        if self._source is None:
            from shardsmith.trainer.checkpoint.recovery import persistent_source

            self._source = (persistent_source(self),)
        return self._source[0]

    def resume(self) -> bool:
        """Load the step :meth:`resume_source` names into the current layout (a corrupt one:
        see :func:`~shardsmith.trainer.checkpoint.recovery.load_resume`), or with nothing to resume the
        weights of ``checkpoint.init_from`` (collective). Sets :attr:`resumed_from`; returns
        False when there is nothing to resume."""
        from shardsmith.trainer.checkpoint.recovery import announce, load_resume, recover_local
        from shardsmith.trainer.checkpoint.resume import one_timeline

        self._check_root()
        if self.local is not None and recover_local(self):
            self.resumed_from = self.resume_source()
            return True
        src = self.resume_source()
        if src is None:
            if self.cfg.checkpoint.init_from:
                self._init_from(self.cfg.checkpoint.init_from)
            return False
        self.resumed_from = load_resume(self, src)
        if self.local is not None:
            announce(self, self.resumed_from[1], "persistent")
        if self.rank == 0 and (left := one_timeline(self.root, self.resumed_from, self.run.id)):
            self.event(
                {"event": "timeline", "resumed_step": self.resumed_from[1], "abandoned_steps": left}
            )
        return True

    def _check_root(self) -> None:
        """Refuse a new run into another run's root; with ``overwrite`` rank 0 deletes the old
        run's steps first (loudly; every rank waits). Collective."""
        ckpt = self.cfg.checkpoint
        if self.root is None:
            return
        check_new_run_root(self.root, ckpt.resume, ckpt.overwrite, restarts=self.restarts)
        deleted: list[int] = []
        if ckpt.overwrite and self.restarts == 0 and self.rank == 0:
            deleted = remove_runs_except(self.root, None)
            if deleted:
                log.warning(
                    "--overwrite: deleted steps %s of the previous run under %s",
                    deleted,
                    self.root.url,
                )
                self.event({"event": "overwrite", "deleted_steps": deleted, "root": self.root.url})
        any_rank(bool(deleted))

    def _read(
        self,
        step_store: Store,
        reader: ManifestReader | StaticManifest,
        tensors: dict[str, torch.Tensor],
        with_optimizer: bool,
        shared: bool = True,
        upcast: bool = False,
    ) -> tuple[list[Any], dict[str, Any]]:
        """Fill ``tensors`` from the checkpoint by box intersection, reading only the manifest
        records of this rank's tensors (``shared``: once per replica group, see
        ``replica_group``, and per TP group where that saves reads, see ``sibling_group``);
        every rank's ``[nbytes_read, nbytes_needed]`` (all-gathered), and the resume event's
        ``replicas_sharing_reads`` (how many replicas split the reads; 1: none) and
        ``tp_siblings_share_reads`` (some TP group read a tensor's union once, see
        ``sibling_group``). ``upcast``: bf16/fp16 tensors fill fp32 ones exactly (``--init-from``).
        A failed read on any rank raises on every rank (an ``IntegrityError`` when any rank's
        data failed verification), after one all-gather, so nobody waits in a collective."""
        cfg = self.cfg
        specs = checkpoint_specs(cfg.model, cfg.parallel, with_optimizer=with_optimizer)
        boxes = rank_boxes(specs, cfg.parallel, self.rank)
        group, siblings = (self.replica_group, self.sibling_group) if shared else (None, None)
        wanted = boxes
        if (
            siblings is not None
        ):  # a sibling may read the TP group's union for all: their records too
            member = [
                rank_boxes(specs, cfg.parallel, r) for r in dist.get_process_group_ranks(siblings)
            ]
            wanted = {f: bounding_box([m[f] for m in member]) for f in boxes}
        manifest = reader.manifest(wanted)  # the records of this rank's (group's) boxes only
        shapes = {f: s.shape for f, s in specs.items()}
        read_share = share_reader(step_store, siblings, cfg.checkpoint.simulate_nodes)
        sharing: dict[str, Any] = {"replicas_sharing_reads": 1}
        error = ""
        staged = upcast_staging(manifest, tensors) if upcast else {}
        try:
            if shares_reads(step_store, group, cfg.checkpoint.simulate_nodes) and all(
                rank_boxes(specs, cfg.parallel, r) == boxes
                for r in dist.get_process_group_ranks(group)
            ):
                stats = load_into_replicas(
                    step_store,
                    manifest,
                    {**tensors, **staged},
                    boxes,
                    shapes,
                    group,
                    reader=read_share,
                )
                sharing["replicas_sharing_reads"] = dist.get_world_size(group)
            else:
                stats = read_share(step_store, manifest, {**tensors, **staged}, boxes, shapes)
        except Exception as exc:  # agreed below: every rank raises, nobody waits
            stats, error = ReadStats(), f"{'I' if isinstance(exc, IntegrityError) else 'C'}{exc}"
        read = gather_json([stats.nbytes_read, stats.nbytes_needed, stats.tensors_shared, error])
        raise_agreed([r[3] for r in read])
        if staged:
            finish_upcast(staged, tensors, boxes)
            sharing["upcast_from"] = sorted({DTYPE_NAMES[t.dtype] for t in staged.values()})
        return read, {**sharing, "tp_siblings_share_reads": any(r[2] for r in read)}

    def _init_from(self, url: str) -> None:
        """Load only the model weights of checkpoint ``url`` (any layout; optimizer state,
        counters and data position stay fresh). Collective."""
        _, step_store, step = resolve_checkpoint(url, self.cfg.checkpoint.storage_options)
        reader = open_manifest(step_store)  # the head: configs, layout, state, index
        manifest = reader.manifest(())
        self._warn(check_before_load(manifest, self.cfg, step_store.url, resume=False))
        read, info = self._read(
            step_store, reader, model_state_tensors(self.state.model, None), False, upcast=True
        )
        self.run.initialized_from(manifest.state, step_store.url, step)
        self.event(
            {
                "event": "init_from",
                "from": step_store.url,
                "source_step": step,
                "saved_layout": reader.manifest(()).layout,
                "nbytes_read": sum(r[0] for r in read),
                **({"upcast_from": info["upcast_from"]} if info.get("upcast_from") else {}),
            }
        )

    def load_step(
        self,
        step_store: Store,
        step: int,
        *,
        reason: str,
        reader: ManifestReader | StaticManifest | None = None,
    ) -> None:
        """Load tensors (resharding by box intersection), counters, data position, LR
        schedule, bad-step state and RNG (restored, or re-derived on a new layout); ``reader``:
        a manifest already in memory (the local tier's), else the step's is read."""
        t0 = time.perf_counter()
        state, cfg = self.state, self.cfg
        shared = reader is None  # not the local tier's: once per replica group
        reader = reader or open_manifest(step_store)  # the head: configs, layout, state, index
        manifest = reader.manifest(())
        reset = reset_due(manifest, cfg.checkpoint.reset_optimizer) and reason != "rollback"
        self._warn(
            check_before_load(manifest, cfg, step_store.url, resume=True, reset_optimizer=reset)
        )
        init_optimizer_state(state.model, state.optimizer)
        tensors = model_state_tensors(state.model, state.optimizer if not reset else None)
        read, sharing = self._read(step_store, reader, tensors, not reset, shared=shared)
        if reason != "rollback":
            self.run.resumed(manifest.state, step_store.url, step)
        state.load_state_json(manifest.state, rollback=reason == "rollback")
        if reason != "rollback":
            self._changes(manifest, step_store.url, step)
        rng = apply_rng(
            manifest.state.get("rng"), cfg.parallel, self.rank, self.coords, cfg.seed, state.step
        )
        self.last_saved_step = step
        self.outcomes.succeeded(step, step_store.url)
        layout = cfg.parallel.to_json()
        self.event(
            {
                "event": "resume",
                "reason": reason,
                "step": step,
                "from": step_store.url,
                "saved_layout": manifest.layout,
                "layout": layout,
                "resharded": any(manifest.layout.get(k) != v for k, v in layout.items()),
                "restart_count": self.restarts,
                "rng": rng,
                "seconds": round(time.perf_counter() - t0, 4),
                "nbytes_read": sum(r[0] for r in read),
                "nbytes_needed": sum(r[1] for r in read),
                **sharing,
            }
        )
        if reset:
            record = {"event": "reset_optimizer", "step": step, "from": step_store.url}
            self.run.events.append(record)
            self.event(record)
            log.warning(
                "--reset-optimizer: continuing from step %d of %s with a fresh AdamW",
                step,
                step_store.url,
            )

    def _changes(self, manifest: Manifest, url: str, step: int) -> None:
        """Report (and apply) another data config or batch size: see :func:`resume_changes`;
        a data change joins the run's events, so every later manifest holds it."""
        sampler = self.state.sampler
        for record in resume_changes(manifest, self.cfg, url, step, sampler.sample_index):
            if record["event"] == "data_change":
                sampler.load_state_dict({"sample_index": record["sample_index"]})
                self.run.events.append(record)
            self.event(record)

    def _warn(self, warnings: list[str]) -> None:
        for line in warnings:
            if self.rank == 0:
                log.warning("%s", line)
            self.event({"event": "warning", "message": line})

    def roll_back(self) -> None:
        """After ``max_bad_steps`` bad steps in a row: load the newest committed checkpoint
        and mark the streak's data window to be skipped (collective; all ranks decide alike).

        Raises:
            TrainingDiverged: no committed checkpoint, or more than ``max_rollbacks``.
        """
        bad_steps, max_rollbacks = self.state.bad_steps, self.cfg.fault.max_rollbacks
        bad_step, streak = self.state.step, bad_steps.consecutive
        window = bad_steps.start_rollback()
        if bad_steps.rollbacks > max_rollbacks:
            raise TrainingDiverged(
                f"step {bad_step}: {streak} bad steps in a row after "
                f"{max_rollbacks} rollbacks already; the run diverges. "
                "Lower --lr, check the data, or raise --max-rollbacks"
            )
        self.wait()
        from shardsmith.trainer.checkpoint.recovery import rollback_step

        latest = rollback_step(self)  # rank 0 decides, every rank loads it
        if self.root is None or latest is None:
            raise TrainingDiverged(
                f"steps {bad_step - streak + 1}..{bad_step} had a non-finite loss or "
                "gradient norm and there is no committed checkpoint to roll back to; "
                "set --ckpt and --save-interval, or lower --lr"
            )
        self.load_step(self.root.child(step_dir(latest)), latest, reason="rollback")
        if self.local is not None:
            self.local.forget_after(latest)
        self.event(
            {
                "event": "rollback",
                "from_step": bad_step,
                "to_step": latest,
                "skip_samples": window,
                "rollbacks": bad_steps.rollbacks,
                "skipped_steps": bad_steps.skipped_steps,
            }
        )
