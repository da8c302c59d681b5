"""torchtitan 0.3.0 on CPU with gloo: the shim and one rank's run for bench/train_vs_peers.py.

Runs in torchtitan's interpreter (``.venv-titan``, bench/peers/setup.sh), imported by
bench/train_ranks.py ``titan``. torchtitan targets GPUs; on this CPU machine it trains given
(shared/notes/peers-on-cpu.md):

* device type ``cpu`` (it picks ``cuda`` when no accelerator is found), with the CUDA
  memory-statistics calls it makes stubbed out;
* flex attention replaced by causal SDPA (flex attention has no CPU backward; the bench's
  trainers all use causal SDPA over the packed sequence, so no per-document mask is built);
* ``ReduceOp.PREMUL_SUM`` (gloo lacks it) replaced by SUM with the scaling applied after;
  ``barrier(device_ids=...)`` without device ids; ``dist.set_timeout`` (absent in torch 2.13) a
  no-op; ``parallelism.spmd_backend = partial_dtensor``;
* the pipeline schedule's ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, which torchtitan
  0.3.0 calls with microbatches already split (a newer torch's API), routed to torch 2.13's
  ``_step_microbatches``: torch 2.13's ``step`` takes the whole batch and would split the lists
  again ("Expecting 4 arg_mbs but got 2").

The model is the bench's shape registered as the flavor ``bench`` (same layers, hidden size,
heads, kv heads, FFN width, vocab, sequence; fp32); data: the bench's JSONL corpus, through a
byte-level ``tokenizer.json`` (one id per byte, plus BOS/EOS ids 256/257, which torchtitan adds
around each document). Per rank returns ``step_s`` (each ``train_step``'s wall time), ``cpu_s`` (its CPU seconds),
``grads`` (how many of the rank's parameters had a gradient at the last optimizer step) and
``ckpt`` (after the last step: an async DCP save, ``async_mode="async"``, seconds blocked and
until done; then a sync one).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist


def shim() -> None:
    """Make torchtitan run on CPU + gloo; call before importing torchtitan."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    for name, value in (
        ("set_device", lambda *a, **k: None),
        ("current_device", lambda: 0),
        ("device_count", lambda: 1),
        ("empty_cache", lambda: None),
        ("reset_peak_memory_stats", lambda *a, **k: None),
        ("memory_stats", lambda *a, **k: {}),
        ("max_memory_allocated", lambda *a, **k: 0),
        ("max_memory_reserved", lambda *a, **k: 0),
        ("memory_allocated", lambda *a, **k: 0),
        ("memory_reserved", lambda *a, **k: 0),
        ("get_device_name", lambda *a, **k: "cpu"),
        ("get_device_properties", _props),
        ("mem_get_info", lambda *a, **k: (0, 1)),
    ):
        if not hasattr(cpu, name) or name in ("set_device", "current_device", "device_count"):
            setattr(cpu, name, value)
    barrier = dist.barrier

    def barrier_no_ids(*a: Any, **k: Any) -> Any:
        k.pop("device_ids", None)
        return barrier(*a, **k)

    dist.barrier = barrier_no_ids
    if not hasattr(dist, "set_timeout"):  # torchtitan calls it after step 1; torch 2.13 lacks it
        dist.set_timeout = lambda *a, **k: None
    _premul_sum_as_sum()


class _Props:
    name, total_memory, major, minor, multi_processor_count = "cpu", 1 << 40, 0, 0, 1


def _props(*a: Any, **k: Any) -> _Props:
    return _Props()


def _premul_sum_as_sum() -> None:
    """gloo has no PREMUL_SUM (FSDP2 asks for it when torchtitan sets a gradient divide factor):
    force FSDP2's sum-then-divide path, which divides by the same factor after a SUM."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    orig = fc._get_gradient_divide_factors

    def factors(*a: Any, **k: Any) -> Any:
        k["force_sum_reduction_for_comms"] = True
        return orig(*a[:5], **k)

    fc._get_gradient_divide_factors = factors


def sdpa_attention() -> None:
    """FlexAttention -> causal SDPA; no block masks built."""
    import torch.nn.functional as F
    from torchtitan.models.common import attention, decoder

    def forward(
        self: Any,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        score_mod: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kw: Any,
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    attention.FlexAttention.forward = forward
    decoder.Decoder.get_attention_masks = lambda self, positions: None


def byte_tokenizer(folder: str) -> None:
    """A ``tokenizer.json`` with one id per byte (GPT-2 byte-to-unicode alphabet, no merges)
    and BOS/EOS 256/257, plus the ``tokenizer_config.json`` naming them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) <= set(alphabet) | set(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "add_bos_token": True,
                "add_eos_token": True,
            },
            f,
        )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (openai/gpt-2 encoder.py)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def register(spec: dict[str, Any]) -> Any:
    """The bench's model as llama3 flavor ``bench``, the corpus as dataset ``bench``; returns
    the Trainer.Config for the spec."""
    from torchtitan.hf_datasets import DatasetConfig, text_datasets
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    m = spec["model"]

    def flavor(attn_backend: str, tp_gemm_backend: str = "default") -> Any:
        dim = m["hidden"]
        return llama3.Llama3Model.Config(
            dim=dim,
            vocab_size=m["vocab"],
            tok_embeddings=Embedding.Config(
                num_embeddings=m["vocab"], embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=m["vocab"], param_init=llama3._output_linear_init(dim)
            ),
            layers=llama3._build_llama3_layers(
                fuse_qkv=False,
                n_layers=m["layers"],
                dim=dim,
                n_heads=m["heads"],
                n_kv_heads=m["kv_heads"],
                hidden_dim=m["ffn"],
                attn_backend=attn_backend,
                tp_gemm_backend=tp_gemm_backend,
                rope=ComplexRoPE.Config(
                    dim=dim // m["heads"], max_seq_len=m["seq"], theta=10000, scaling="none"
                ),
            ),
        )

    llama3.llama3_configs["bench"] = flavor
    text_datasets.DATASETS["bench"] = DatasetConfig(
        path=spec["data"],
        loader=lambda path: text_datasets.load_dataset("json", data_files=path, split="train"),
        sample_processor=lambda sample: sample["text"],
    )
    return llama3_debugmodel, llama3.model_registry


def split_microbatches(schedule: Any) -> None:
    """Route torchtitan 0.3.0's ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...,
    losses=..., loss_kwargs=..., return_outputs=...)`` (microbatches already split) to torch
    2.13's ``_step_microbatches``, whose ``step`` expects the whole batch, after the per-step set-up
    torch 2.13's ``step`` does (the stage's ``has_backward``, cleared runtime state)."""
    import inspect

    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return  # a torch that has the list API already

    def step(
        *,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        loss_kwargs: Any = None,
        return_outputs: bool = True,
    ) -> Any:
        schedule._stage.has_backward = (
            schedule._has_backward
        )  # what torch 2.13's step() does first:
        schedule._stage.clear_runtime_states()  # without it no stage runs a backward
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )

    schedule.step = step


def build_config(spec: dict[str, Any]) -> Any:
    """torchtitan's Trainer.Config for the bench's spec (CPU, gloo, no compile, no activation
    checkpointing, no validation, no sequence parallelism: as the bench runs ours)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    debugmodel, registry = register(spec)
    pp, dpr, dps, tp = (int(x) for x in spec["layout"].split("."))
    work = spec["ckpt_dir"]
    tokdir = os.path.join(work, f"tokenizer-{os.environ['RANK']}")
    byte_tokenizer(tokdir)
    cfg = debugmodel()
    cfg.model_spec = registry("bench")
    cfg.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec["model"]["vocab"])
    )
    cfg.hf_assets_path = tokdir
    cfg.dump_folder = work
    cfg.training.local_batch_size = spec["batch"] // (dpr * dps)
    cfg.training.global_batch_size = spec["batch"]
    cfg.training.seq_len = spec["model"]["seq"]
    cfg.training.steps = spec["steps"]
    cfg.training.mixed_precision_param = (
        "float32"  # the bench trains fp32 (its default, bf16, is FSDP's param dtype)
    )
    cfg.training.disable_cuda_graphs = True  # none on CPU; torchtitan refuses pp with them on
    cfg.dataloader = HuggingFaceTextDataLoader.Config(dataset="bench")
    par = cfg.parallelism
    par.data_parallel_replicate_degree, par.data_parallel_shard_degree = dpr, dps
    par.tensor_parallel_degree, par.pipeline_parallel_degree = tp, pp
    par.pipeline_parallel_schedule, par.pipeline_parallel_microbatch_size = (
        "1F1B",
        spec["micro_batch"],
    )
    par.enable_sequence_parallel = False
    par.spmd_backend = "partial_dtensor"
    cfg.activation_checkpoint = None
    cfg.validator.enable = False
    cfg.metrics.log_freq = 10**6
    cfg.checkpoint = CheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=10**6,
        async_mode="async",
        last_save_model_only=False,
    )
    return cfg


def run_titan(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: train ``spec["steps"]`` steps, then an async and a sync checkpoint."""
    if os.environ.get("TITAN_DUMP_AFTER"):  # debugging a hang: every thread's stack
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TITAN_DUMP_AFTER"]), exit=True)
    shim()
    sdpa_attention()
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = build_config(spec).build()
    if getattr(trainer, "pp_schedule", None) is not None:
        split_microbatches(trainer.pp_schedule)
    steps: list[float] = []
    cpu: list[float] = []
    train_step = trainer.train_step

    def timed(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = train_step(*a, **k)
        steps.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        return out

    trainer.train_step = timed
    grads = {"with_grad": 0, "params": 0}
    optimizer_step = trainer.optimizers.step

    def counted_step(*a: Any, **k: Any) -> Any:  # the bench's check that this rank trains
        params = [p for m in trainer.model_parts for p in m.parameters()]
        grads.update(with_grad=sum(p.grad is not None for p in params), params=len(params))
        return optimizer_step(*a, **k)

    trainer.optimizers.step = counted_step
    ckpt = trainer.checkpointer
    ckpt._should_save = lambda *a, **k: False
    try:
        trainer.train()
        ckpt._should_save = lambda *a, **k: True
        from torchtitan.components.checkpoint import AsyncMode

        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(trainer.step + 1)
        blocked = time.perf_counter() - t0
        ckpt.maybe_wait_for_saving()
        total = time.perf_counter() - t0
        ckpt.async_mode = AsyncMode.DISABLED
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(trainer.step + 2)
        sync = time.perf_counter() - t0
        return {
            "step_s": steps,
            "cpu_s": cpu,
            "grads": grads,
            "ckpt": {"async_blocked": blocked, "async_s": total, "sync_s": sync},
        }
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
