"""``shardsmith train``: flags onto :class:`~shardsmith.trainer.config.TrainConfig`, then the
launcher (or, with ``--dry-run``, the estimate of :mod:`shardsmith.sizing.estimate`).

Every default is the config dataclass's own (:class:`~shardsmith.cli.options.FieldOption`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from typing import Any

import click

from shardsmith.cli.greedy import GreedyOption
from shardsmith.cli.options import (
    TIER_FIELDS,
    IntListType,
    dry_run_option,
    field_option,
    json_option,
    layout_options,
    local_tier_options,
    make_dims,
    model_from_flags,
    model_options,
    plural,
    stack,
    storage_option,
    tensor_format_option,
    zarr_codec_option,
)

T, OPT, C, FC = "TrainConfig", "OptimConfig", "CheckpointConfig", "FaultConfig"

run_options = stack(
    click.option(
        "--nproc-per-node",
        type=int,
        default=None,
        help="Start this many local workers via torchrun's API (default: the layout's world "
        "size; ignored under an external torchrun).",
    ),
    field_option(
        T,
        "steps",
        "--steps",
        "--train-iters",
        type=int,
        help="Train until this optimizer step (absolute; Megatron: --train-iters).",
    ),
    field_option(
        T,
        "global_batch_size",
        "--global-batch-size",
        type=int,
        help="Samples per optimizer step over all DP ranks.",
    ),
    field_option(
        T,
        "micro_batch_size",
        "--micro-batch-size",
        type=int,
        help="Samples per forward pass (pipeline microbatch / accumulation step).",
    ),
    field_option(OPT, "lr", "--lr", type=float, help="Peak learning rate."),
    field_option(
        OPT,
        "decay_steps",
        "--lr-decay-steps",
        "--lr-decay-iters",
        type=int,
        help="Cosine decay ends at this step (0 = --steps; Megatron: --lr-decay-iters).",
    ),
    field_option(OPT, "min_lr_ratio", "--min-lr-ratio", type=float, help="Final LR / peak LR."),
    field_option(
        OPT,
        "warmup_steps",
        "--warmup-steps",
        "--lr-warmup-iters",
        type=int,
        help="Linear warmup steps.",
    ),
    field_option(OPT, "weight_decay", "--weight-decay", type=float, help="AdamW weight decay."),
    field_option(
        OPT,
        "grad_clip",
        "--grad-clip",
        "--clip-grad",
        type=float,
        help="Clip the global gradient norm to this (0 = off).",
    ),
    field_option(T, "seed", "--seed", type=int, help="Init and data-order seed."),
    click.option(
        "--data",
        "--data-path",
        "data",
        multiple=True,
        cls=GreedyOption,
        metavar="[W] SOURCE ...",
        help="Text, .jsonl, .parquet, hf:NAME or a save_to_disk dir, nanoGPT .bin, or a Megatron "
        "indexed PREFIX (.bin+.idx); files, globs or URLs. Weighted blend: --data 0.7 A 0.3 B. "
        "Default: the Python standard library's .py files, found at run time.",
    ),
    field_option(
        "DataConfig",
        "tokenizer",
        "--tokenizer",
        module="shardsmith.trainer.data",
        metavar="PATH",
        help="Hugging Face tokenizer.json (or its directory) or a .tiktoken file. Default: bytes.",
    ),
    field_option(
        "DataConfig",
        "text_key",
        "--text-key",
        module="shardsmith.trainer.data",
        help="Text field of JSONL/Parquet/HF rows.",
    ),
    field_option(
        "DataConfig",
        "cache_dir",
        "--data-cache",
        "data_cache",
        module="shardsmith.trainer.data",
        metavar="DIR|none",
        help="Cache of tokenized text (default: $SHARDSMITH_DATA_CACHE or ~/.cache/shardsmith/tokens).",
    ),
    field_option(
        "DataConfig",
        "token_dtype",
        "--token-dtype",
        module="shardsmith.trainer.data",
        help="Element type of .bin token files: auto, uint16 or uint32.",
    ),
    field_option(
        T,
        "mixed_precision",
        "--mixed-precision",
        type=click.Choice(["fp32", "bf16"]),
        help="bf16 autocast compute with fp32 master weights.",
    ),
    click.option("--bf16", is_flag=True, help="Same as --mixed-precision bf16 (Megatron name)."),
    click.option(
        "--activation-checkpointing",
        type=click.Choice(["full", "selective"]),
        is_flag=False,
        flag_value="full",
        help="Recompute blocks in backward: full (the flag alone) or selective.",
    ),
    field_option(
        T,
        "selective_ac_option",
        "--selective-ac-option",
        help="Selective: 'op' (default) keeps matmul/attention outputs, N recomputes every N-th layer.",
    ),
    field_option(
        T,
        "sequence_parallel",
        "--sequence-parallel",
        is_flag=True,
        help="With --tp > 1: norms and residual activations sharded along the sequence over "
        "the TP group (Megatron: --sequence-parallel); checkpoints are unchanged.",
    ),
    click.option(
        "--virtual-stages",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (interleaved pipeline; rank r holds chunks r, r+P, ...).",
    ),
    click.option(
        "--num-layers-per-virtual-pipeline-stage",
        "layers_per_virtual_stage",
        type=int,
        default=None,
        help="Layers per model chunk (Megatron's flag): --virtual-stages = num_layers / (pp x N).",
    ),
    click.option(
        "--expert-tensor-parallel-size",
        "expert_tensor_parallel",
        type=int,
        default=None,
        help="TP degree inside each expert (Megatron's flag); experts always use the whole TP "
        "group (w1/w3 column-, w2 row-parallel), so it must equal --tp.",
    ),
    click.option(
        "--pipeline-schedule",
        default="",
        metavar="NAME",
        help="Pipeline schedule: 1f1b, gpipe, interleaved-1f1b, looped-bfs, interleaved-zb, "
        "or the V-shaped zbv and dualpipev (with --virtual-stages 2; rank r holds chunks r "
        "and 2P-1-r) (default: interleaved-1f1b with virtual stages, else 1f1b).",
    ),
    field_option(
        T,
        "fsdp_reshard_after_forward",
        "--fsdp-reshard-after-forward",
        type=click.Choice(["default", "always", "never"]),
        help="FSDP parameter exchange (torchtitan's): 'always' regathers every microbatch (least "
        "memory), 'never' once per step (stage params + fp32 grads unsharded for the step), "
        "'default': never under pipelining, else always.",
    ),
    field_option(
        T,
        "compile",
        "--compile",
        is_flag=True,
        help="torch.compile each transformer block (in place: checkpoint names unchanged).",
    ),
    click.option(
        "--profile-steps",
        type=IntListType(),
        default="",
        metavar="N,N,...",
        help="Trace these steps with the PyTorch profiler: one Chrome trace per rank under "
        "<run dir>/profile/step-N/.",
    ),
    field_option(T, "log_interval", "--log-interval", type=int, help="Print every N steps."),
    field_option(
        T, "run_dir", "--run-dir", help="Where metrics.jsonl goes (default: --ckpt when local)."
    ),
)

checkpoint_options = stack(
    field_option(
        C,
        "url",
        "--ckpt",
        "--save",
        "ckpt",
        metavar="URL",
        help="Checkpoint root (local dir or fsspec URL). Empty = no checkpoints.",
    ),
    field_option(
        C,
        "save_interval",
        "--save-interval",
        type=int,
        help="Checkpoint every K steps (0 = only at the end).",
    ),
    field_option(
        C,
        "async_save",
        "--async-save/--no-async-save",
        help="Write checkpoints in the background after a host snapshot.",
    ),
    tensor_format_option(
        f"shardsmith.trainer.config:{C}.tensor_format",
        "Checkpoint tensor format: one safetensors file per rank, or one zarr v3 "
        "array per tensor (opens in plain zarr).",
    ),
    zarr_codec_option,
    field_option(
        C,
        "init_from",
        "--init-from",
        metavar="URL",
        help="Start from this checkpoint's model weights (any layout; fresh optimizer, step 0) "
        "when there is nothing to resume, e.g. the output of `shardsmith import-hf`.",
    ),
    field_option(
        C,
        "keep_last",
        "--keep-last",
        type=int,
        help="After each commit keep only the newest N committed steps (0 = all).",
    ),
    field_option(
        C,
        "keep_every",
        "--keep-every",
        type=int,
        help="...but also keep every step divisible by M (0 = none).",
    ),
    field_option(
        C,
        "resume",
        "--resume",
        "--load",
        metavar="auto|none|URL",
        help="auto: newest committed step under --ckpt; none; or a root/step URL (Megatron: --load).",
    ),
    field_option(
        C,
        "reset_optimizer",
        "--reset-optimizer",
        is_flag=True,
        help="Resume the step count and data position with a fresh AdamW (e.g. from a --model-only "
        "checkpoint); recorded as an event. Without it a checkpoint lacking optimizer state is refused.",
    ),
    field_option(
        C,
        "data_change",
        "--data-change",
        metavar="continue|restart",
        help="Resuming with other --data (sources, weights, --text-key, --token-dtype): continue = "
        "the new data from the saved global sample index; restart = the new data from sample 0 "
        "(step, LR schedule and optimizer continue). Recorded as an event. Without it such a "
        "resume is refused.",
    ),
    field_option(
        C,
        "overwrite",
        "--overwrite",
        is_flag=True,
        help="Start a new run in a --ckpt root that holds another run's steps, deleting them first. "
        "Without it such a start is refused.",
    ),
)

fault_options = stack(
    click.option(
        "--max-restarts",
        type=int,
        default=0,
        show_default=True,
        help="Restart the worker group this many times after a failure.",
    ),
    click.option(
        "--restart",
        "restart_mode",
        type=click.Choice(["torchrun", "in-process"]),
        default="torchrun",
        show_default=True,
        help="How a failed group restarts: torchrun (the elastic agent starts every worker anew) or "
        "in-process (survivors rejoin in place, warm spares replace the dead; README 'Recovery').",
    ),
    click.option(
        "--spares",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="With --restart in-process: warm spares that replace dead ranks; none left: shrink.",
    ),
    field_option(
        FC,
        "preempt_deadline",
        "--preempt-deadline",
        type=float,
        help="Seconds from SIGTERM/SIGUSR1 to a committed checkpoint and exit 0.",
    ),
    field_option(
        FC,
        "collective_timeout",
        "--collective-timeout",
        type=float,
        help="Seconds a collective waits for its peers before the job fails (from the first step on).",
    ),
    field_option(
        FC,
        "init_timeout",
        "--init-timeout",
        type=float,
        help="Collective timeout during start-up, resume and the first step.",
    ),
    field_option(
        FC,
        "hang_factor",
        "--hang-factor",
        type=float,
        help="Dump every rank's stacks when a step runs this many times the median step.",
    ),
    field_option(
        FC,
        "hang_min_seconds",
        "--hang-min-seconds",
        type=float,
        help="...but never before a step has run this long.",
    ),
    field_option(
        FC,
        "max_bad_steps",
        "--max-bad-steps",
        type=int,
        help="Non-finite steps in a row (each skipped) before rolling back to the last checkpoint.",
    ),
    field_option(
        FC,
        "max_rollbacks",
        "--max-rollbacks",
        type=int,
        help="Fail the run after this many rollbacks.",
    ),
    field_option(
        FC,
        "peak_flops",
        "--peak-flops",
        type=float,
        help="Peak FLOP/s of one device, for MFU (e.g. 989e12: H100 SXM bf16); 0 = no MFU.",
    ),
)

D = "shardsmith.trainer.detect"
detect_options = stack(
    field_option(
        "DetectConfig",
        "straggler_every",
        "--straggler-every",
        module=D,
        type=int,
        help="Gather every rank's compute and wait times every N steps (0 = off).",
    ),
    field_option(
        "DetectConfig",
        "straggler_factor",
        "--straggler-factor",
        module=D,
        type=float,
        help="A rank is slow when its compute time exceeds the median by this factor.",
    ),
    field_option(
        "DetectConfig",
        "straggler_windows",
        "--straggler-windows",
        module=D,
        type=int,
        help="Slow windows in a row before a straggler event names the rank.",
    ),
    field_option(
        "DetectConfig",
        "check_replay_every",
        "--check-replay-every",
        module=D,
        type=int,
        help="Re-run every N-th step's forward and backward and compare the gradients (0 = off).",
    ),
    field_option(
        "DetectConfig",
        "on_sdc",
        "--on-sdc",
        module=D,
        type=click.Choice(["stop", "skip-step", "continue"]),
        help="After a replay mismatch: stop the job, drop the step's update, or only report.",
    ),
    field_option(
        "DetectConfig",
        "replay_tolerance",
        "--replay-tolerance",
        module=D,
        type=float,
        help="Allowed |diff| / max|grad| of a replay; negative = 0 on CPU (bitwise), 1e-5 on CUDA.",
    ),
    field_option(
        T,
        "wandb",
        "--wandb",
        is_flag=True,
        help="Also log to Weights & Biases (offline unless WANDB_MODE is set; `wandb sync` uploads).",
    ),
)


@click.command()
@layout_options
@model_options
@run_options
@checkpoint_options
@local_tier_options
@fault_options
@detect_options
@dry_run_option(
    "Check the configuration and print per-rank memory, FLOPs and pipeline bubble; start nothing."
)
@json_option("the --dry-run report")
@click.option(
    "--gpu",
    "gpu_name",
    default=None,
    metavar="NAME",
    help="With --dry-run: judge the memory against this accelerator (a100-80gb, h100, h200, b200).",
)
@click.option(
    "--gpu-memory",
    default=None,
    metavar="SIZE",
    help="With --dry-run: judge the memory against this much per GPU (e.g. 80GB, 141GB).",
)
@storage_option
def train(**flags: Any) -> None:
    """Train a Llama model with TP x PP x DP, or --dry-run it.

    --model picks a published shape (llama3-8b ...); model flags override it. --dry-run
    starts nothing: it checks the configuration and prints per-rank parameters, memory,
    activations, the pipeline bubble and FLOPs per step."""
    external = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if external else flags["nproc_per_node"]
    cfg = train_config(flags, world)
    cfg.check_layout()  # every layout and batch error, before any process starts (no torch yet)
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise click.UsageError("--wandb needs the wandb package: pip install wandb")
    if flags["dry_run"]:
        note = unsized_note(cfg) if flags["dp_shard"] == -1 and world is None else ""
        from shardsmith.cli.dry_run import device_nbytes, gpu_of, print_estimate

        accel = gpu_of(flags)
        print_estimate(
            cfg, flags["model_preset"], flags["as_json"], device_nbytes(flags), note, accel
        )
        return
    from shardsmith.trainer.checkpoint import COMMAND_ENV
    from shardsmith.trainer.data import expand_source
    from shardsmith.trainer.observe import run_dir_note
    from shardsmith.trainer.runtime import prepare

    # A mistyped path or glob: here, not in every worker after start-up.
    for source in cfg.data.sources:
        expand_source(source)

    # The step to load is resolved here, once, and every check that a manifest allows is made
    # before torch is imported and before any worker starts.
    os.environ[COMMAND_ENV] = json.dumps(["shardsmith", *sys.argv[1:]])  # "go on with" hints
    resolved = prepare(cfg)
    if resolved is None:
        return
    cfg = resolved
    if external:
        from shardsmith.trainer import run_training
        from shardsmith.trainer.runtime import exit_process, setup_process

        setup_process()  # as the launcher's workers: log levels, stacks on fatal signals
        run_training(cfg)
        exit_process(0)  # finished and flushed: no teardown (see exit_process)
    os.environ.setdefault("SHARDSMITH_LAUNCH_TIME", repr(time.time()))  # goodput's start
    dims = cfg.parallel
    click.echo(
        f"training {dims.describe()} on {plural(dims.world_size, 'process')} to step {cfg.steps}"
        + ("" if cfg.checkpoint.url else " (no --ckpt: no checkpoint will be saved)")
        + run_dir_note(cfg),
        err=True,
    )
    if flags["restart_mode"] == "in-process":
        from shardsmith.trainer.runtime import launch_in_process

        code = launch_in_process(
            cfg, dims.world_size, max_restarts=flags["max_restarts"], spares=flags["spares"]
        )
    else:
        from shardsmith.trainer.runtime.launch import launch

        code = launch(cfg, dims.world_size, max_restarts=flags["max_restarts"])
    if code:
        raise SystemExit(code)


def unsized_note(cfg: Any) -> str:
    """The dry run's line when --dp-shard -1 met no world size."""
    return (
        "note: --dp-shard -1 (the default) takes the rest of the world size, which a dry run "
        f"does not know: dp_shard {cfg.parallel.dp_shard} here; pass --dp-shard N (or "
        "--nproc-per-node N) for the job you will launch"
    )


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another torchelastic agent), tested
    without importing torch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


#: The flags :func:`make_dims` takes, in its order (the world size goes between the two parts).
DIMS_FLAGS = ("tp", "pp", "dp_shard", "dp_replicate", "pipeline_split", "expert_parallel", "cp")


def train_config(f: dict[str, Any], world: int | None):
    """Map ``train``'s flags onto :class:`~shardsmith.trainer.config.TrainConfig` (one field each)."""
    from shardsmith.storage.store import parse_storage_options
    from shardsmith.trainer import DetectConfig, FaultConfig, OptimConfig, TrainConfig, ac_fields
    from shardsmith.trainer.checkpoint import CheckpointConfig
    from shardsmith.trainer.data import DataConfig, parse_data_args, resolve_vocab_size

    def pick(*names: str) -> dict[str, Any]:
        return {n: f[n] for n in names}

    sources, weights = parse_data_args(f["data"])
    data = DataConfig(
        sources=sources,
        weights=weights,
        token_dtype=f["token_dtype"],
        seed=f["seed"],
        tokenizer=f["tokenizer"],
        text_key=f["text_key"],
        cache_dir=f["data_cache"],
    )
    model = model_from_flags(f)
    check_expert_tensor_parallel(f)
    if f["vocab_size"] is not None or data.tokenizer:  # the tokenizer's vocab unless given
        model = dataclasses.replace(model, vocab_size=resolve_vocab_size(data, f["vocab_size"]))
    return TrainConfig(
        model=model,
        parallel=make_dims(
            *map(f.get, DIMS_FLAGS[:5]),
            world,
            *map(f.get, DIMS_FLAGS[5:]),
            virtual_stages=virtual_stages(f, model),
        ),
        optim=OptimConfig(
            **pick("lr", "decay_steps", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip")
        ),
        data=data,
        checkpoint=CheckpointConfig(
            url=f["ckpt"],
            storage_options=parse_storage_options(f["storage_options"]),
            **pick(
                "save_interval",
                "resume",
                "init_from",
                "keep_last",
                "keep_every",
                "async_save",
                "tensor_format",
                "zarr_codec",
                "reset_optimizer",
                "overwrite",
                "data_change",
                *TIER_FIELDS,
            ),
        ),
        fault=FaultConfig(
            derive_dp_shard=f["dp_shard"] == -1,
            **pick(
                "preempt_deadline",
                "collective_timeout",
                "init_timeout",
                "hang_factor",
                "hang_min_seconds",
                "max_bad_steps",
                "max_rollbacks",
                "peak_flops",
            ),
        ),
        detect=DetectConfig(
            **pick(
                "straggler_every",
                "straggler_factor",
                "straggler_windows",
                "check_replay_every",
                "on_sdc",
                "replay_tolerance",
            )
        ),
        mixed_precision="bf16" if f["bf16"] else f["mixed_precision"],
        **ac_fields(f["activation_checkpointing"], f["selective_ac_option"]),
        **pick(
            *("steps", "global_batch_size", "micro_batch_size", "seed", "sequence_parallel"),
            *("pipeline_schedule", "fsdp_reshard_after_forward", "compile", "profile_steps"),
            *("log_interval", "run_dir", "wandb"),
        ),
    )


def check_expert_tensor_parallel(f: dict[str, Any]) -> None:
    """Raise ConfigError when ``--expert-tensor-parallel-size`` is given and differs from
    ``--tp`` (shardsmith splits every expert over the whole TP group, Megatron's default)."""
    from shardsmith.errors import ConfigError

    etp = f.get("expert_tensor_parallel")
    if etp is not None and etp != f["tp"]:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp}: experts are split over the whole TP group; "
            f"use {f['tp']} (= --tp) or leave it out"
        )


def virtual_stages(f: dict[str, Any], model: Any) -> int:
    """``--virtual-stages``, or num_layers / (pp x ``--num-layers-per-virtual-pipeline-stage``)
    (Megatron's derivation); 1 when neither is given.

    Raises:
        ConfigError: both given and disagreeing, or the layers do not divide.
    """
    from shardsmith.errors import ConfigError

    given, per_chunk = f.get("virtual_stages"), f.get("layers_per_virtual_stage")
    if per_chunk is None:
        return given or 1
    if per_chunk < 1 or model.num_layers % (f["pp"] * per_chunk):
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage {per_chunk}: num_layers={model.num_layers} "
            f"must be a multiple of pp={f['pp']} x {per_chunk}"
        )
    derived = model.num_layers // (f["pp"] * per_chunk)
    if given is not None and given != derived:
        raise ConfigError(
            f"--virtual-stages {given} disagrees with --num-layers-per-virtual-pipeline-stage "
            f"{per_chunk} ({model.num_layers} layers / pp {f['pp']} / {per_chunk} = {derived})"
        )
    return derived
