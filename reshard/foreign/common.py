"""What the foreign-format importers share: the model config from tensor shapes, and reports."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig, ParallelDims, param_specs

if TYPE_CHECKING:
    from shardsmith.reshard.foreign.write import WriteReport

_LAYER = re.compile(r"^layers\.(\d+)\.")


#: DCP item where ``export-dcp`` records the model config (a JSON string); other readers ignore it.
MODEL_RECORD_KEY = "shardsmith.model"
_HINT_DEFAULTS = {"seq_length": 2048, "rope_theta": 10000.0, "norm_eps": 1e-5}


@dataclass(kw_only=True)
class ModelHints:
    """Model fields no tensor shape tells (DCP and ``torch_dist`` store no model config).

    ``None`` means: take it from the model config the source records (a DCP directory written
    by ``export-dcp`` has one, :data:`MODEL_RECORD_KEY`), else the default
    (seq_length 2048, rope_theta 10000, norm_eps 1e-5); see :meth:`completed`.

    Attributes:
        num_attention_heads: query heads (needed to tell head_dim, hence the kv heads).
        seq_length, rope_theta, norm_eps: recorded in the config; not checked against anything.
    """

    num_attention_heads: int | None = None
    seq_length: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None

    def completed(self, recorded: dict | None, source: str) -> "ModelHints":
        """Every field set: given here, else from ``recorded`` (a ``ModelConfig.to_json()``), else
        the default.

        Raises:
            ConfigError: the query head count is neither given nor recorded.
        """
        rec = recorded or {}
        heads = self.num_attention_heads or rec.get("num_attention_heads")
        if not heads:
            raise ConfigError(
                f"{source}: the checkpoint does not record the model's query head count; "
                "pass --num-attention-heads"
            )
        values = {
            k: getattr(self, k) if getattr(self, k) is not None else rec.get(k, default)
            for k, default in _HINT_DEFAULTS.items()
        }
        return ModelHints(num_attention_heads=int(heads), **values)


@dataclass
class ImportReport:
    """What an importer (HF, DCP, Megatron ``torch_dist``) wrote, and what of the source it did
    not carry over.

    Attributes:
        source: the directory imported from; target: the committed step directory's URL.
        with_optimizer: AdamW state was imported too.
        num_files, nbytes_written: shard files and bytes committed; seconds: wall time of the import.
        dropped: what of the source was not carried over, one readable line each.
    """

    source: str
    target: str
    step: int
    model: ModelConfig
    with_optimizer: bool
    num_files: int = 0
    nbytes_written: int = 0
    seconds: float = 0.0
    dropped: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        written: WriteReport,
        *,
        source: str,
        model: ModelConfig,
        with_optimizer: bool,
        started: float,
        dropped: list[str] | None = None,
    ) -> "ImportReport":
        """The report of an import that committed ``written`` and began at ``started``
        (a :func:`time.perf_counter` reading)."""
        return cls(
            source=source,
            target=written.target,
            step=written.step,
            model=model,
            with_optimizer=with_optimizer,
            num_files=written.num_files,
            nbytes_written=written.nbytes_written,
            seconds=time.perf_counter() - started,
            dropped=dropped or [],
        )


def infer_model_config(
    shapes: dict[str, tuple[int, ...]], hints: ModelHints, source: str
) -> ModelConfig:
    """Our :class:`ModelConfig` of a Llama whose parameters (our FQNs) have ``shapes``.

    Raises:
        ConfigError: a tensor is missing, unknown or misshapen for the inferred model
            (names the tensor), or the heads do not divide the widths.
    """
    for name in (
        "tok_embeddings.weight",
        "layers.0.attention.wk.weight",
        "layers.0.feed_forward.w1.weight",
    ):
        if name not in shapes:
            raise ConfigError(
                f"{source}: no tensor {name}; not a Llama checkpoint shardsmith can import"
            )
    vocab, hidden = shapes["tok_embeddings.weight"]
    heads = hints.num_attention_heads
    assert heads is not None and hints.seq_length is not None, "call ModelHints.completed first"
    if hidden % heads:
        raise ConfigError(
            f"{source}: hidden size {hidden} is not divisible by "
            f"--num-attention-heads {heads}; pass the model's query head count"
        )
    layers = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m}
    model = ModelConfig(
        num_layers=len(layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=shapes["layers.0.attention.wk.weight"][0] // (hidden // heads),
        ffn_hidden_size=shapes["layers.0.feed_forward.w1.weight"][0],
        vocab_size=vocab,
        seq_length=hints.seq_length,
        tie_embeddings="output.weight" not in shapes,
        rope_theta=float(hints.rope_theta or 0),
        norm_eps=float(hints.norm_eps or 0),
    )
    specs = param_specs(model, ParallelDims())
    for fqn, spec in specs.items():
        if fqn not in shapes or tuple(shapes[fqn]) != spec.shape:
            found = "missing" if fqn not in shapes else f"of shape {tuple(shapes[fqn])}"
            raise ConfigError(
                f"{source}: tensor {fqn} is {found}, but the model the other shapes "
                f"imply ({model}) needs {spec.shape}"
            )
    extra = sorted(set(shapes) - set(specs))
    if extra:
        raise ConfigError(
            f"{source}: tensors {extra[:5]} have no place in shardsmith's Llama "
            "(biases and extra modules are not supported); nothing was imported"
        )
    return model
