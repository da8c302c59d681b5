"""Which tokenizer a run uses, and refusing to resume with another one.

A checkpoint's manifest holds the root training config, whose ``data`` part records the
tokenizer's kind, SHA-256 and vocabulary (:class:`~shardsmith.trainer.data.config.DataConfig`).
Resuming with a different tokenizer would silently re-map every token id, so the trainer calls
:func:`check_same_tokenizer` on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardsmith.errors import ConfigError
from shardsmith.trainer.data.config import BYTE_VOCAB_SIZE, BYTES_KIND, DataConfig


def tokenizer_identity(config: Any) -> dict[str, Any]:
    """The tokenizer identity recorded in a config.

    Args:
        config: a :class:`DataConfig`, an object with a ``.data`` DataConfig (``TrainConfig``),
            or a saved config as JSON: the root (with a ``"data"`` key, as in a manifest's
            config) or its data part. A saved config from before tokenizers were recorded
            (no ``tokenizer_*`` keys) names the byte tokenizer.

    Returns:
        ``{"kind": str, "sha256": str, "vocab_size": int, "path": str}``; ``kind`` is
        ``"bytes"`` (sha256 ``""``, vocab 256), ``"hf"``, ``"tiktoken:cl100k"`` or
        ``"tiktoken:o200k"``; ``path`` is where the file was, for messages only.

    Raises:
        ConfigError: ``config`` is none of the above.
    """
    if isinstance(config, DataConfig):
        data: Mapping[str, Any] = vars(config)
    elif isinstance(getattr(config, "data", None), DataConfig):
        data = vars(config.data)
    elif isinstance(config, Mapping):
        data = config.get("data", config)
        if not isinstance(data, Mapping):
            raise ConfigError(f"saved config has data={data!r}: expected a JSON object")
    else:
        raise ConfigError(f"tokenizer_identity: cannot read a data config from {type(config)}")
    path = str(data.get("tokenizer") or "")
    if not path:
        return {"kind": BYTES_KIND, "sha256": "", "vocab_size": BYTE_VOCAB_SIZE, "path": ""}
    return {
        "kind": str(data.get("tokenizer_kind") or ""),
        "sha256": str(data.get("tokenizer_sha256") or ""),
        "vocab_size": int(data.get("tokenizer_vocab_size") or 0),
        "path": path,
    }


def _describe(ident: Mapping[str, Any]) -> str:
    if ident["kind"] == BYTES_KIND:
        return "bytes (no --tokenizer)"
    return (
        f"{ident['path']} ({ident['kind']}, sha256 {ident['sha256'][:16]}…, "
        f"vocab {ident['vocab_size']})"
    )


def check_same_tokenizer(saved_config_json: Mapping[str, Any], job_config: Any) -> None:
    """Refuses to resume a checkpoint with a different tokenizer.

    Tokenizers are the same when kind, SHA-256 and vocabulary agree; the path may differ.
    Pure: reads no file. Every rank may call it (all decide alike); the trainer calls it
    on resume, before loading tensors.

    Args:
        saved_config_json: the checkpoint's training config as JSON (the manifest's config).
        job_config: this job's ``TrainConfig`` or ``DataConfig`` (or its JSON).

    Raises:
        ConfigError: the tokenizers differ; names both and says to pass the saved one with
            ``--tokenizer`` or start a new run with ``--init-from``.
    """
    saved, job = tokenizer_identity(saved_config_json), tokenizer_identity(job_config)
    keys = ("kind", "sha256", "vocab_size")
    if all(saved[k] == job[k] for k in keys):
        return
    raise ConfigError(
        f"checkpoint was trained with tokenizer {_describe(saved)}, this job uses "
        f"{_describe(job)}; pass the same --tokenizer"
        f"{' ' + saved['path'] if saved['path'] else ' (none: bytes)'} or start a new run "
        "with --init-from"
    )


def resolve_vocab_size(data: DataConfig, requested: int | None) -> int:
    """The model's vocabulary: the tokenizer's, or ``requested`` when it is large enough.

    Args:
        data: the data config (its tokenizer identity is filled in).
        requested: ``--vocab-size``, or None when not given.

    Returns:
        ``requested`` if given, else the tokenizer's vocab size (256 for bytes).

    Raises:
        ConfigError: ``requested`` is smaller than the tokenizer's vocabulary.
    """
    needed = data.tokenizer_vocab_size
    if requested is None:
        return needed
    if data.tokenizer and requested < needed:
        raise ConfigError(
            f"--vocab-size {requested} is smaller than tokenizer {data.tokenizer!r}'s vocabulary "
            f"({needed}); drop --vocab-size (it then comes from the tokenizer) or pass >= {needed}"
        )
    return requested
