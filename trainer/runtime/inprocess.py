"""In-process restarts, the worker side: a process that survives a peer's death rejoins.

``python -m shardsmith.trainer.runtime.inprocess CONFIG.json`` is started by the supervisor
(:mod:`shardsmith.trainer.runtime.supervisor`, ``shardsmith train --restart in-process``) with
``SHARDSMITH_SUPERVISOR=HOST:PORT`` (its TCPStore) and ``SHARDSMITH_WORKER_ID``. The process
imports torch and the trainer once, then serves *assignments* the supervisor writes under
``assign/{worker id}/{k}`` (k = 0, 1, ...): ``{"gen": G, "rank": R, "world": W}`` (after a
shrink also ``layout``, ``simulate_nodes``, ``node``, and ``exchange``: the size of the
shrink's exchange group), ``{"gen": G, "serve": X, "exchange": N, ...}`` (a survivor the
shrink's layout leaves out: serve its copies as rank X of the exchange, then wait again:
:mod:`~shardsmith.trainer.checkpoint.peer_serve`) or ``{"exit": code}``. A process waiting
for its next one is a *warm spare*.

For each assignment the worker joins generation G: a gloo process group (``cpu:gloo,cuda:nccl``
with GPUs) over a
``PrefixStore("gen{G}/")`` of the supervisor's store (a new prefix per generation, so no key of
an old group is ever read), builds the mesh, the model (meta device, local shards only), the
optimizer, resumes the newest complete checkpoint and trains. When a member dies, the
supervisor creates the file ``abort-{G}`` beside the config; every member's
:class:`AbortWatcher` then shuts down the process's TCP connections, so whatever it waits in (a
gloo collective, a rendezvous on the store) fails at once. The survivor sees :func:`peer_lost`,
aborts its process groups, joins its background save thread, reconnects to the store, counts
itself in ``failed/{G}`` and waits for its next assignment, while the supervisor gives the dead
rank's slot to a warm spare. Nothing is re-imported or re-spawned: the restart costs a
rendezvous, a model build, a load and the first step.

Any other error (a bug, bad input, a failed save of one's own) ends the process with exit 1
and the error line (:func:`~shardsmith.trainer.runtime.worker.report_error`), which the supervisor
treats like a death: the group restarts, up to ``--max-restarts`` times, as under torchrun.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardsmith.layout import ParallelDims
from shardsmith.storage import crashpoints
from shardsmith.trainer.checkpoint.local_tier import SIMULATED_NODE_ENV
from shardsmith.trainer.checkpoint.peer_serve import release_exchange, use_exchange
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.fault.preemption import say

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "SHARDSMITH_SUPERVISOR"
WORKER_ID_ENV = "SHARDSMITH_WORKER_ID"
#: Substrings of the errors gloo (and the c10d store) raise when a peer is gone or silent, and
#: those of NCCL after its communicators are aborted or a remote rank died (GPU jobs; not run
#: on a GPU here: no device was lent to the session that added them).
PEER_LOST_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "gloo/transport",
    "Socket Timeout",
    "Timed out",
    "DistNetworkError",
    "Connection refused",
    "connection was closed",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "remote process exited",
)


def peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it wraps) says a peer of a collective died or went
    silent (a ``DistNetworkError``, or a gloo/store error with one of
    :data:`PEER_LOST_MARKERS`): the caller should rejoin rather than fail."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, dist.DistNetworkError):
            return True
        if isinstance(node, RuntimeError) and any(m in str(node) for m in PEER_LOST_MARKERS):
            return True
        node = node.__cause__ or node.__context__
    return False


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the supervisor's TCPStore at ``HOST:PORT``."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def next_assignment(store: dist.TCPStore, worker_id: str, k: int, parent: int) -> dict[str, Any]:
    """Block until the supervisor writes this worker's ``k``-th assignment; an exit order
    when the supervisor (``parent``) is gone."""
    key = f"assign/{worker_id}/{k}"
    while not store.check([key]):  # polling: a blocking wait logs every timeout
        if os.getppid() != parent:
            return {"exit": 1, "why": "the supervisor is gone"}
        time.sleep(0.01)
    return json.loads(store.get(key))


def join_generation(cfg: TrainConfig, store: dist.TCPStore, job: dict[str, Any]) -> Any:
    """Join generation ``job["gen"]`` as ``job["rank"]`` of ``job["world"]`` and build the
    trainer (collective over the generation: every member calls it)."""
    from shardsmith.trainer.fault.elastic import fit_world_size
    from shardsmith.trainer.fault.watchdog import apply_collective_timeout
    from shardsmith.trainer.parallel import device_type
    from shardsmith.trainer.train import Trainer

    gen, rank, world = job["gen"], job["rank"], job["world"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCHELASTIC_RESTART_COUNT=str(gen),
    )
    logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # Crash points (tests) follow the rank; SHARDSMITH_TEST_CRASH_AT fires in generation 0,
    # SHARDSMITH_TEST_CRASH_AT_GEN{G} in generation G (a replayed save must not crash again).
    crash_env = "SHARDSMITH_TEST_CRASH_AT" + (f"_GEN{gen}" if gen else "")
    crashpoints.configure(os.environ.get(crash_env, ""), rank=rank)
    timeout = max(cfg.fault.init_timeout, cfg.fault.collective_timeout)
    apply_collective_timeout(timeout)
    backend = "gloo"
    if device_type() == "cuda":  # as init_distributed: NCCL for GPU tensors
        torch.cuda.set_device(rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"gen{gen}/", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    if "node" in job:  # the (simulated) node this process runs on, whatever its rank
        os.environ[SIMULATED_NODE_ENV] = str(job["node"])
    if job.get("exchange"):  # survivors outside the new layout serve the shrink with us
        use_exchange(exchange_group(store, job, rank, job["exchange"], timeout))
    try:  # the exchange is released after the resume (peer_serve.releases_exchange)
        return Trainer.create(fit_world_size(assigned_config(cfg, job), world))
    except BaseException:
        release_exchange(False)
        raise


def exchange_group(
    store: dist.TCPStore, job: dict[str, Any], rank: int, size: int, timeout: float
) -> dist.ProcessGroup:
    """The exchange of generation ``job["gen"]``: a gloo group of its own (not the default
    group: its ranks past the members' are the survivors the new layout leaves out) over the
    store prefix ``gen{G}/exchange/``; every member and serving survivor constructs it (the
    constructor connects them all). See :mod:`~shardsmith.trainer.checkpoint.peer_serve`."""
    prefixed = dist.PrefixStore(f"gen{job['gen']}/exchange/", store)
    return dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout))


def serve_as_leaver(
    cfg: TrainConfig, address: str, store: dist.TCPStore, job: dict[str, Any], flag_dir: str
) -> dist.TCPStore:
    """A survivor the shrink's layout leaves out (``job["serve"]``: its rank in the exchange
    of ``job["exchange"]`` ranks): serve its copies to the members' transfer, then return to
    wait as a spare. A failure (a member died meanwhile) is logged, not raised: the next
    generation starts without this process. Returns the store client to go on with."""
    from shardsmith.trainer.checkpoint.peer_serve import serve_copies

    timeout = max(cfg.fault.init_timeout, cfg.fault.collective_timeout)
    if "node" in job:
        os.environ[SIMULATED_NODE_ENV] = str(job["node"])
    watcher = AbortWatcher(os.path.join(flag_dir, f"abort-{job['gen']}"))
    try:
        group = exchange_group(store, job, job["serve"], job["exchange"], timeout)
        line = serve_copies(assigned_config(cfg, job), group, job["serve"])
        del group
    except Exception as exc:
        if os.environ.get("SHARDSMITH_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]  # the line that names the cause
        line = f"serving failed ({type(exc).__name__}: {first})"
        store = connect(address, timeout)  # the old connection may be severed
    finally:
        watcher.close()
    say(f"survivor outside the layout of generation {job['gen']}: {line}; waiting as a spare")
    return store


def assigned_config(cfg: TrainConfig, job: dict[str, Any]) -> TrainConfig:
    """``cfg`` in the layout a shrink assigned (``job["layout"]`` and the simulated nodes
    left, ``job["simulate_nodes"]``), or ``cfg`` itself."""
    if "layout" not in job:
        return cfg
    checkpoint = replace(cfg.checkpoint, simulate_nodes=int(job.get("simulate_nodes", 0)))
    return replace(cfg, parallel=ParallelDims.from_json(job["layout"]), checkpoint=checkpoint)


def abort_groups() -> None:
    """Abort and forget every process group of this process: ``ProcessGroupGloo.abort`` closes
    its connections, so a peer blocked in a collective with this rank fails at once instead of
    waiting for the collective timeout (``_abort_process_group``: private, the call torchft and
    nvidia-resiliency-ext make for NCCL)."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._abort_process_group()
    except Exception as exc:  # an abort that fails still leaves destroy to try
        log.warning("aborting the process groups failed (%s); destroying them", exc)
        if dist.is_initialized():
            dist.destroy_process_group()


def sever_connections(keep_port: int | None = None) -> int:
    """Shut down every connected TCP socket of this process (except those to ``keep_port``);
    returns how many. A gloo collective blocked on such a socket fails at
    once (``Connection closed``), here and on the peer at the other end: gloo has no other way to
    interrupt a collective another thread waits in (``ProcessGroupGloo.abort`` does not wake a
    local wait, and gloo's algorithms talk to a few peers only, so a death does not reach every
    rank by itself). Linux (``/proc/self/fd``); other connections (HTTP to object storage)
    reconnect on their next use."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                if sock.getpeername()[1] != keep_port:  # a listening socket raises: skipped
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
        except OSError:
            pass
        finally:
            sock.close()
    return count


def _uses_nccl() -> bool:
    """True when this process's default group runs NCCL for GPU tensors."""
    return (
        dist.is_initialized()
        and torch.cuda.is_available()
        and "nccl" in str(dist.get_backend()).lower()
    )


class AbortWatcher:
    """A daemon thread that severs every connection of this process (:func:`sever_connections`:
    the gloo pairs and the store client a rendezvous may wait on) once the supervisor creates
    the file ``flag`` (a member of this generation died or failed), so every member reaches
    :func:`peer_lost` within milliseconds, wherever it waits. With NCCL it also aborts the
    process groups (``ncclCommAbort`` frees a collective stuck on a CUDA stream, which no socket
    does); untested on GPUs so far."""

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="shardsmith-abort", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            if os.path.exists(self.flag):
                say(
                    f"rank {os.environ.get('RANK', '?')}: generation aborted by the supervisor; "
                    f"closed {sever_connections()} connection(s)"
                )
                if _uses_nccl():  # a wait on a CUDA stream ignores sockets: abort NCCL itself
                    abort_groups()
                return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)


def tear_down(trainer: Any) -> None:
    """Abort every process group of this process (peers blocked on us fail at once) and
    wait for this rank's background save to end (it fails on its destroyed group), so no old
    save can commit a step while the next generation picks the one to load."""
    abort_groups()
    checkpointer = getattr(getattr(trainer, "checkpointing", None), "checkpointer", None)
    thread = getattr(checkpointer, "_thread", None)
    if thread is not None:
        thread.join(timeout=30)


def serve(cfg: TrainConfig, address: str, worker_id: str, flag_dir: str) -> int:
    """Serve assignments until training ends (0), an exit order, or a non-peer error (1).

    ``address``: the supervisor's store; ``flag_dir``: where it creates ``abort-{gen}``."""
    from shardsmith.trainer.runtime.worker import report_error

    timeout = max(cfg.fault.init_timeout, cfg.fault.collective_timeout)
    parent, k, store = os.getppid(), 0, connect(address, timeout)
    while True:
        job = next_assignment(store, worker_id, k, parent)
        k += 1
        if "exit" in job:
            return int(job["exit"])
        if "serve" in job:
            store = serve_as_leaver(cfg, address, store, job, flag_dir)
            continue
        trainer = None
        watcher = AbortWatcher(os.path.join(flag_dir, f"abort-{job['gen']}"))
        try:
            trainer = join_generation(cfg, store, job)
            trainer.run()
            watcher.close()
            dist.destroy_process_group()  # the normal end: no abort
            return 0
        except Exception as exc:
            if not peer_lost(exc):
                if os.environ.get("SHARDSMITH_DEBUG"):
                    raise
                report_error(f"rank {job['rank']}: {type(exc).__name__}: {exc}")
                return 1
            say(peer_gone_line(job["rank"], job["gen"], exc))
            watcher.close()
            store = connect(address, timeout)  # the old connection may be severed
            store.add(f"failed/{job['gen']}", 1)  # the supervisor may open the next generation
            tear_down(trainer)  # ...which waits in rendezvous for this rank
        finally:
            watcher.close()
            abort_groups()


def peer_gone_line(rank: int, gen: int, exc: BaseException) -> str:
    """The console line of a survivor that rejoins: its rank, the generation and the first
    line of the error that told it a peer is gone, whole (a cut one ended mid-word)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"rank {rank}: a peer of generation {gen} is gone ({text}); rejoining"


def main(argv: list[str]) -> int:
    from shardsmith.trainer.runtime.worker import setup_process

    setup_process()
    with open(argv[0]) as f:
        cfg = TrainConfig.from_json(json.load(f))
    importlib.import_module(
        "shardsmith.trainer.train"
    )  # warm: the imports happen before any assignment

    try:
        return serve(
            cfg, os.environ[SUPERVISOR_ENV], os.environ[WORKER_ID_ENV], os.path.dirname(argv[0])
        )
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    from shardsmith.trainer.runtime.worker import exit_process

    # No interpreter teardown: collecting the groups and DTensors of aborted generations can
    # deadlock in their destructors; everything this process wrote is closed and flushed.
    exit_process(main(sys.argv[1:]))
