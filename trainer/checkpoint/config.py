"""Configuration of a job's checkpoints: the persistent tier (``--ckpt``, often object
storage) and the node-local tier (``--local-ckpt``, :mod:`shardsmith.trainer.checkpoint.local_tier`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import ConfigError
from shardsmith.storage.manifest import TENSOR_FORMATS

#: ``--data-change`` values ("": not given).
DATA_CHANGES = ("", "continue", "restart")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and when to checkpoint.

    Attributes:
        url: checkpoint root (local dir or fsspec URL); empty = no checkpoints.
        save_interval: save every this many steps (0 = only at the end).
        resume: ``auto`` (newest committed step under ``url`` if any), ``none``, or a URL
            of a root or step directory.
        storage_options: fsspec options (credentials, endpoint).
        save_final: save after the last step.
        async_save: snapshot to host memory, then write and commit in the background
            (training is blocked only for the snapshot; at most one save in flight).
        tensor_format: ``safetensors`` (one file per writing rank) or ``zarr`` (one zarr
            array per tensor, chunked on shard boundaries; see ``storage/formats/zarr_format.py``).
        zarr_codec: compression of the optimizer state in zarr checkpoints: ``""`` (none),
            ``zstd``, ``gzip``, optionally with a level (``zstd:5``).
        init_from: a checkpoint (root or step URL, any layout) whose *model weights* start
            this run when nothing is resumed: fresh optimizer, step 0 (e.g. from
            ``shardsmith import-hf``).
        keep_last, keep_every: retention applied after each commit (0 = keep all) to this
            run's steps only; incomplete steps are always collected (see
            :func:`shardsmith.storage.gc.gc_after_commit`).
        reset_optimizer: resume the step count, data position and LR schedule of a checkpoint
            but start a fresh AdamW (e.g. from a ``--model-only`` one); recorded as an event.
        overwrite: start a new run in a root that holds another run's steps, deleting them
            (loudly) before anything is saved. Without it such a start is refused.
        local_ckpt: the node-local tier (a local directory: node-local disk or ``/dev/shm``);
            empty = none. Each rank writes its own state there (``node-NNNNN/`` per node, see
            :mod:`shardsmith.trainer.checkpoint.local_tier`); recovery prefers it to ``url``.
        local_save_interval: write the local tier every this many steps (>= 1).
        max_failed_saves: a failed persistent save is a ``save_failed`` event and one line, and
            training goes on (the next interval retries, the local tier keeps saving); this
            many failures in a row stop the job, naming the newest committed step (>= 1). The
            default, 3, bounds the work at risk to three save intervals.
        local_replicas: 0 or 1: also copy each rank's local-tier state to its buddy rank one
            node over (over the process group), so losing a whole node loses no local step.
        data_change: how the data position maps when a resume changes the data (``--data``,
            blend weights, ``--text-key``, ``--token-dtype``): ``continue`` keeps the global
            sample index, ``restart`` starts the new sources at sample 0 (step, LR schedule and
            optimizer continue); ``""`` refuses such a resume. Recorded as a run event.
        resume_step: filled in by the launcher (:func:`shardsmith.trainer.runtime.preflight.resolve`),
            never by a user: the exact, absolute URL of the step to resume (``""``: nothing to
            resume). Workers load exactly that step on their first start and never choose
            again; None (a library caller that did not resolve): the workers choose.
        simulate_nodes: split the ranks into this many simulated nodes (tests, benches on one
            machine: the local tier's buddies, and whether replicas share the reads of a local
            checkpoint); 0 = nodes of ``LOCAL_WORLD_SIZE`` ranks (torchrun's, the real ones).
    """

    url: str = ""
    save_interval: int = 0
    resume: str = "auto"
    storage_options: dict[str, Any] = field(default_factory=dict)
    save_final: bool = True
    async_save: bool = True
    tensor_format: str = "safetensors"
    zarr_codec: str = ""
    init_from: str = ""
    keep_last: int = 0
    keep_every: int = 0
    reset_optimizer: bool = False
    overwrite: bool = False
    local_ckpt: str = ""
    local_save_interval: int = 1
    max_failed_saves: int = 3
    local_replicas: int = 0
    simulate_nodes: int = 0
    data_change: str = ""
    resume_step: str | None = None

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval}: must be >= 0")
        if self.keep_last < 0 or self.keep_every < 0:
            raise ConfigError(
                f"checkpoint.keep_last={self.keep_last}, keep_every={self.keep_every}: "
                "must be >= 0 (0 = keep all)"
            )
        if self.tensor_format not in TENSOR_FORMATS:
            raise ConfigError(
                f"checkpoint.tensor_format={self.tensor_format!r}: choose one of {list(TENSOR_FORMATS)}"
            )
        if self.zarr_codec:
            if self.tensor_format != "zarr":
                raise ConfigError(
                    f"checkpoint.zarr_codec={self.zarr_codec!r} needs tensor_format='zarr' "
                    "(safetensors checkpoints are not compressed)"
                )
            from shardsmith.storage.formats import parse_codec

            parse_codec(self.zarr_codec)
        if self.data_change not in DATA_CHANGES:
            raise ConfigError(
                f"checkpoint.data_change={self.data_change!r}: choose 'continue' (keep the global "
                "sample index) or 'restart' (the new data from sample 0)"
            )
        self._check_local_tier()

    def _check_local_tier(self) -> None:
        if self.max_failed_saves < 1:
            raise ConfigError(f"checkpoint.max_failed_saves={self.max_failed_saves}: must be >= 1")
        if self.local_save_interval < 1:
            raise ConfigError(
                f"checkpoint.local_save_interval={self.local_save_interval}: must be >= 1"
            )
        if self.local_replicas not in (0, 1):
            raise ConfigError(
                f"checkpoint.local_replicas={self.local_replicas}: choose 0 or 1 (a copy on "
                "the buddy rank one node over)"
            )
        if self.simulate_nodes < 0:
            raise ConfigError(
                f"checkpoint.simulate_nodes={self.simulate_nodes}: must be >= 0 (0 = real nodes)"
            )
        if not self.local_ckpt:
            return
        if "://" in self.local_ckpt and not self.local_ckpt.startswith("file://"):
            raise ConfigError(
                f"--local-ckpt {self.local_ckpt}: the local tier is a local directory "
                "(node-local disk or /dev/shm); object storage goes in --ckpt"
            )
        if not self.url or not self.async_save:
            raise ConfigError(
                "--local-ckpt needs --ckpt (the persistent tier it sits in front of) and "
                "--async-save (it writes the async snapshot); give both"
            )
