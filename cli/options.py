"""Every shared click option, defined once. Flags map onto config dataclasses and hold no logic.

Defaults are not restated here: a :class:`FieldOption` reads its default from the dataclass
field (or library function parameter) it fills, when click needs it, so ``shardsmith --help``
and ``ls``/``gc`` never import torch for a default they do not show.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from typing import Any, Callable

import click

from shardsmith.errors import LayoutError
from shardsmith.layout import (
    DTYPE_CHOICES,
    SIZE_HELP,
    ModelConfig,
    ParallelDims,
    parse_nbytes,
    short_nbytes,
)
from shardsmith.sizing import DEFAULT_PRESET, PRESETS

F = Callable[..., Any]

TRAIN_CONFIG = "shardsmith.trainer.config"


def stack(*decorators: F) -> F:
    """Apply ``decorators`` as if written top to bottom above a function."""

    def wrap(fn: F) -> F:
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return wrap


def default_of(ref: str) -> Any:
    """The default ``ref`` names: ``"module:Class.field"`` (a dataclass field),
    ``"module:function.param"`` (a keyword default) or ``"module:NAME"`` (a constant)."""
    module, _, path = ref.partition(":")
    owner_name, _, member = path.partition(".")
    owner = getattr(importlib.import_module(module), owner_name)
    if not member:
        return owner
    if dataclasses.is_dataclass(owner):
        f = {f.name: f for f in dataclasses.fields(owner)}[member]
        return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return inspect.signature(owner).parameters[member].default


class FieldOption(click.Option):
    """A click option whose default is read from ``default_from`` (see :func:`default_of`)
    when click needs it, and shown in ``--help`` (through ``show`` when given)."""

    def __init__(
        self,
        param_decls: Any,
        *,
        default_from: str,
        show: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.default_from, self.show = default_from, show
        kwargs.setdefault("show_default", True)
        super().__init__(param_decls, **kwargs)

    def get_default(self, ctx: click.Context, call: bool = True) -> Any:
        return default_of(self.default_from)

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if self.show is not None and "default" in extra:
            extra["default"] = self.show(self.get_default(ctx))
        return extra


def field_option(cls: str, field: str, *decls: str, module: str = TRAIN_CONFIG, **kwargs: Any) -> F:
    """``--flag`` filling ``cls.field`` (its value lands in the command's ``field`` argument
    unless ``decls`` ends with another name); the default is the field's."""
    names = decls if not decls[-1].startswith("-") else (*decls, field)
    return click.option(*names, cls=FieldOption, default_from=f"{module}:{cls}.{field}", **kwargs)


class SizeType(click.ParamType):
    """A byte count (``500MB``, ``2GiB``, ``4096``) by the one size rule of
    :mod:`shardsmith.layout.sizes`."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_nbytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class IntListType(click.ParamType):
    """Comma-separated integers (``5,3``) -> tuple; empty -> ``()``."""

    name = "N,N,..."

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers, e.g. 5,3", param, ctx)


SIZE = SizeType()


def size_option(*decls: str, default_from: str, help: str) -> F:
    """A byte-count option; the default comes from ``default_from`` and shows as e.g. 256MiB."""
    return click.option(
        *decls,
        cls=FieldOption,
        type=SIZE,
        default_from=default_from,
        show=short_nbytes,
        metavar="SIZE",
        help=f"{help} ({SIZE_HELP}).",
    )


def _set_storage_timeout(ctx: click.Context, param: click.Parameter, value: float | None) -> None:
    """Hand ``--storage-timeout`` to every Store of this process and its workers (environment)."""
    if value is not None:
        if value <= 0:
            raise click.BadParameter(f"{value:g}: must be > 0 seconds", ctx, param)
        os.environ["SHARDSMITH_STORAGE_TIMEOUT"] = repr(value)


storage_option = stack(
    click.option(
        "--storage-option",
        "storage_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable), e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000",
    ),
    click.option(
        "--storage-timeout",
        type=float,
        default=None,
        expose_value=False,
        is_eager=True,
        callback=_set_storage_timeout,
        metavar="SECONDS",
        help="Most seconds one object-store operation may take, retries included (default 60).",
    ),
)


def json_option(what: str) -> F:
    """``--json``: print ``what`` as JSON (for machines) instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


def dry_run_option(what: str) -> F:
    """``--dry-run``: check and report, change nothing."""
    return click.option("--dry-run", is_flag=True, help=what)


def tensor_format_option(default_from: str | None, help: str) -> F:
    """``--format safetensors|zarr``; ``default_from=None``: no default (the source's)."""
    from shardsmith.storage.manifest import TENSOR_FORMATS

    kwargs: dict[str, Any] = (
        {"cls": FieldOption, "default_from": default_from} if default_from else {"default": None}
    )
    return click.option(
        "--format", "tensor_format", type=click.Choice(TENSOR_FORMATS), help=help, **kwargs
    )


zarr_codec_option = click.option(
    "--zarr-codec",
    default="",
    metavar="CODEC",
    help="With --format zarr: compress the optimizer state (zstd, gzip, zstd:5 ...).",
)


def dtype_option(help: str, default_from: str | None = None) -> F:
    """``--dtype``: one choice set for every command (:data:`DTYPE_CHOICES`); no default
    unless ``default_from`` names one."""
    kwargs: dict[str, Any] = (
        {"cls": FieldOption, "default_from": default_from} if default_from else {"default": None}
    )
    return click.option("--dtype", type=click.Choice(sorted(DTYPE_CHOICES)), help=help, **kwargs)


# ---- layout ---------------------------------------------------------------------------------------


def _dims_option(field: str, *decls: str, help: str) -> F:
    return field_option(
        "ParallelDims", field, *decls, module="shardsmith.layout.dims", type=int, help=help
    )


layout_options = stack(
    _dims_option(
        "tp",
        "--tp",
        "--tensor-model-parallel-size",
        help="Tensor-parallel degree (Megatron: --tensor-model-parallel-size).",
    ),
    _dims_option(
        "pp",
        "--pp",
        "--pipeline-model-parallel-size",
        help="Pipeline stages (Megatron: --pipeline-model-parallel-size).",
    ),
    click.option(
        "--dp-shard",
        type=int,
        default=-1,
        help="FSDP2 sharding degree; -1 = the rest of the world size.  [default: -1]",
    ),
    _dims_option(
        "dp_replicate", "--dp-replicate", help="Data-parallel replicas (HSDP replication)."
    ),
    click.option(
        "--pipeline-split",
        type=IntListType(),
        default="",
        metavar="N,N,...",
        help="Layers per pipeline stage, e.g. 5,3 (default: as even as possible).",
    ),
    _dims_option(
        "cp",
        "--cp",
        "--context-parallel-size",
        help="Context-parallel degree: each rank of a cp group holds 2 load-balanced chunks of every "
        "sequence (Megatron: --context-parallel-size). FSDP shards over dp_shard x cp, so "
        "checkpoints are the same for every cp.",
    ),
    _dims_option(
        "expert_parallel",
        "--ep",
        "--expert-model-parallel-size",
        "expert_parallel",
        help="Expert-parallel degree, carved out of the dp_shard ranks: 1 or dp_shard (Megatron: "
        "--expert-model-parallel-size). Checkpoints are the same either way.",
    ),
)


def make_dims(
    tp: int,
    pp: int,
    dp_shard: int,
    dp_replicate: int,
    pipeline_split: tuple[int, ...],
    world: int | None,
    expert_parallel: int = 1,
    cp: int = 1,
    virtual_stages: int = 1,
) -> ParallelDims:
    """ParallelDims from the layout flags; ``dp_shard=-1`` takes the rest of ``world``
    (:meth:`ParallelDims.for_world_size`; 1 when the world size is not known).
    ``virtual_stages`` comes with the split (a split names every chunk: ``pp *
    virtual_stages`` counts).

    Raises:
        LayoutError: the layout does not have ``world`` ranks.
    """
    kw: dict[str, Any] = {
        "pp": pp,
        "dp_replicate": dp_replicate,
        "tp": tp,
        "cp": cp,
        "pipeline_split": pipeline_split,
        "expert_parallel": expert_parallel,
        "virtual_stages": virtual_stages,
    }
    if dp_shard == -1:
        return ParallelDims.for_world_size(
            world if world is not None else tp * pp * dp_replicate * cp, **kw
        )
    dims = ParallelDims(dp_shard=dp_shard, **kw)
    if world is not None and dims.world_size != world:
        raise LayoutError(
            f"layout {dims.describe()} needs {dims.world_size} processes but "
            f"{world} were given; set --nproc-per-node {dims.world_size} or change the layout"
        )
    return dims


# ---- model ----------------------------------------------------------------------------------------

_TINY = PRESETS[DEFAULT_PRESET]

#: ModelConfig field -> (flags, help). Defaults: the --model preset's (tiny's shown).
MODEL_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "num_layers": (("--num-layers",), "Transformer blocks."),
    "hidden_size": (("--hidden-size",), "Model width."),
    "num_attention_heads": (("--num-attention-heads",), "Query heads."),
    "num_kv_heads": (
        ("--num-kv-heads", "--num-query-groups"),
        "Key/value heads for GQA (Megatron: --num-query-groups); without --model: "
        "--num-attention-heads when that is given.",
    ),
    "ffn_hidden_size": (
        ("--ffn-hidden-size",),
        "SwiGLU width; without --model: the Llama rule int(8*D/3) rounded up to a "
        "multiple of 256 when --hidden-size D is given.",
    ),
    "vocab_size": (("--vocab-size",), "Vocabulary (default: the --tokenizer's; 256 for bytes)."),
    "seq_length": (("--seq-length",), "Tokens per sample."),
    "tie_embeddings": (
        ("--tie-embeddings/--no-tie-embeddings",),
        "Share the input embedding with the output projection.",
    ),
    "rope_theta": (("--rope-theta", "--rotary-base"), "RoPE base (Megatron: --rotary-base)."),
    "norm_eps": (("--norm-eps",), "RMSNorm epsilon."),
    "rope_scaling_factor": (
        ("--rope-scaling-factor", "--rope-scaling"),
        "Llama 3.1 RoPE scaling (rope_type llama3) factor; 0 = plain RoPE (llama3.1-*: 8).",
    ),
    "rope_low_freq_factor": (
        ("--rope-low-freq-factor",),
        "Llama 3.1 RoPE scaling: low frequency factor.",
    ),
    "rope_high_freq_factor": (
        ("--rope-high-freq-factor",),
        "Llama 3.1 RoPE scaling: high frequency factor.",
    ),
    "rope_original_seq_length": (
        ("--rope-original-seq-length",),
        "Llama 3.1 RoPE scaling: the original context it extends.",
    ),
    "num_experts": (
        ("--num-experts",),
        "Mixtral-style MoE FFN with this many experts (0 = dense).",
    ),
    "moe_router_topk": (
        ("--moe-router-topk",),
        "Experts per token (softmax over the top-K router logits).",
    ),
    "moe_ffn_hidden_size": (
        ("--moe-ffn-hidden-size",),
        "Each expert's SwiGLU width (0 = --ffn-hidden-size).",
    ),
    "moe_aux_loss_coeff": (("--moe-aux-loss-coeff",), "Weight of the Switch load-balancing loss."),
    "moe_layer_freq": (("--moe-layer-freq",), "Every N-th layer is MoE (layer i with i % N == 0)."),
}


def _model_option(field: str) -> F:
    decls, help = MODEL_FLAGS[field]
    tiny = getattr(_TINY, field)
    kind = type(tiny)
    shown = (
        (f"--{field.replace('_', '-')}" if tiny else f"--no-{field.replace('_', '-')}")
        if kind is bool
        else tiny
    )
    return click.option(
        *decls,
        field,
        type=None if kind is bool else kind,
        default=None,
        show_default=f"{DEFAULT_PRESET}: {shown}",
        help=help,
    )


model_options = stack(
    click.option(
        "--model",
        "model_preset",
        type=click.Choice(list(PRESETS)),
        default=None,
        help="Start from a published shape; the model flags default to its values and "
        f"override them.  [default: {DEFAULT_PRESET}]",
    ),
    *(_model_option(field) for field in MODEL_FLAGS),
)


def model_from_flags(flags: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of ``--model`` and the model flags the user gave (value not None),
    by :func:`shardsmith.sizing.presets.resolve_model`."""
    from shardsmith.sizing import resolve_model

    given = {f: flags[f] for f in MODEL_FLAGS if flags.get(f) is not None}
    return resolve_model(flags.get("model_preset"), given)


# ---- the local checkpoint tier (train) -------------------------------------------------------------


def _local_option(field: str, *decls: str, **kwargs: Any) -> F:
    return field_option(
        "CheckpointConfig", field, *decls, module="shardsmith.trainer.checkpoint.config", **kwargs
    )


#: The checkpoint fields that :data:`local_tier_options` fill (``train``'s config picks them).
TIER_FIELDS = (
    "local_ckpt",
    "local_save_interval",
    "local_replicas",
    "simulate_nodes",
    "max_failed_saves",
)

local_tier_options = stack(
    _local_option(
        "max_failed_saves",
        "--max-failed-saves",
        type=click.IntRange(min=1),
        help="A failed checkpoint save is logged and retried at the next interval (the local "
        "tier keeps saving); this many failures in a row stop the job, naming the newest "
        "committed step. A failed final save (end of run, preemption) always exits non-zero.",
    ),
    _local_option(
        "local_ckpt",
        "--local-ckpt",
        metavar="DIR",
        help="Node-local checkpoint tier (local disk or /dev/shm): every rank writes its own state "
        "there every --local-save-interval steps, off the training thread; a restart loads "
        "it when it is the newest complete step. Needs --ckpt (the persistent tier).",
    ),
    _local_option(
        "local_save_interval",
        "--local-save-interval",
        type=int,
        help="Write the local tier every N steps (with --local-ckpt).",
    ),
    _local_option(
        "local_replicas",
        "--local-replicas",
        type=click.IntRange(0, 1),
        help="1: also copy each rank's local state to the rank one node over (over the process "
        "group), so losing a whole node loses no local step.",
    ),
    _local_option(
        "simulate_nodes",
        "--simulate-nodes",
        type=int,
        help="Treat the ranks as this many nodes (testing replication, and HSDP replicas "
        "or TP groups sharing the reads of a local checkpoint, on one machine); "
        "0 = torchrun's nodes (LOCAL_WORLD_SIZE ranks each).",
    ),
)


def plural(n: int, noun: str) -> str:
    """``1 process``, ``2 processes``, ``3 files``."""
    suffix = "es" if noun.endswith(("s", "sh", "ch", "x")) else "s"
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}{suffix}"
