"""Distributed scenarios run by the tests under torchrun (not collected by pytest).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/dist_scenarios.py SPEC.json``

SPEC.json holds ``{"config": <TrainConfig JSON whose parallel dims match N>, "tasks": [...]}``;
every rank runs the tasks in order (each task is collective). One launch thus covers
many cases: process start-up dominates the cost of a distributed test on CPU. A task's
``set`` replaces top-level TrainConfig fields for that task (e.g. ``{"sequence_parallel": true}``).

Tasks (``kind``):

* ``logits``: build a fresh :class:`Trainer` (seeded init, no checkpoint), run one
  forward pass of ``tokens`` (B, T) through the whole (pipelined, TP/FSDP-sharded)
  model (with context parallelism: each rank its tokens, the logits gathered back), and
  write the full logits (B, T, V) of every last-stage rank to
  ``<out>/logits-rank-NNNNN.safetensors`` (key ``logits``). Stages pass hidden states
  (B, T, D) with point-to-point send/recv between ranks that differ only in ``pp``.
* ``reload``: a fresh Trainer resumes from ``src`` (any layout) and saves the loaded
  state, unchanged, under the root ``dst``.
* ``grads``: a fresh Trainer runs one forward/backward of ``tokens`` (inputs) and
  ``targets`` (B, T) with its step math (schedule included) and writes every parameter's
  full gradient (FQN keys) to ``<out>/grads-rank-NNNNN.safetensors``.
* ``reshard``: rank 0 reshards the step directory ``src`` offline to ``dst`` under the
  layout ``parallel`` (ParallelDims JSON); the others wait.
* ``train``: a fresh Trainer runs to ``steps`` with checkpoint root ``ckpt`` (may be
  empty), ``resume`` (``none`` or a URL) and ``save_interval``; rank 0 writes the
  per-step metrics to ``out`` as JSON ``[{"step", "loss", "grad_norm", "lr"}, ...]``.
* ``bus_bytes``: a fresh Trainer takes one step (the schedule's shape inference), then one
  more under ``bench/comm_volume.py``'s recorder; rank 0 writes that step's bus bytes by
  process-group kind to ``out`` (JSON ``{"tp": ..., "dp_shard": ..., ...}``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from spawn_ranks import end_rank
from torch.distributed.tensor import DTensor

from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.train import Trainer


def _with_checkpoint(cfg: TrainConfig, **kwargs: Any) -> TrainConfig:
    """``cfg`` with these checkpoint fields; the others (e.g. ``tensor_format``) from ``cfg``."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **kwargs))


def task_logits(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Forward ``task["tokens"]`` through the freshly initialized model; write last-stage logits.
    Model chunks run in pipeline order; chunk ``c`` lives on pipeline rank
    ``dims.chunk_rank(c)`` (consecutive chunks on one rank, as in the V style, pass locally)."""
    from shardsmith.trainer.pipeline import chunks_of

    trainer = Trainer.create(_with_checkpoint(cfg, resume="none"))
    dims, coords = cfg.parallel, trainer.coords
    mine = {coords["pp"] if c < 0 else c: m for c, m in chunks_of(trainer.model)}
    tokens = torch.tensor(task["tokens"], dtype=torch.int64)  # (B, T)
    cp = trainer.step_math.cp
    if cp is not None:  # this rank's (B, T / cp)
        tokens = cp.shard(tokens)
    batch, seq = tokens.shape
    out = None
    with torch.no_grad():
        for c in range(dims.num_chunks):
            if c not in mine:
                continue
            if c == 0:
                h = tokens
            elif c - 1 in mine:  # the previous chunk ran here
                h = out
            else:
                h = torch.empty(batch, seq, cfg.model.hidden_size)  # (B, T, D)
                dist.recv(h, src=dims.rank_of({**coords, "pp": dims.chunk_rank(c - 1)}))
            out = mine[c](h)
            if isinstance(out, DTensor):  # vocab-sharded logits
                out = out.full_tensor()
            if c < dims.num_chunks - 1 and c + 1 not in mine:
                dist.send(
                    out.contiguous(), dst=dims.rank_of({**coords, "pp": dims.chunk_rank(c + 1)})
                )
        if dims.num_chunks - 1 in mine and cp is not None:  # the whole sequence again
            from shardsmith.trainer.context_parallel import unshard_sequence

            parts = [torch.empty_like(out) for _ in range(cp.size)]
            dist.all_gather(parts, out.contiguous(), group=cp.group)
            out = unshard_sequence(parts)
        if dims.num_chunks - 1 in mine:
            os.makedirs(task["out"], exist_ok=True)
            save_file(
                {"logits": out.contiguous()},
                os.path.join(task["out"], f"logits-rank-{trainer.rank:05d}.safetensors"),
            )
    dist.barrier()


def task_grads(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """One forward/backward of ``task["tokens"]`` -> ``task["targets"]``; write full gradients."""
    from shardsmith.trainer.parallel import finalize_grads

    trainer = Trainer.create(_with_checkpoint(cfg, resume="none"))
    inputs = torch.tensor(task["tokens"], dtype=torch.int64)
    targets = torch.tensor(task["targets"], dtype=torch.int64)
    trainer.step_math.forward_backward(inputs, targets)
    finalize_grads(trainer.model, trainer.grad_sum_groups)
    from shardsmith.trainer.moe import EXPERT_TP_DIMS, all_gather_rows, expert_params

    experts = expert_params(trainer.model)
    grads = {}
    for fqn, p in trainer.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if fqn in experts and experts[fqn][1].ep_size > 1:  # E / ep experts per rank
                g = all_gather_rows(g, trainer.mesh["dp_shard"].get_group())
            if fqn in experts and experts[fqn][1].tp_size > 1:  # F / tp per expert
                g = all_gather_rows(
                    g, trainer.mesh["tp"].get_group(), EXPERT_TP_DIMS[experts[fqn][2]]
                )
            grads[fqn] = g.detach().contiguous()
    os.makedirs(task["out"], exist_ok=True)
    save_file(grads, os.path.join(task["out"], f"grads-rank-{trainer.rank:05d}.safetensors"))
    dist.barrier()


def task_reload(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Resume from ``task["src"]`` into this layout, then save what was loaded under ``task["dst"]``."""
    trainer = Trainer.create(_with_checkpoint(cfg, url=task["dst"], resume=task["src"]))
    if not trainer.resume():
        raise RuntimeError(f"nothing resumed from {task['src']}")
    trainer.save()
    trainer.wait_for_save()


def task_train(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Train to ``task["steps"]``; rank 0 writes the metrics of the steps this run took."""
    run_cfg = dataclasses.replace(
        _with_checkpoint(
            cfg,
            url=task.get("ckpt", ""),
            resume=task.get("resume", "none"),
            save_interval=task.get("save_interval", 0),
        ),
        steps=task["steps"],
    )
    trainer = Trainer.create(run_cfg)
    history = trainer.run()
    if trainer.rank == 0:
        with open(task["out"], "w") as f:
            json.dump(
                [
                    {"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr}
                    for m in history
                ],
                f,
            )


def task_bus_bytes(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """One step's bus bytes by group kind, as ``bench/comm_volume.py`` counts them."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from comm_volume import recorder

    trainer = Trainer.create(cfg)
    trainer.train_step()  # the schedule's shape inference
    with recorder(cfg.parallel) as rec:
        trainer.train_step()
    if trainer.rank == 0:
        with open(task["out"], "w") as f:
            json.dump(rec.nbytes, f)


def task_reshard(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Rank 0 reshards ``src`` to ``dst`` offline (the engine of ``shardsmith reshard``)."""
    from shardsmith.layout import ParallelDims
    from shardsmith.reshard.api import reshard
    from shardsmith.storage.store.fs import Store

    if dist.get_rank() == 0:
        reshard(Store(task["src"]), task["dst"], ParallelDims.from_json(task["parallel"]))
    dist.barrier()


def _step_peak_nbytes(trainer: Trainer, stages: list[Any]) -> int:
    """One training step; the most bytes of receive buffers the rank's stages held at once,
    sampled before and after each forward and backward of a microbatch."""
    from shardsmith.trainer.pipeline import received_nbytes

    peak = 0

    def sampled(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal peak
            peak = max(peak, sum(received_nbytes(s) for s in stages))
            out = method(*args, **kwargs)
            peak = max(peak, sum(received_nbytes(s) for s in stages))
            return out

        return run

    for stage in stages:
        stage.forward_one_chunk = sampled(stage.forward_one_chunk)
        stage.backward_one_chunk = sampled(stage.backward_one_chunk)
    try:
        trainer.train_step()
    finally:
        for stage in stages:
            del stage.forward_one_chunk, stage.backward_one_chunk
    return peak


def task_buffers(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Pipeline receive buffers: step 1 as upstream torch keeps them, step 2 released;
    after each, the bytes of receive buffers every stage of each pp rank holds, and each
    step's peak of them (:func:`_step_peak_nbytes`). Rank 0 writes ``{"upstream_after_step_nbytes",
    "after_step_nbytes", "upstream_peak_nbytes", "peak_nbytes", "output_chunks"}`` (lists by pp
    rank; ``output_chunks``: stage outputs the schedule still holds after the step) to ``out``."""
    from shardsmith.trainer.pipeline import received_nbytes

    trainer = Trainer.create(_with_checkpoint(cfg, resume="none"))
    schedule = trainer.step_math.schedule
    stages = list(getattr(schedule, "_stages", [])) or [schedule._stage]
    out: dict[str, Any] = {}
    for release, name in ((False, "upstream_"), (True, "")):
        for stage in stages:
            stage.release_buffers = release
        peak = _step_peak_nbytes(trainer, stages)
        outputs = sum(len(s.output_chunks) for s in stages)  # logits kept for a merged output
        held = torch.tensor(
            [sum(received_nbytes(s) for s in stages), peak, outputs], dtype=torch.int64
        )
        parts = [torch.zeros_like(held) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, held)
        pp = [cfg.parallel.coords(r)["pp"] for r in range(dist.get_world_size())]
        by_pp = {p: part for p, part in zip(pp, parts)}
        out[f"{name}after_step_nbytes"] = [int(by_pp[p][0]) for p in sorted(by_pp)]
        out[f"{name}peak_nbytes"] = [int(by_pp[p][1]) for p in sorted(by_pp)]
        out[f"{name}output_chunks"] = [int(by_pp[p][2]) for p in sorted(by_pp)]
    if trainer.rank == 0:
        print(f"[scenario] buffers {cfg.pipeline_schedule or 'default'}: {out}", flush=True)
        with open(task["out"], "w") as f:
            json.dump(out, f)


TASKS = {
    "logits": task_logits,
    "grads": task_grads,
    "reload": task_reload,
    "train": task_train,
    "reshard": task_reshard,
    "buffers": task_buffers,
    "bus_bytes": task_bus_bytes,
}


def _task_config(cfg: TrainConfig, task: dict[str, Any]) -> TrainConfig:
    """``cfg`` with the task's ``set`` fields (``parallel`` given as ParallelDims JSON,
    ``model`` as ModelConfig JSON)."""
    from shardsmith.layout import ModelConfig, ParallelDims

    fields = dict(task.get("set", {}))
    if "parallel" in fields:
        fields["parallel"] = ParallelDims.from_json(fields["parallel"])
    if "model" in fields:
        fields["model"] = ModelConfig.from_json(fields["model"])
    return dataclasses.replace(cfg, **fields)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    with open(argv[0]) as f:
        spec = json.load(f)
    cfg = TrainConfig.from_json(spec["config"])
    try:
        for task in spec["tasks"]:
            t0 = time.perf_counter()
            TASKS[task["kind"]](_task_config(cfg, task), task)
            gc.collect()
            if dist.get_rank() == 0:
                print(
                    f"[scenario] {task['kind']} {task.get('src', '')} took "
                    f"{time.perf_counter() - t0:.2f}s",
                    flush=True,
                )
    finally:
        end_rank()  # process groups down and cycles collected before the interpreter's teardown
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
