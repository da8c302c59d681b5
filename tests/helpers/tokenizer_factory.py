"""Small real tokenizers for tests, trained here (nothing is downloaded)."""

from __future__ import annotations

import base64
from pathlib import Path

from shardsmith.trainer.data.tokenizer import CL100K_PATTERN


def sample_text() -> str:
    """~60 KB of real text: a few standard-library modules' source."""
    import argparse
    import json
    import textwrap

    return "\n\n".join(Path(m.__file__).read_text() for m in (json, argparse, textwrap))


def train_hf_bpe(path: Path, text: str, vocab_size: int = 400) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained with ``tokenizers.trainers.BpeTrainer``;
    ``<|endoftext|>`` is id 0. Deterministic for a given text and vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    tok.save(str(path))
    return path


def train_tiktoken(path: Path, text: str, vocab_size: int = 300) -> Path:
    """A ``.tiktoken`` BPE file (``base64(token) rank`` per line) trained with tiktoken's
    educational ``bpe_train`` under the cl100k pattern."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(text, vocab_size, CL100K_PATTERN, visualise=None)
    lines = [
        base64.b64encode(tok) + b" %d\n" % rank
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    path.write_bytes(b"".join(lines))
    return path
