"""Megatron-Core side of the torch_dist interop tests (run with megatron-core's Python).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/megatron_scenarios.py MODE DIR OUT``

A tiny GPT (4 layers, D=32, 4 heads, 2 query groups, SwiGLU F=64, RMSNorm, RoPE, no
biases, vocab 256, untied unless ``MEGATRON_TIED=1``), local layer spec, tensor-parallel over the N ranks, on CPU
(see shared/notes/megatron-core-on-cpu.md for the two CUDA calls replaced).

* ``save``: seeded init, ``dist_checkpointing.save`` into DIR.
* ``load``: fresh model (other seed), ``dist_checkpointing.load`` from DIR.

Both then write ``OUT-rank<r>.safetensors``: the rank's ``state_dict()`` tensors (TP-local)
and the gathered logits (B, T, V) of fixed tokens (key ``logits``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

torch.cuda.current_device = lambda: "cpu"                       # type: ignore[assignment]
torch.cuda.synchronize = lambda *a, **k: None                   # type: ignore[assignment]

TOKENS = torch.arange(32).reshape(2, 16) * 7 % 256


def build(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            use_cpu_initialization=True, params_dtype=torch.float32,
                            bias_dropout_fusion=False, apply_rope_fusion=False, layernorm_epsilon=1e-5,
                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=256, max_sequence_length=16, position_embedding_type="rope",
                    rotary_base=10000, share_embeddings_and_output_weights=os.environ.get("MEGATRON_TIED") == "1",
                    parallel_output=False)


def main(mode: str, ckpt_dir: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from safetensors.torch import save_file

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model = build(1 if mode == "save" else 2)
    if mode == "save":
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        print(f"common state: {({k: v for k, v in loaded.items() if k in ('iteration', 'checkpoint_version')})}")
        model.load_state_dict({k: v for k, v in loaded.items() if k not in ("iteration", "checkpoint_version")})
    model.eval()
    from megatron.core import tensor_parallel        # dropout's CUDA RNG fork: a no-op on CPU (p = 0)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, 16, 16), diagonal=1).bool()     # True = masked (causal)
        logits = model(TOKENS, torch.arange(16).expand(2, 16), mask)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
               and "_extra_state" not in k}
    save_file({**tensors, "logits": logits.float().contiguous()}, f"{out}-rank{dist.get_rank()}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
