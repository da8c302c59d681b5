"""Token data: where the corpus comes from, how text becomes tokens, which samples each DP
rank sees at each step.

Read in this order:

- :mod:`.config` — :class:`DataConfig` (sources, blend weights, tokenizer and its identity).
- :mod:`.tokenizer` — bytes, Hugging Face ``tokenizers`` and tiktoken tokenizers.
- :mod:`.identity` — :func:`tokenizer_identity`, :func:`check_same_tokenizer` (on resume),
  :func:`resolve_vocab_size` (the model's vocab from the tokenizer).
- :mod:`.sources` — what a ``--data`` value names (text, JSONL, Parquet, HF datasets, nanoGPT
  ``.bin``, Megatron indexed datasets), with :mod:`.hf` and :mod:`.indexed`.
- :mod:`.cache` — the on-disk cache of tokenized text.
- :mod:`.loading` — :func:`load_tokens` and :func:`build_dataset`.
- :mod:`.dataset` — :class:`TokenDataset` (seeded windows) and :class:`GlobalBatchSampler`.
- :mod:`.blend` — :class:`BlendedDataset` (weighted blends, Megatron's blending rule).

The sample order is a pure function of ``(seed, global sample index)``, independent of the DP
degree; the only loader state in a checkpoint is ``{"sample_index": int}``.
"""

import importlib
from typing import Any

from shardsmith.trainer.data.config import (
    BYTE_VOCAB_SIZE,
    TOKEN_DTYPES,
    DataConfig,
    parse_data_args,
)
from shardsmith.trainer.data.identity import (
    check_same_tokenizer,
    resolve_vocab_size,
    tokenizer_identity,
)

#: Names whose modules import torch, imported on first use (PEP 562), so that the config
#: (and ``shardsmith train``'s checks before any worker starts) never imports torch.
_LAZY = {
    "BlendedDataset": "blend",
    "blending_table": "blend",
    "GlobalBatchSampler": "dataset",
    "TokenDataset": "dataset",
    "vocab_size_needed": "dataset",
    "build_dataset": "loading",
    "load_tokens": "loading",
    "tokenize_documents": "loading",
    "stdlib_corpus": "sources",
    "stdlib_documents": "sources",
    "expand_source": "sources",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BYTE_VOCAB_SIZE",
    "TOKEN_DTYPES",
    "BlendedDataset",
    "DataConfig",
    "GlobalBatchSampler",
    "expand_source",
    "TokenDataset",
    "blending_table",
    "build_dataset",
    "check_same_tokenizer",
    "load_tokens",
    "parse_data_args",
    "resolve_vocab_size",
    "stdlib_corpus",
    "stdlib_documents",
    "tokenize_documents",
    "tokenizer_identity",
    "vocab_size_needed",
]
