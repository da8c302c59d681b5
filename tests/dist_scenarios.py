"""Distributed scenarios run by the tests under torchrun (not collected by pytest).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_scenarios.py SPEC.json``

SPEC.json holds ``{"config": <TrainConfig JSON whose parallel dims match N>, "tasks": [...]}``;
every rank runs the tasks in order (each task is collective). One launch thus covers
many cases: process start-up dominates the cost of a distributed test on CPU.

Tasks (``kind``):

* ``logits``: build a fresh :class:`Trainer` (seeded init, no checkpoint), run one
  forward pass of ``tokens`` (B, T) through the whole (pipelined, TP/FSDP-sharded)
  model, and write the full logits (B, T, V) of every last-stage rank to
  ``<out>/logits-rank-NNNNN.safetensors`` (key ``logits``). Stages pass hidden states
  (B, T, D) with point-to-point send/recv between ranks that differ only in ``pp``.
* ``reload``: a fresh Trainer resumes from ``src`` (any layout) and saves the loaded
  state, unchanged, under the root ``dst``.
* ``train``: a fresh Trainer runs to ``steps`` with checkpoint root ``ckpt`` (may be
  empty), ``resume`` (``none`` or a URL) and ``save_interval``; rank 0 writes the
  per-step metrics to ``out`` as JSON ``[{"step", "loss", "grad_norm", "lr"}, ...]``.
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
from torch.distributed.tensor import DTensor

from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.train import Trainer


def _with_checkpoint(cfg: TrainConfig, **kwargs: Any) -> TrainConfig:
    """``cfg`` with these checkpoint fields; the others (e.g. ``tensor_format``) from ``cfg``."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **kwargs))


def task_logits(cfg: TrainConfig, task: dict[str, Any]) -> None:
    """Forward ``task["tokens"]`` through the freshly initialized model; write last-stage logits."""
    trainer = Trainer.create(_with_checkpoint(cfg, resume="none"))
    dims, coords = cfg.parallel, trainer.coords
    tokens = torch.tensor(task["tokens"], dtype=torch.int64)                    # (B, T)
    batch, seq = tokens.shape
    with torch.no_grad():
        if coords["pp"] == 0:
            h = tokens
        else:
            h = torch.empty(batch, seq, cfg.model.hidden_size)                  # (B, T, D)
            dist.recv(h, src=dims.rank_of({**coords, "pp": coords["pp"] - 1}))
        out = trainer.model(h)
        if isinstance(out, DTensor):                                            # vocab-sharded logits
            out = out.full_tensor()
        if coords["pp"] < dims.pp - 1:
            dist.send(out.contiguous(), dst=dims.rank_of({**coords, "pp": coords["pp"] + 1}))
        else:
            os.makedirs(task["out"], exist_ok=True)
            save_file({"logits": out.contiguous()},
                      os.path.join(task["out"], f"logits-rank-{trainer.rank:05d}.safetensors"))
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
        _with_checkpoint(cfg, url=task.get("ckpt", ""), resume=task.get("resume", "none"),
                         save_interval=task.get("save_interval", 0)),
        steps=task["steps"])
    trainer = Trainer.create(run_cfg)
    history = trainer.run()
    if trainer.rank == 0:
        with open(task["out"], "w") as f:
            json.dump([{"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr}
                       for m in history], f)


TASKS = {"logits": task_logits, "reload": task_reload, "train": task_train}


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    with open(argv[0]) as f:
        spec = json.load(f)
    cfg = TrainConfig.from_json(spec["config"])
    try:
        for task in spec["tasks"]:
            t0 = time.perf_counter()
            TASKS[task["kind"]](cfg, task)
            gc.collect()
            if dist.get_rank() == 0:
                print(f"[scenario] {task['kind']} {task.get('src', '')} took "
                      f"{time.perf_counter() - t0:.2f}s", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
