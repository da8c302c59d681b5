"""The trainer's configuration: one small dataclass per component, one root.

The root :class:`TrainConfig` is saved in every manifest (``config``) and can be
rebuilt from it with :meth:`TrainConfig.from_json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import ConfigError
from shardsmith.layout import (
    FSDP_RESHARD_POLICIES,
    ModelConfig,
    ParallelDims,
    check_sequence_split,
    validate_layout,
)
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.data import DataConfig
from shardsmith.trainer.detect import DetectConfig
from shardsmith.trainer.fault import FaultConfig
from shardsmith.trainer.optim import OptimConfig

__all__ = [
    "ModelConfig",
    "ParallelDims",
    "DataConfig",
    "OptimConfig",
    "CheckpointConfig",
    "FaultConfig",
    "DetectConfig",
    "TrainConfig",
]


#: Pipeline schedules (``--pipeline-schedule``; torch classes in
#: :data:`shardsmith.trainer.pipeline.SCHEDULES`); the last three run several chunks per rank.
PIPELINE_SCHEDULES: tuple[str, ...] = (
    "1f1b",
    "gpipe",
    "interleaved-1f1b",
    "looped-bfs",
    "interleaved-zb",
    "zbv",
    "dualpipev",
)
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
#: Schedules whose two chunks per rank form a V (``ParallelDims.pipeline_style = "v"``):
#: torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, both exactly 2 chunks per rank.
V_SHAPED_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")


def ac_fields(mode: str | None, selective_option: str = "") -> dict[str, Any]:
    """The :class:`TrainConfig` fields of ``--activation-checkpointing [full|selective]`` and
    ``--selective-ac-option``: ``selective`` without an option is per op (``op``); an
    option without a mode is selective."""
    if mode == "selective" or (mode is None and selective_option):
        return {"activation_checkpointing": False, "selective_ac_option": selective_option or "op"}
    return {"activation_checkpointing": mode == "full", "selective_ac_option": selective_option}


def default_schedule(virtual_stages: int) -> str:
    """``interleaved-1f1b`` with virtual stages, else ``1f1b``."""
    return "interleaved-1f1b" if virtual_stages > 1 else "1f1b"


def check_pipeline_microbatches(
    schedule: str, pp: int, virtual_stages: int, num_microbatches: int, samples: int
) -> None:
    """Refuse a number of microbatches that ``schedule``'s torch class refuses in every worker.

    The rules are those of ``torch.distributed.pipelining.schedules``: ``Schedule1F1B`` needs
    at least as many microbatches as stages; the interleaved schedules (``interleaved-1f1b``,
    ``interleaved-zb``) run ``max(1, M // pp)`` rounds and need ``M`` to be a multiple of
    them. ``gpipe`` and ``looped-bfs`` take any ``M``. ``pp`` = 1 has no schedule.
    ``samples``: samples per microbatch step over the data-parallel ranks
    (``micro_batch_size x dp``), to name the global batch sizes that work.

    Raises:
        ConfigError: naming the microbatches, the stages and the global batch sizes that work.
    """
    if pp < 2:
        return
    m = num_microbatches
    if schedule == "1f1b" and m < pp:
        raise ConfigError(
            f"pipeline schedule 1f1b with pp={pp} stages needs at least {pp} microbatches per "
            f"step, got {m} (global_batch_size / (micro_batch_size x dp)); use "
            f"--global-batch-size >= {pp * samples}, a smaller --micro-batch-size, or "
            "--pipeline-schedule gpipe"
        )
    rounds = max(1, m // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zb") and m % rounds:
        good = sorted({(m // pp) * pp, (m // pp + 1) * pp})
        raise ConfigError(
            f"pipeline schedule {schedule} with pp={pp} x virtual_stages={virtual_stages} runs "
            f"{m} microbatches in {rounds} rounds of pp, so it needs a multiple of {rounds}, or of "
            f"pp={pp}; got {m}: use --global-batch-size "
            f"{' or '.join(str(g * samples) for g in good)}"
        )


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
        activation_checkpointing: recompute each block in backward (full activation
            checkpointing).
        selective_ac_option: selective activation checkpointing (torchtitan's
            ``selective_ac_option``; ``--activation-checkpointing selective``): ``op``
            recomputes each block but its matmul and attention outputs (every second matmul
            recomputed too), ``N`` recomputes every N-th layer whole; empty = off. Exclusive
            with ``activation_checkpointing``.
        sequence_parallel: with tp > 1, shard norms and the residual stream along the
            sequence over the TP group (Megatron's ``--sequence-parallel``); no checkpoint change.
        pipeline_schedule: ``1f1b``, ``gpipe``, ``interleaved-1f1b``, ``looped-bfs``,
            ``interleaved-zb``, ``zbv`` or ``dualpipev``
            (:data:`shardsmith.trainer.pipeline.SCHEDULES`); empty = ``interleaved-1f1b``
            with virtual stages (``zbv`` under the V pipeline style), else ``1f1b``. The
            schedule decides ``parallel.pipeline_style``: ``v`` for :data:`V_SHAPED_SCHEDULES`
            (set here), ``loop`` for the others.
        fsdp_reshard_after_forward: ``default``, ``always`` or ``never``
            (:mod:`shardsmith.layout.fsdp_policy`; torchtitan's option of the same name):
            ``default`` exchanges a stage's parameters and gradients once per step under
            pipelining and resharding after every forward without it; ``always`` is the
            memory-saving per-microbatch exchange.
        compile: ``torch.compile`` each block in place (checkpoint FQNs unchanged).
        profile_steps: steps to trace with the PyTorch profiler (one Chrome trace per rank
            under the run directory, :mod:`shardsmith.trainer.observe.profiling`).
        log_interval: print every this many steps.
        run_dir: where metrics.jsonl goes (default: the checkpoint root, else none).
        fault: preemption, hang, bad-step and elastic settings.
        detect: stragglers, replay checks for silent data corruption
            (:mod:`shardsmith.trainer.detect`).
        wandb: also log to Weights & Biases (offline unless ``WANDB_MODE`` says otherwise).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelDims = field(default_factory=ParallelDims)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    steps: int = 40
    global_batch_size: int = 16
    micro_batch_size: int = 2
    seed: int = 1234
    mixed_precision: str = "fp32"
    activation_checkpointing: bool = False
    selective_ac_option: str = ""
    sequence_parallel: bool = False
    pipeline_schedule: str = ""
    fsdp_reshard_after_forward: str = "default"
    compile: bool = False
    profile_steps: tuple[int, ...] = ()
    log_interval: int = 1
    run_dir: str = ""
    wandb: bool = False

    def __post_init__(self) -> None:
        self.profile_steps = tuple(int(s) for s in self.profile_steps)
        if self.steps < 0:
            raise ConfigError(f"steps={self.steps}: must be >= 0")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size}, micro_batch_size="
                f"{self.micro_batch_size}: both must be >= 1"
            )
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ConfigError(f"mixed_precision={self.mixed_precision!r}: use 'fp32' or 'bf16'")
        check_sequence_split(self.model.seq_length, self.parallel, self.sequence_parallel)
        schedule = self.pipeline_schedule
        if schedule and schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule={schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        if schedule in SINGLE_STAGE_SCHEDULES and self.parallel.virtual_stages > 1:
            raise ConfigError(
                f"pipeline_schedule={schedule!r} runs one stage per rank; with virtual_stages="
                f"{self.parallel.virtual_stages} use interleaved-1f1b, looped-bfs or interleaved-zb"
            )
        if self.fsdp_reshard_after_forward not in FSDP_RESHARD_POLICIES:
            raise ConfigError(
                f"fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r}: choose one of "
                f"{', '.join(FSDP_RESHARD_POLICIES)}"
            )
        self._apply_pipeline_style()
        option = self.selective_ac_option
        if option and not (option == "op" or (option.isdigit() and int(option) >= 1)):
            raise ConfigError(
                f"selective_ac_option={option!r}: use 'op' (per op) or a layer frequency N >= 1"
            )
        if option and self.activation_checkpointing:
            raise ConfigError(
                "activation checkpointing is full or selective, not both: drop "
                "--activation-checkpointing or --selective-ac-option"
            )
        if self.log_interval < 0:
            raise ConfigError(f"log_interval={self.log_interval}: must be >= 0 (0 = never print)")

    def check_layout(self) -> int:
        """Every layout and batch condition a worker refuses, checked where no worker has
        started yet: the dry run and the launcher call it, and so does every worker
        (:meth:`shardsmith.trainer.train.Trainer.create`). The layout fits the model
        (:func:`~shardsmith.layout.validate_layout`), the global batch splits into
        microbatches, and the pipeline schedule takes that many
        (:func:`check_pipeline_microbatches`), simulated nodes divide the world; the sequence
        split over cp and sequence parallelism is checked as the config is built.

        Returns:
            microbatches per rank per step.

        Raises:
            LayoutError, ConfigError: naming the value and what would work.
        """
        validate_layout(self.model, self.parallel)
        num_microbatches = self.num_microbatches()
        schedule = self.pipeline_schedule or default_schedule(self.parallel.virtual_stages)
        dims = self.parallel
        samples = self.micro_batch_size * dims.dp
        check_pipeline_microbatches(
            schedule, dims.pp, dims.virtual_stages, num_microbatches, samples
        )
        nodes = self.checkpoint.simulate_nodes  # the rule of local_tier.ranks_per_node
        if nodes and dims.world_size % nodes:
            raise ConfigError(
                f"--simulate-nodes {nodes} does not divide the world size {dims.world_size}"
            )
        return num_microbatches

    @property
    def ac_policy(self) -> bool | str:
        """What :func:`shardsmith.trainer.parallel.apply_ac` does to each block: the selective
        option when set, else whether full activation checkpointing is on."""
        return self.selective_ac_option or self.activation_checkpointing

    def _apply_pipeline_style(self) -> None:
        """Make ``parallel.pipeline_style`` follow the schedule (:data:`V_SHAPED_SCHEDULES`:
        ``v``; another named schedule: ``loop``; none named: the style decides, ``zbv`` for
        ``v``), and check what the V-shaped schedules need (torch 2.13: exactly two chunks
        per rank; DualPipeV at least ``2 * pp`` microbatches)."""
        schedule, parallel = self.pipeline_schedule, self.parallel
        if not schedule and parallel.pipeline_style == "v":
            schedule = self.pipeline_schedule = V_SHAPED_SCHEDULES[0]
        if schedule not in V_SHAPED_SCHEDULES:
            if schedule and parallel.pipeline_style != "loop":
                self.parallel = dataclasses.replace(parallel, pipeline_style="loop")
            return
        if parallel.virtual_stages != 2:
            raise ConfigError(
                f"pipeline_schedule={schedule!r} runs two model chunks per pipeline rank in a V; "
                f"pass --virtual-stages 2 (virtual_stages={parallel.virtual_stages})"
            )
        if schedule == "dualpipev" and self.num_microbatches() < parallel.num_chunks:
            raise ConfigError(
                f"pipeline_schedule='dualpipev' needs at least 2 x pp = {parallel.num_chunks} "
                f"microbatches per rank, got {self.num_microbatches()}; raise the global batch "
                "or lower the micro batch size"
            )
        if parallel.pipeline_style != "v":
            self.parallel = dataclasses.replace(parallel, pipeline_style="v")

    def num_microbatches(self) -> int:
        """Microbatches per rank per step; raises ConfigError when the batch does not divide."""
        dp = self.parallel.dp
        per_rank = self.global_batch_size * 1.0 / (self.micro_batch_size * dp)
        if per_rank != int(per_rank) or per_rank < 1:
            unit = self.micro_batch_size * dp  # the valid sizes: multiples of this
            below = self.global_batch_size // unit * unit
            good = [g for g in (below - unit, below, below + unit, below + 2 * unit) if g >= unit][
                :3
            ]
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size"
                f"={self.micro_batch_size} x dp={dp} = {unit}; the nearest valid sizes are {good}"
            )
        return int(per_rank)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (credentials in storage_options and the launcher's resolved
        ``checkpoint.resume_step`` are dropped; the parallelism fields added later are left
        out at their defaults)."""
        out = dataclasses.asdict(self)
        out["parallel"] = self.parallel.to_json()
        out["data"]["sources"] = list(self.data.sources)
        out["checkpoint"]["storage_options"] = {}
        del out["checkpoint"][
            "resume_step"
        ]  # the launcher's, for its workers only (launch.config_payload)
        local_defaults: dict[str, Any] = {
            "local_ckpt": "",
            "local_save_interval": 1,
            "local_replicas": 0,
            "simulate_nodes": 0,
            "data_change": "",
        }
        for name, value in local_defaults.items():
            if out["checkpoint"][name] == value:  # manifests of runs without a local tier unchanged
                del out["checkpoint"][name]
        for name, default in (
            ("sequence_parallel", False),
            ("pipeline_schedule", ""),
            ("fsdp_reshard_after_forward", "default"),
            ("selective_ac_option", ""),
            ("compile", False),
            ("profile_steps", ()),
            ("wandb", False),
        ):
            if out[name] == default:  # runs without them write the bytes they always wrote
                del out[name]
        if out["detect"] == dataclasses.asdict(DetectConfig()):
            del out["detect"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainConfig":
        """Inverse of :meth:`to_json`."""
        data = dict(data)
        return cls(
            model=ModelConfig.from_json(data.pop("model")),
            parallel=ParallelDims.from_json(data.pop("parallel")),
            optim=OptimConfig(**data.pop("optim")),
            data=DataConfig(**{**data.pop("data")}),
            checkpoint=CheckpointConfig(**data.pop("checkpoint")),
            fault=FaultConfig(**data.pop("fault", {})),
            detect=DetectConfig(**data.pop("detect", {})),
            **data,
        )
