"""The trainer's configuration: one small dataclass per component, one root.

The root :class:`TrainConfig` is saved in every manifest (``config``) and can be
rebuilt from it with :meth:`TrainConfig.from_json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.trainer.data import DataConfig

__all__ = ["ModelConfig", "ParallelDims", "DataConfig", "OptimConfig", "CheckpointConfig",
           "FaultConfig", "TrainConfig"]


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW (Loshchilov & Hutter 2019) with linear warmup and cosine decay.

    lr(step) = lr * (step+1)/warmup_steps during warmup, then
    min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 (SGDR, Loshchilov & Hutter 2017),
    where min_lr = lr * min_lr_ratio and progress runs 0 -> 1 from warmup_steps to
    decay_steps (0 = the run's ``steps``; set it explicitly when a run will be extended on
    resume, as Megatron's ``--lr-decay-iters``), constant at min_lr afterwards.
    """

    lr: float = 3e-3
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.decay_steps < 0:
            raise ConfigError(f"optim.decay_steps={self.decay_steps}: must be >= 0 (0 = steps)")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps}: must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip}: must be >= 0 (0 disables)")


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
            array per tensor, chunked on shard boundaries; see ``storage/zarr_format.py``).
        zarr_codec: compression of the optimizer state in zarr checkpoints: ``""`` (none),
            ``zstd``, ``gzip``, optionally with a level (``zstd:5``).
        init_from: a checkpoint (root or step URL, any layout) whose *model weights* start
            this run when nothing is resumed: fresh optimizer, step 0 (e.g. from
            ``shardsmith import-hf``).
        keep_last, keep_every: retention applied after each commit (0 = keep all); incomplete
            steps are always collected (see :func:`shardsmith.storage.gc.gc_after_commit`).
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

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval}: must be >= 0")
        if self.keep_last < 0 or self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last}, keep_every={self.keep_every}: "
                              "must be >= 0 (0 = keep all)")
        if self.tensor_format not in ("safetensors", "zarr"):
            raise ConfigError(f"checkpoint.tensor_format={self.tensor_format!r}: choose 'safetensors' or 'zarr'")
        if self.zarr_codec:
            if self.tensor_format != "zarr":
                raise ConfigError(f"checkpoint.zarr_codec={self.zarr_codec!r} needs tensor_format='zarr' "
                                  "(safetensors checkpoints are not compressed)")
            from shardsmith.storage.zarr_format import parse_codec

            parse_codec(self.zarr_codec)


@dataclass(kw_only=True)
class FaultConfig:
    """How the trainer survives failures (see :mod:`shardsmith.trainer.fault`).

    Attributes:
        preempt_deadline: seconds from the first SIGTERM/SIGUSR1 to a committed checkpoint
            and exit 0; a rank still busy after that exits 1 (stacks dumped).
        collective_timeout: seconds a training collective (every group of the mesh, gloo
            and NCCL) may wait for its peers before it fails, from the first step on.
        init_timeout: the timeout before that (``init_process_group(timeout=max(init_timeout,
            collective_timeout))``): start-up, resume and the first step wait for the slowest
            process; the background checkpoint group keeps it too.
        hang_factor: the watchdog dumps every thread's stack of a rank whose current step
            has run longer than ``max(hang_min_seconds, hang_factor * median step time)``.
        hang_min_seconds: lower bound of that threshold (the first step's threshold is
            ``hang_factor * hang_min_seconds``: no median exists yet).
        max_bad_steps: this many consecutive steps with a non-finite loss or gradient norm
            (each skipped) roll back to the last committed checkpoint and skip their data.
        max_rollbacks: more rollbacks than this in one process fail the run.
        peak_flops: peak FLOP/s of one device for model-FLOPs utilization (e.g. 989e12 for
            an H100 SXM in bf16 dense); 0 = do not report MFU.
        derive_dp_shard: ``dp_shard`` was not fixed by the user (``--dp-shard -1``): when the
            job's world size differs from the layout (an elastic restart with fewer or more
            processes) it is re-derived as ``world / (pp * dp_replicate * tp)``.
    """

    preempt_deadline: float = 300.0
    collective_timeout: float = 600.0
    init_timeout: float = 600.0
    hang_factor: float = 10.0
    hang_min_seconds: float = 60.0
    max_bad_steps: int = 3
    max_rollbacks: int = 3
    peak_flops: float = 0.0
    derive_dp_shard: bool = False

    def __post_init__(self) -> None:
        for name in ("preempt_deadline", "collective_timeout", "init_timeout", "hang_min_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fault.{name}={getattr(self, name)}: must be > 0 seconds")
        if not self.hang_factor > 1:
            raise ConfigError(f"fault.hang_factor={self.hang_factor}: must be > 1 (a multiple of the "
                              "median step time)")
        if self.max_bad_steps < 1:
            raise ConfigError(f"fault.max_bad_steps={self.max_bad_steps}: must be >= 1")
        if self.max_rollbacks < 0:
            raise ConfigError(f"fault.max_rollbacks={self.max_rollbacks}: must be >= 0")
        if self.peak_flops < 0:
            raise ConfigError(f"fault.peak_flops={self.peak_flops}: must be >= 0 FLOP/s (0 = no MFU)")


@dataclass(kw_only=True)
class TrainConfig:
    """Root config of a training run.

    Attributes:
        steps: optimizer steps to reach (absolute, so a resumed run stops at the same step).
        global_batch_size: samples per optimizer step, over all DP ranks.
        micro_batch_size: samples per forward pass; gradient accumulation (or pipeline
            microbatches) makes up the rest: ``global / (micro * dp)`` per rank.
        seed: model init and data order.
        mixed_precision: ``fp32`` or ``bf16`` (autocast compute, fp32 master weights).
        activation_checkpointing: recompute each block in backward.
        log_interval: print every this many steps.
        run_dir: where metrics.jsonl goes (default: the checkpoint root, else none).
        fault: preemption, hang, bad-step and elastic settings.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelDims = field(default_factory=ParallelDims)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    steps: int = 40
    global_batch_size: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    mixed_precision: str = "fp32"
    activation_checkpointing: bool = False
    log_interval: int = 1
    run_dir: str = ""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps={self.steps}: must be >= 0")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError(f"global_batch_size={self.global_batch_size}, micro_batch_size="
                              f"{self.micro_batch_size}: both must be >= 1")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ConfigError(f"mixed_precision={self.mixed_precision!r}: use 'fp32' or 'bf16'")

    def num_microbatches(self) -> int:
        """Microbatches per rank per step; raises ConfigError when the batch does not divide."""
        dp = self.parallel.dp
        per_rank = self.global_batch_size * 1.0 / (self.micro_batch_size * dp)
        if per_rank != int(per_rank) or per_rank < 1:
            good = [g for g in range(self.micro_batch_size * dp, 4 * self.global_batch_size + 1,
                                     self.micro_batch_size * dp)][:4]
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size"
                f"={self.micro_batch_size} x dp={dp}; use e.g. global_batch_size in {good}")
        return int(per_rank)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (credentials in storage_options are dropped)."""
        out = dataclasses.asdict(self)
        out["parallel"] = self.parallel.to_json()
        out["data"]["sources"] = list(self.data.sources)
        out["checkpoint"]["storage_options"] = {}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainConfig":
        """Inverse of :meth:`to_json`."""
        data = dict(data)
        return cls(model=ModelConfig.from_json(data.pop("model")),
                   parallel=ParallelDims.from_json(data.pop("parallel")),
                   optim=OptimConfig(**data.pop("optim")),
                   data=DataConfig(**{**data.pop("data")}),
                   checkpoint=CheckpointConfig(**data.pop("checkpoint")),
                   fault=FaultConfig(**data.pop("fault", {})), **data)
