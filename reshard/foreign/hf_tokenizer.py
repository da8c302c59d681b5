"""The tokenizer files that travel with a Hugging Face export (and are found on import).

A checkpoint's manifest records the run's tokenizer in its config (``data.tokenizer``: the
path it was read from; ``tokenizer_kind``, ``tokenizer_sha256``: its identity; see
``shardsmith.trainer.data.config.DataConfig``). :func:`copy_tokenizer` copies that file into
the export directory when it is still on this machine and unchanged (same SHA-256), with the
``tokenizer_config.json`` / ``special_tokens_map.json`` beside it; without a
``tokenizer_config.json`` it writes one naming ``PreTrainedTokenizerFast`` (no BOS/EOS added:
shardsmith trained without them), so ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
A tiktoken BPE file is copied under its own name (``transformers`` has no loader for it).
Anything not copied is said, never guessed. Pure JSON + bytes: no tokenizer library needed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardsmith.storage.store import Store

TOKENIZER_JSON = "tokenizer.json"
SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass
class TokenizerCopy:
    """What :func:`copy_tokenizer` did: files written into the export, and why not, if not."""

    files: list[str] = field(default_factory=list)
    note: str = ""


def recorded_tokenizer(config: Mapping[str, Any]) -> tuple[str, str, str]:
    """(path, kind, sha256) of the tokenizer a manifest's root config names; ``("", "bytes", "")``
    when the run used bytes (no ``--tokenizer``)."""
    data = config.get("data") if isinstance(config.get("data"), Mapping) else {}
    assert isinstance(data, Mapping)
    path = str(data.get("tokenizer") or "")
    return (
        path,
        str(data.get("tokenizer_kind") or ("" if path else "bytes")),
        str(data.get("tokenizer_sha256") or ""),
    )


def hf_tokenizer_file(path: str) -> str:
    """``path`` itself, or ``path/tokenizer.json`` when ``path`` is a directory."""
    return os.path.join(path, TOKENIZER_JSON) if os.path.isdir(path) else path


def copy_tokenizer(config: Mapping[str, Any], out: Store) -> TokenizerCopy:
    """Copy the recorded tokenizer into ``out`` (see the module docstring).

    Returns:
        The files written (names in ``out``), or an empty list and a note saying why not
        (bytes tokenizer, file gone, file changed since training).
    """
    path, kind, sha256 = recorded_tokenizer(config)
    if not path:
        return TokenizerCopy(
            note="the run used the byte tokenizer (no --tokenizer): no tokenizer files"
        )
    file = hf_tokenizer_file(path) if kind == "hf" else path
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        return TokenizerCopy(
            note=f"tokenizer {file} recorded in the checkpoint is not readable here "
            f"({exc.strerror}); copy it into the export yourself"
        )
    if sha256 and hashlib.sha256(raw).hexdigest() != sha256:
        return TokenizerCopy(
            note=f"tokenizer {file} changed since training (sha256 is not the recorded "
            f"{sha256[:16]}…); not copied"
        )
    if kind != "hf":
        name = os.path.basename(file)
        out.write(name, raw)
        return TokenizerCopy(
            files=[name],
            note=f"{kind} BPE file copied as {name}; transformers does not load it as a tokenizer",
        )
    copy = TokenizerCopy(files=[TOKENIZER_JSON])
    out.write(TOKENIZER_JSON, raw)
    for name in SIBLINGS:
        sibling = os.path.join(os.path.dirname(file), name)
        if os.path.isfile(sibling):
            with open(sibling, "rb") as f:
                out.write(name, f.read())
            copy.files.append(name)
    if SIBLINGS[0] not in copy.files:
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
        }
        out.write(SIBLINGS[0], json.dumps(tokenizer_config, indent=2).encode())
        copy.files.append(SIBLINGS[0])
    return copy


def find_hf_tokenizer(hf_dir: str) -> str:
    """``hf_dir/tokenizer.json`` when the Hugging Face directory has one, else ``""``."""
    file = os.path.join(hf_dir, TOKENIZER_JSON)
    return file if os.path.isfile(file) else ""
