"""Megatron-Core side of the torch_dist interop tests (run with megatron-core's Python).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/megatron_scenarios.py MODE DIR OUT``

A tiny GPT (4 layers, D=32, 4 heads, 2 query groups, SwiGLU F=64, RMSNorm, RoPE, no
biases, vocab 256, untied unless ``MEGATRON_TIED=1``), local layer spec, tensor-parallel over the N ranks, on CPU
(see shared/notes/megatron-core-on-cpu.md for the two CUDA calls replaced).

* ``save``: seeded init, ``dist_checkpointing.save`` into DIR.
* ``load``: fresh model (other seed), ``dist_checkpointing.load`` from DIR.

Both then write ``OUT-rank<r>.safetensors``: the rank's ``state_dict()`` tensors (TP-local)
and the gathered logits (B, T, V) of fixed tokens (key ``logits``).

With ``MEGATRON_OPTIM=<sharding type>`` (``fully_reshardable`` / ``dp_reshardable``) the ranks
are data-parallel instead (tp 1) and train with Megatron's ``DistributedOptimizer`` (Adam,
DDP grad buffers): ``save`` takes two steps and saves model and optimizer state; ``load``
loads both into a fresh model and optimizer. The output then also holds, per parameter this
rank's optimizer shard covers, ``<kind>.<param name>`` (kind ``param`` / ``exp_avg`` /
``exp_avg_sq``: the flat shard), ``range.<param name>`` (its [start, end) in the flattened
parameter) and ``step``. The distributed optimizer hard-codes CUDA in a few more places;
:func:`_cpu_only` maps them to the CPU in this process only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
from spawn_ranks import end_rank

torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

TOKENS = torch.arange(32).reshape(2, 16) * 7 % 256
MASK = torch.triu(torch.ones(1, 1, 16, 16), diagonal=1).bool()  # True = masked (causal)
OPTIM = os.environ.get("MEGATRON_OPTIM", "")
LR, MIN_LR = 3e-3, 3e-3 * 0.1  # shardsmith's defaults: Megatron pairs param groups by them


def _cpu_only() -> None:
    """Factory calls with ``device="cuda"``, ``Tensor.cuda()`` and ``Tensor.type()`` checks of
    the distributed optimizer and DDP buffers, mapped to the CPU."""
    import functools

    def cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)

        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, cpu(getattr(torch, name)))
    # megatron-core 0.19.2 on torch's Adam (no Apex / TE): loading a fully_reshardable state
    # asks every state key of the shard, "step" included, which the load never provides
    # (KeyError 'step', also for Megatron's own checkpoints); the step comes from the param
    # groups instead. A None makes the copy skip it.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    DistributedOptimizer._set_main_param_and_optimizer_states = (  # type: ignore[method-assign]
        lambda self, param, tensors: set_states(self, param, {"step": None, **tensors})
    )
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    as_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (
        as_type(self).replace("torch.", "torch.cuda.", 1)  # type: ignore
        if not a and not k
        else as_type(self, *a, **k)
    )


def build(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.5,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=256,
        max_sequence_length=16,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=os.environ.get("MEGATRON_TIED") == "1",
        parallel_output=False,
    )


def _with_optimizer(model, mode: str, ckpt_dir: str) -> dict[str, torch.Tensor]:
    """DDP + DistributedOptimizer: two steps then save, or load; this rank's optimizer shards."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=MIN_LR,
            use_distributed_optimizer=True,
            params_dtype=torch.float32,
        ),
        [ddp],
    )
    metadata = {"distrib_optim_sharding_type": OPTIM}
    for _ in range(2 if mode == "save" else 0):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(TOKENS, torch.arange(16).expand(2, 16), MASK).float().square().mean().backward()
        opt.step()  # same tokens on every DP rank: the local grads are already the mean
    sharded = {"model": model.sharded_state_dict()}
    if mode == "save":
        sharded["optimizer"] = opt.sharded_state_dict(sharded["model"], metadata=metadata)
        dist_checkpointing.save(sharded, ckpt_dir, content_metadata=metadata)
    else:  # torch's Adam (no Apex / TE) needs allocated state to describe it for loading
        opt.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
        sharded["optimizer"] = opt.sharded_state_dict(
            sharded["model"], is_loading=True, metadata=metadata
        )
        loaded = dist_checkpointing.load(sharded, ckpt_dir)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    inner = opt.chained_optimizers[0]
    out = {}
    for name, param in model.named_parameters():
        for buffer in inner.gbuf_ranges:
            for by_dtype in buffer.values():
                for bucket in by_dtype:
                    if param in bucket["param_map"]:
                        r = bucket["param_map"][param]["param"]
                        out[f"range.{name}"] = torch.tensor([r.start, r.end])
                        for kind, t in inner._get_main_param_and_optimizer_states(param).items():
                            out["step" if kind == "step" else f"{kind}.{name}"] = (
                                t.detach().clone().reshape(-1 if kind != "step" else ())
                            )
    return out


def main(mode: str, ckpt_dir: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from safetensors.torch import save_file

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1 if OPTIM else dist.get_world_size()
    )
    model = build(1 if mode == "save" else 2)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: (
        contextlib.nullcontext()
    )  # dropout p = 0
    os.makedirs(ckpt_dir, exist_ok=True)
    optim: dict[str, torch.Tensor] = {}
    if OPTIM:
        _cpu_only()
        optim = _with_optimizer(model, mode, ckpt_dir)
    elif mode == "save":
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        print(
            f"common state: { ({k: v for k, v in loaded.items() if k in ('iteration', 'checkpoint_version')}) }"
        )
        model.load_state_dict(
            {k: v for k, v in loaded.items() if k not in ("iteration", "checkpoint_version")}
        )
    model.eval()
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(16).expand(2, 16), MASK)
    tensors = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }
    save_file(
        {**tensors, **optim, "logits": logits.float().contiguous()},
        f"{out}-rank{dist.get_rank()}.safetensors",
    )
    dist.barrier()
    end_rank()  # process groups down and cycles collected before the interpreter's teardown


if __name__ == "__main__":
    main(*sys.argv[1:4])
