"""Rounds in lockstep between the bench and a peer running in its own interpreter.

The peer (bench/peers/megatron_peer.py, bench/peers/bcp_peer.py) starts once, builds its state and warms up,
then runs one round each time the bench tells it to, so its rounds alternate with ours
(ours, peer, ours, peer ...) without paying its start-up (seconds: imports, a gRPC coordinator,
a first save) in every round, and without its start-up overlapping our measurements.

Files in a control directory carry the protocol: ``ready`` (peer built and warmed up),
``go.<r>`` (bench: run round r), ``round.<r>.json`` (peer: round r's figures, written atomically),
``stop`` (bench: no more rounds). Rank 0 of the peer polls; its other ranks wait in a barrier.
:func:`serve_rounds` is the peer ranks' round loop and :func:`spawn_ranks` starts a peer's (or a
trainer bench's) gloo ranks; both import torch lazily, the rest is standard library only (every
interpreter imports this module).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Callable

POLL_S = 0.05


def _write(path: str, data: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, alive: Callable[[], bool], timeout_s: float) -> bool:
    """True once ``path`` exists; False if ``alive()`` turns false or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not alive() or time.monotonic() > deadline:
            return os.path.exists(path)
        time.sleep(POLL_S)
    return True


# ---- peer side (rank 0 only; the caller barriers) ------------------------------------------------


def peer_ready(ctrl: str) -> None:
    _write(os.path.join(ctrl, "ready"), {})


def _bench_alive(ctrl: str) -> bool:
    """Whether the bench process that started this peer (pid in ``ctrl/bench``) still runs."""
    try:
        with open(os.path.join(ctrl, "bench")) as f:
            os.kill(json.load(f)["pid"], 0)
    except (FileNotFoundError, ProcessLookupError):
        return False
    return True


def peer_next(ctrl: str, r: int) -> bool:
    """Wait until the bench asks for round ``r`` (True) or stops (False). A bench that died
    (killed by the kernel's OOM killer, say) counts as a stop, so its peer does not outlive it
    holding its share of the state."""
    go, stop = os.path.join(ctrl, f"go.{r}"), os.path.join(ctrl, "stop")
    while not os.path.exists(go):
        if os.path.exists(stop) or not _bench_alive(ctrl):
            return False
        time.sleep(POLL_S)
    return True


def peer_done(ctrl: str, r: int, results: dict[str, Any]) -> None:
    _write(os.path.join(ctrl, f"round.{r}.json"), results)


def serve_rounds(ctrl: str, one_round: Callable[[int], dict[str, Any]]) -> None:
    """Every rank of a peer (gloo process group initialised, state built and warmed up): say
    ``ready`` (rank 0), then run ``one_round(r)`` on every rank each time the bench asks for round
    ``r`` until it says ``stop``; rank 0 hands round r's figures (its return value) to the bench.
    Rank 0 decides and broadcasts, so all ranks run the same rounds."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        peer_ready(ctrl)
    r = 0
    while True:
        go = torch.tensor([int(rank != 0 or peer_next(ctrl, r))])
        dist.broadcast(go, 0)
        if not int(go):
            return
        results = one_round(r)
        if rank == 0:
            peer_done(ctrl, r, results)
        r += 1


def spawn_ranks(worker: Callable[..., None], nproc: int, *args: Any) -> None:
    """Spawn ``nproc`` processes running ``worker(rank, *args, port)`` with a free localhost TCP
    port for their gloo rendezvous (``tcp://127.0.0.1:<port>``); returns when all have exited and
    raises (torch.multiprocessing's ProcessRaisedException) if one failed."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(*args, port), nprocs=nproc, start_method="spawn")


# ---- bench side ------------------------------------------------------------------------------------


class PeerProcess:
    """A peer's interpreter running ``cmd`` (which gets ``ctrl`` as its control directory)."""

    def __init__(self, cmd: list[str], ctrl: str, env: dict[str, str], log_path: str) -> None:
        os.makedirs(ctrl, exist_ok=True)
        _write(os.path.join(ctrl, "bench"), {"pid": os.getpid()})
        self.ctrl, self.log_path = ctrl, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def why(self) -> str:
        """The peer's last error lines (for a 'skipped: ...' message)."""
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            lines = f.read().splitlines()
        errors = [line for line in lines if "Error" in line or "Killed" in line]
        return (
            f"rc {self.proc.poll()}: " + (" | ".join(errors[-3:]) or " | ".join(lines[-3:]))[:600]
        )

    def ready(self, timeout_s: float = 900.0) -> bool:
        return _wait_for(os.path.join(self.ctrl, "ready"), self.alive, timeout_s)

    def round(self, r: int, timeout_s: float = 900.0) -> dict[str, Any] | None:
        """Run the peer's round ``r``; its figures, or None if it died or timed out."""
        _write(os.path.join(self.ctrl, f"go.{r}"), {})
        path = os.path.join(self.ctrl, f"round.{r}.json")
        if not _wait_for(path, self.alive, timeout_s):
            return None
        with open(path) as f:
            return json.load(f)

    def close(self, timeout_s: float = 120.0) -> None:
        _write(os.path.join(self.ctrl, "stop"), {})
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def peer_main(argv: list[str], worker: Callable[..., None]) -> int:
    """A peer's ``main(SPEC DIR CTRL)``: read the state's description (JSON at SPEC, with
    ``nproc``), make the checkpoint directory DIR, run ``worker(rank, spec, DIR, CTRL, port)`` on
    ``nproc`` spawned ranks (:func:`spawn_ranks`); 0 when all ranks exited cleanly."""
    spec_path, base, ctrl = argv
    with open(spec_path) as f:
        spec = json.load(f)
    os.makedirs(base, exist_ok=True)
    spawn_ranks(worker, spec["nproc"], spec, base, ctrl)
    return 0
