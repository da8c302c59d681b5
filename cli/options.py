"""Shared click options: flags map onto config dataclasses and hold no logic."""

from __future__ import annotations

from typing import Any, Callable

import click

F = Callable[..., Any]


def _stack(*decorators: F) -> F:
    def wrap(fn: F) -> F:
        for d in reversed(decorators):
            fn = d(fn)
        return fn
    return wrap


storage_option = click.option(
    "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option (repeatable), e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000")

layout_options = _stack(
    click.option("--tp", "--tensor-model-parallel-size", "tp", type=int, default=1, show_default=True,
                 help="Tensor-parallel degree (Megatron: --tensor-model-parallel-size)."),
    click.option("--pp", "--pipeline-model-parallel-size", "pp", type=int, default=1, show_default=True,
                 help="Pipeline stages (Megatron: --pipeline-model-parallel-size)."),
    click.option("--dp-shard", type=int, default=-1,
                 help="FSDP2 sharding degree; -1 = the rest of the world size.  [default: -1]"),
    click.option("--dp-replicate", type=int, default=1, show_default=True,
                 help="Data-parallel replicas (HSDP replication)."),
    click.option("--pipeline-split", default="", metavar="N,N,...",
                 help="Layers per pipeline stage, e.g. 5,3 (default: as even as possible)."),
)

model_options = _stack(
    click.option("--num-layers", type=int, default=4, show_default=True, help="Transformer blocks."),
    click.option("--hidden-size", type=int, default=128, show_default=True, help="Model width."),
    click.option("--num-attention-heads", type=int, default=4, show_default=True, help="Query heads."),
    click.option("--num-kv-heads", "--num-query-groups", "num_kv_heads", type=int, default=2,
                 show_default=True, help="Key/value heads for GQA (Megatron: --num-query-groups)."),
    click.option("--ffn-hidden-size", type=int, default=352, show_default=True, help="SwiGLU width."),
    click.option("--vocab-size", type=int, default=None,
                 help="Vocabulary (default: the tokenizer's; 256 for bytes)."),
    click.option("--seq-length", type=int, default=128, show_default=True, help="Tokens per sample."),
    click.option("--tie-embeddings/--no-tie-embeddings", default=False, show_default=True,
                 help="Share the input embedding with the output projection."),
    click.option("--rope-theta", "--rotary-base", "rope_theta", type=float, default=10000.0, show_default=True,
                 help="RoPE base (Megatron: --rotary-base)."),
    click.option("--norm-eps", type=float, default=1e-5, show_default=True, help="RMSNorm epsilon."),
)
