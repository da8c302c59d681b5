"""The ranks of bench/train_vs_peers.py: one training run of one system, per-rank figures to JSON.

    python bench/train_ranks.py SYSTEM SPEC OUTDIR        (SYSTEM: ours | plain | titan)

Spawns ``spec["nproc"]`` processes with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``); each runs the system's entry point and writes
``OUTDIR/rank<r>.json``: ``step_s`` (wall seconds of every optimizer step, in order),
``hwm_mib`` (peak RSS of the rank's process, ``VmHWM``), and for the trainers ``ckpt``
(``async_blocked`` = seconds the caller was blocked by an async save, ``async_s`` = until it
was committed, ``sync_s`` = a synchronous save, all after the last step, on the trained state).

* ``ours``: shardsmith's ``Trainer`` (this interpreter; shardsmith installed).
* ``plain``: the physical limit: the same ``Transformer`` module, torch's own TP plan
  (``ColwiseParallel``/``RowwiseParallel``, vocab-parallel embedding and output with
  ``loss_parallel``) and ``fully_shard`` per block, AdamW, gradient clipping, the same token
  windows; no checkpointing, no metrics, no pipeline (``pp`` must be 1).
* ``titan``: torchtitan, in its own interpreter (bench/peers/titan_ranks.py).

The spec (JSON): ``model`` (layers, hidden, heads, kv_heads, ffn, vocab, seq), ``layout``
(``pp.dp_replicate.dp_shard.tp``), ``batch`` (global sequences per step), ``micro_batch``,
``steps``, ``data`` (a JSONL corpus, field ``text``), ``ckpt_dir``, ``nproc``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist


def hwm_mib() -> float:
    """Peak resident set of this process so far (``VmHWM``), MiB."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def corpus_tokens(path: str) -> np.ndarray:
    """The corpus as byte tokens: the ``text`` of every JSONL row, joined by ``"\\n\\n"`` (as
    shardsmith's byte tokenizer joins documents)."""
    with open(path) as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    return np.frombuffer("\n\n".join(docs).encode(), dtype=np.uint8)


# ---- ours --------------------------------------------------------------------------------------


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from shardsmith.layout import ModelConfig
    from shardsmith.trainer.config import CheckpointConfig, DataConfig, OptimConfig, TrainConfig
    from shardsmith.trainer.train import Trainer

    m = spec["model"]
    pp, dpr, dps, tp = (int(x) for x in spec["layout"].split("."))
    from shardsmith.layout import ParallelDims

    cfg = TrainConfig(
        model=ModelConfig(
            num_layers=m["layers"],
            hidden_size=m["hidden"],
            num_attention_heads=m["heads"],
            num_kv_heads=m["kv_heads"],
            ffn_hidden_size=m["ffn"],
            vocab_size=m["vocab"],
            seq_length=m["seq"],
        ),
        parallel=ParallelDims(pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp),
        data=DataConfig(sources=(spec["data"],), text_key="text"),
        optim=OptimConfig(lr=3e-4, warmup_steps=2),
        checkpoint=CheckpointConfig(
            url=spec["ckpt_dir"], save_interval=0, resume="none", save_final=False, async_save=True
        ),
        steps=spec["steps"],
        global_batch_size=spec["batch"],
        micro_batch_size=spec["micro_batch"],
        log_interval=0,
        run_dir=os.path.join(spec["ckpt_dir"], f"run-{os.environ['RANK']}"),
    )
    trainer = Trainer.create(cfg)
    cpu: list[float] = []
    train_step = trainer.train_step

    def timed() -> Any:
        c0 = time.process_time()
        out = train_step()
        cpu.append(time.process_time() - c0)
        return out

    trainer.train_step = timed
    try:
        history = trainer.run()
        policy = trainer.checkpointing
        ckpt = time_saves(
            trainer.save,
            trainer.wait_for_save,
            lambda on: setattr(policy, "checkpointer", on),
            policy.checkpointer,
        )
        return {"step_s": [h.duration_s for h in history], "cpu_s": cpu, "ckpt": ckpt}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def time_saves(
    save: Callable[[], None],
    wait: Callable[[], None],
    set_async: Callable[[Any], None],
    async_obj: Any,
) -> dict[str, float]:
    """An async save (seconds blocked, seconds until committed), then a sync one (``set_async(None)``
    switches the trainer to its synchronous path), each from a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    save()
    blocked = time.perf_counter() - t0
    wait()
    total = time.perf_counter() - t0
    set_async(None)
    dist.barrier()
    t0 = time.perf_counter()
    save()
    sync = time.perf_counter() - t0
    set_async(async_obj)
    return {"async_blocked": blocked, "async_s": total, "sync_s": sync}


# ---- plain PyTorch -----------------------------------------------------------------------------


def run_plain(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from shardsmith.layout import ModelConfig
    from shardsmith.trainer.model import Transformer

    m = spec["model"]
    pp, dpr, dps, tp = (int(x) for x in spec["layout"].split("."))
    assert pp == 1 and dpr == 1, "the plain loop has no pipeline and no replication"
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dps, tp), mesh_dim_names=("dp", "tp"))
    cfg = ModelConfig(
        num_layers=m["layers"],
        hidden_size=m["hidden"],
        num_attention_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        ffn_hidden_size=m["ffn"],
        vocab_size=m["vocab"],
        seq_length=m["seq"],
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in model.layers:
        for name in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "feed_forward.w1",
            "feed_forward.w3",
        ):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.reset_buffers()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    tokens = torch.from_numpy(corpus_tokens(spec["data"]).astype(np.int64))
    gen = torch.Generator().manual_seed(1234 + mesh["dp"].get_local_rank())
    local_batch, seq = spec["batch"] // dps, m["seq"]
    steps = []
    cpu: list[float] = []
    for _ in range(spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        starts = torch.randint(0, len(tokens) - seq - 1, (local_batch,), generator=gen)
        window = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
        for micro in window.split(spec["micro_batch"]):
            with loss_parallel():
                logits = model(micro[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), micro[:, 1:].flatten()
                )
                (loss * micro.shape[0] / local_batch).backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    dist.destroy_process_group()
    return {"step_s": steps, "cpu_s": cpu}


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` over DTensor gradients on different meshes (TP'd weights on
    (dp, tp), norms on dp): one norm per mesh, combined (as torchtitan's ``clip_grad_norm_``)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(g) for g in groups.values()]
    total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)


# ---- spawning ------------------------------------------------------------------------------------


def _rank(rank: int, system: str, spec: dict[str, Any], outdir: str, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec["nproc"]),
        LOCAL_WORLD_SIZE=str(spec["nproc"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if system == "titan":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
        from titan_ranks import run_titan as fn
    else:
        fn = {"ours": run_ours, "plain": run_plain}[system]
    out = fn(spec)
    out["hwm_mib"] = hwm_mib()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def main(argv: list[str]) -> int:
    from lockstep import spawn_ranks

    system, spec_path, outdir = argv
    with open(spec_path) as f:
        spec = json.load(f)
    os.makedirs(outdir, exist_ok=True)
    spawn_ranks(_rank, spec["nproc"], system, spec, outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
