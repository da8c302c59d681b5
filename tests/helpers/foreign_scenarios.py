"""Writes a torchtitan-style DCP checkpoint from FSDP2 + TP DTensors (run under torchrun).

``python -m torch.distributed.run --standalone --nproc-per-node 4 tests/helpers/foreign_scenarios.py OUT``

4 gloo ranks, dp_shard=2 x tp=2: shardsmith's tiny Llama (torchtitan FQNs) parallelized
with ``parallelize_module`` + ``fully_shard`` as torchtitan does, one AdamW step, then
``dcp.save`` of ``{**model, "optimizer": flat optimizer, "train_state", "lr_scheduler",
"dataloader"}`` (torchtitan's ``_flattened_model_states_sd``) into ``OUT/dcp``. Rank 0
also writes every full tensor, DCP-keyed, to ``OUT/reference.safetensors``.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from spawn_ranks import end_rank
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.trainer.parallel import build_mesh, build_stage_model, init_distributed

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_distributed()
    dims = ParallelDims(dp_shard=2, tp=2)
    model, _ = build_stage_model(MODEL, dims, build_mesh(dims), seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(
        torch.randint(
            0, MODEL.vocab_size, (2, MODEL.seq_length), generator=torch.Generator().manual_seed(0)
        )
    )
    (logits.full_tensor() if isinstance(logits, DTensor) else logits).square().mean().backward()
    opt.step()
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = {
        **model_sd,
        "optimizer": optim_sd,
        "train_state": {"step": 1, "ntokens_seen": 64},
        "lr_scheduler": {"last_epoch": 1},
        "dataloader": {f"dp_rank_{dist.get_rank()}": b"opaque"},
    }
    dcp.save(state, checkpoint_id=f"{out}/dcp")
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model_sd.items()}
    full.update(
        {
            f"optimizer.{k}": v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in optim_sd.items()
            if isinstance(v, torch.Tensor)
        }
    )
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/reference.safetensors")
    dist.barrier()
    end_rank()  # process groups down and cycles collected before the interpreter's teardown


if __name__ == "__main__":
    main(sys.argv[1])
