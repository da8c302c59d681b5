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


def run_ranks(worker: Callable[..., None], nprocs: int, *args: Any, timeout: float = 240) -> dict[int, Any]:
    """Call ``worker(rank, port, *args, results)`` in ``nprocs`` spawned processes; each puts
    ``(rank, payload)`` on ``results`` once. Returns rank -> payload after every process
    exited 0 (asserted)."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, results)) for r in range(nprocs)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
