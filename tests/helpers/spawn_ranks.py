"""Run a test worker on real processes: spawned, one per rank, on a free loopback port."""

from __future__ import annotations

import multiprocessing
import socket
from typing import Any, Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: Callable[..., None], nprocs: int, *args: Any, timeout: float = 240
) -> dict[int, Any]:
    """Call ``worker(rank, port, *args, results)`` in ``nprocs`` spawned processes; each puts
    ``(rank, payload)`` on ``results`` once. Returns rank -> payload after every process
    exited 0 (asserted)."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(worker, r, port, *args, results))
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def _rank_main(worker: Callable[..., None], *args: Any) -> None:
    """One spawned rank: the worker, then :func:`end_rank`."""
    worker(*args)
    end_rank()


def end_rank() -> None:
    """End a test rank's process groups while the interpreter is fully alive (see
    :func:`shardsmith.trainer.parallel.end_distributed`: otherwise a rank can abort at exit
    with ``terminate called without an active exception`` after returning its result)."""
    from shardsmith.trainer.parallel import end_distributed

    end_distributed()


def saved_tiny_run(
    rank: int, port: int, dims: Any, data_path: str, ckpt: str
) -> tuple[Any, Any, Any]:
    """A two-rank trainer worker's start: its torchrun environment, then one step of the tiny
    model in layout ``dims`` saved (synchronously) to ``ckpt`` with one rank per simulated
    node. Returns (the model config before the checkpoint settings, the run's config, the trainer)."""
    import dataclasses
    import os

    from conftest import tiny_train_config

    from shardsmith.trainer.config import CheckpointConfig
    from shardsmith.trainer.train import Trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    base = tiny_train_config(dims, data_path)
    cfg = dataclasses.replace(
        base, steps=1, checkpoint=CheckpointConfig(url=ckpt, async_save=False, simulate_nodes=2)
    )
    first = Trainer.create(cfg)
    first.train_step()
    first.save()
    first.wait_for_save()
    return base, cfg, first
