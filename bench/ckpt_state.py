"""State shared by the checkpoint benches and their peers: the layout names they pass around and
the trainer's model every system saves (bench/checkpoint_vs_dcp.py, bench/peers/)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardsmith.layout import ModelConfig, ParallelDims, stage_layers
from shardsmith.layout.sharding import kv_replicas, padded_vocab_size
from shardsmith.trainer.model import Transformer
from shardsmith.trainer.parallel import build_mesh, parallelize


def parse_layout(name: str) -> ParallelDims:
    """``pp.dp_replicate.dp_shard.tp`` -> ParallelDims."""
    pp, dpr, dps, tp = (int(x) for x in name.split("."))
    return ParallelDims(pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp)


def build_model(cfg: ModelConfig, dims: ParallelDims) -> tuple[Any, torch.nn.Module]:
    """(mesh, this rank's pipeline stage of the trainer's model, parallelized under ``dims``,
    uninitialized CPU memory). Collective (builds a mesh)."""
    mesh = build_mesh(dims, device="cpu")  # CPU shards, gloo, also on a GPU machine
    stage = dims.coords(dist.get_rank())["pp"]
    layers = stage_layers(cfg, dims)[stage]
    with torch.device("meta"):
        model = Transformer(
            cfg,
            layers,
            first=stage == 0,
            last=stage == dims.pp - 1,
            padded_vocab=padded_vocab_size(cfg.vocab_size, dims.tp),
            kv_copies=kv_replicas(cfg, dims),
        )
    parallelize(model, mesh, dims, bf16=False, activation_checkpointing=False)
    model.to_empty(device="cpu")
    return mesh, model
