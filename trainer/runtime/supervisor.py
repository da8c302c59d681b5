"""In-process restarts, the launcher side: ``shardsmith train --restart in-process``.

torchrun's elastic agent answers a worker's death by stopping every worker and starting the
whole group again: new processes, imports, rendezvous, model build, load (a cold start; ~31 s
from the kill to the next finished step on the test machine). The :class:`Supervisor` keeps
the survivors instead: it starts ``nproc`` workers plus ``spares`` *warm spares* (torch and
the trainer imported, waiting; :mod:`shardsmith.trainer.runtime.inprocess`), hosts the TCPStore
every generation rendezvouses on, and when a member dies it opens the next generation: the
survivors keep their ranks (they notice through gloo, tear down their groups and rejoin, see
:mod:`~shardsmith.trainer.runtime.inprocess`), a spare takes each dead rank's slot, and all of
them load the newest complete checkpoint. Spares used up are replaced ``refill_delay_s``
after a restart (their imports would compete for the CPU with the restart itself;
``SHARDSMITH_SPARES_REFILL_S``).

When fewer warm spares are alive than ranks were lost (``--spares 0``, or spares used up
before their refill), nothing waits for a replacement: the survivors **shrink**, continuing,
with the spares left, in the largest layout that fits them
(:func:`~shardsmith.layout.shrink_layout`: tp, pp and cp stay, dp_shard gives way before
dp_replicate; the restart line prints the rule), and reshard the newest local step from each
other's tiers (:mod:`~shardsmith.trainer.checkpoint.peer_reshard`). Each assignment then
carries the new layout and the worker's node (its simulated node stays its own across
generations). Survivors the new layout leaves out first serve their copies to that reshard
(a *serving* assignment: :mod:`~shardsmith.trainer.checkpoint.peer_serve`), then wait as
spares. A shrink that no layout allows ends the job with the reason.

A worker exiting non-zero (a crash, SIGKILL, an error) counts like a death; after
``max_restarts`` restarts the job fails with the first worker's error line, as with torchrun.
SIGTERM/SIGUSR1/SIGINT to the supervisor are forwarded to the members (they checkpoint at the
next step boundary and exit 0); a second Ctrl-C stops everything at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardsmith.errors import LayoutError
from shardsmith.layout import SHRINK_RULE, shrink_layout
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.fault.elastic import fit_world_size
from shardsmith.trainer.runtime.agent import restart_line
from shardsmith.trainer.runtime.inprocess import SUPERVISOR_ENV, WORKER_ID_ENV
from shardsmith.trainer.runtime.launch import (
    EXIT_INTERRUPTED,
    LaunchError,
    first_error,
    job_files,
    set_worker_env,
)
from shardsmith.trainer.runtime.preflight import prepare

log = logging.getLogger(__name__)

#: Seconds after a restart before used-up spares are replaced (default 10): their imports would
#: compete for the CPU with the restart itself. Tests set it to keep spares used up.
SPARES_REFILL_ENV = "SHARDSMITH_SPARES_REFILL_S"

#: Seconds the supervisor waits at most, after a failure, for every member to be dead or to
#: have rejoined before it opens the next generation.
SETTLE_S = 10.0


class Supervisor:
    """Start, watch and re-assign the worker processes of one job (see the module doc).

    Args:
        config_path: the workers' config JSON.
        nproc: ranks per generation (the world size).
        max_restarts: generations after the first, at most.
        spares: warm spare processes kept ready.
        refill_delay_s: seconds after a restart before used-up spares are replaced.
        error_file: where the first failing worker writes its error line.
    """

    def __init__(
        self,
        config_path: str,
        nproc: int,
        *,
        max_restarts: int,
        spares: int,
        refill_delay_s: float = 10.0,
        error_file: str = "",
        cfg: TrainConfig | None = None,
    ) -> None:
        self.config_path, self.nproc, self.max_restarts = config_path, nproc, max_restarts
        self.num_spares, self.refill_delay_s, self.error_file = spares, refill_delay_s, error_file
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.assigned: dict[str, int] = {}
        self.members: list[str] = []
        self.spares: list[str] = []
        self.gen = 0
        self.refill_at: float | None = None
        self.signals: list[int] = []
        self.run_id = f"shardsmith-{uuid.uuid4().hex[:8]}"
        self.cfg = cfg  # the job's layout, model and batch: what a shrink needs
        self.layout = cfg.parallel if cfg is not None else None
        self.shrunk = False
        self.simulate_nodes = cfg.checkpoint.simulate_nodes if cfg is not None else 0
        self.node_of: dict[str, int] = {}  # worker -> its (simulated) node

    # ---- processes ----------------------------------------------------------------------------

    def _start_process(self) -> str:
        worker_id = f"w{len(self.procs)}"
        env = {
            **os.environ,
            SUPERVISOR_ENV: f"127.0.0.1:{self.store.port}",
            WORKER_ID_ENV: worker_id,
            "TORCHELASTIC_RUN_ID": self.run_id,
        }  # the launch id the local tier checks
        self.procs[worker_id] = subprocess.Popen(
            [sys.executable, "-m", "shardsmith.trainer.runtime.inprocess", self.config_path],
            env=env,
        )
        self.assigned[worker_id] = 0
        return worker_id

    def _assign(self, worker_id: str, job: dict[str, Any]) -> None:
        k = self.assigned[worker_id]
        self.assigned[worker_id] = k + 1
        self.store.set(f"assign/{worker_id}/{k}", json.dumps(job))

    def _open_generation(self, leavers: list[str] | None = None) -> None:
        """Assign every member its rank; ``leavers`` (survivors a shrink leaves out) serve
        their copies over the generation's exchange, ranks after the members'
        (:mod:`~shardsmith.trainer.checkpoint.peer_serve`)."""
        leavers = leavers or []
        exchange = len(self.members) + len(leavers) if leavers else 0
        for rank, worker_id in enumerate([*self.members, *leavers]):
            job: dict[str, Any] = {"gen": self.gen, "world": self.nproc}
            if rank < len(self.members):
                job["rank"] = rank
            else:
                job["serve"] = rank
            if exchange:
                job["exchange"] = exchange
            if self.shrunk and self.layout is not None:
                job.update(layout=self.layout.to_json(), simulate_nodes=self.simulate_nodes)
            if self.simulate_nodes:
                job["node"] = self.node_of[worker_id]
            self._assign(worker_id, job)

    def _alive(self, worker_id: str) -> bool:
        return self.procs[worker_id].poll() is None

    def _take_spare(self) -> str:
        while self.spares:
            worker_id = self.spares.pop(0)
            if self._alive(worker_id):
                return worker_id
        return self._start_process()  # none left: a cold process (survivors stay)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Start the job and supervise it to the end.

        Returns:
            0 when every member of the last generation exited 0 (done or preempted),
            :data:`~shardsmith.trainer.runtime.launch.EXIT_INTERRUPTED` after Ctrl-C.

        Raises:
            LaunchError: a member failed after ``max_restarts`` restarts (its error line).
        """
        self.members = [self._start_process() for _ in range(self.nproc)]
        per_node = self.nproc // self.simulate_nodes if self.simulate_nodes else self.nproc
        self.node_of = {w: rank // per_node for rank, w in enumerate(self.members)}
        self.spares = [self._start_process() for _ in range(self.num_spares)]
        self._open_generation()
        previous = self._install_signals()
        try:
            return self._watch()
        finally:
            self._restore_signals(previous)
            self._stop_all()
            for gen in range(self.gen + 1):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(os.path.dirname(self.config_path), f"abort-{gen}"))

    def _watch(self) -> int:
        while True:
            time.sleep(0.02)
            codes = [self.procs[w].poll() for w in self.members]
            if all(code == 0 for code in codes):
                return EXIT_INTERRUPTED if signal.SIGINT in self.signals else 0
            if any(code not in (None, 0) for code in codes) or self._reported():
                if signal.SIGINT in self.signals:
                    return EXIT_INTERRUPTED
                with open(
                    os.path.join(os.path.dirname(self.config_path), f"abort-{self.gen}"), "w"
                ):
                    pass  # survivors drop their connections
                self._restart()
            if self.refill_at is not None and time.monotonic() >= self.refill_at:
                self.refill_at = None
                self.spares += [
                    self._start_process() for _ in range(self.num_spares - len(self.spares))
                ]

    def _reported(self) -> bool:
        """A member of this generation caught a peer failure (none died: e.g. a timeout)."""
        return self.store.add(f"failed/{self.gen}", 0) > 0

    def _settle(self) -> list[int]:
        """The ranks dead once every member is dead or has rejoined (at most ``SETTLE_S``): the
        ranks of a node that die a moment apart are replaced in one restart."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            dead = [rank for rank, w in enumerate(self.members) if not self._alive(w)]
            if (
                len(dead) + self.store.add(f"failed/{self.gen}", 0) >= self.nproc
                or time.monotonic() > deadline
            ):
                return dead
            time.sleep(0.02)

    def _restart(self) -> None:
        dead = self._settle()
        codes = {rank: self.procs[self.members[rank]].returncode for rank in dead}
        if self.gen >= self.max_restarts:
            raise LaunchError(self._failure_line(dead))
        self.gen += 1
        warm = [w for w in self.spares if self._alive(w)]
        leavers: list[str] = []
        if dead and len(warm) < len(dead) and self.cfg is not None:
            what, leavers = self._shrink(dead, warm)
        else:
            for rank in dead:
                worker_id = self._take_spare()
                self.node_of[worker_id] = self.node_of.get(self.members[rank], 0)
                self.members[rank] = worker_id
            what = replaced_words(len(dead), len(warm), self.nproc)
        self._open_generation(leavers)
        self.refill_at = time.monotonic() + self.refill_delay_s
        line = restart_line(self.gen, self.max_restarts, codes, self.nproc, then=what)
        print(line, file=sys.stderr, flush=True)

    def _shrink(self, dead: list[int], warm: list[str]) -> tuple[str, list[str]]:
        """Fewer warm spares than lost ranks (none with ``--spares 0``, or all used up before
        the refill): the survivors continue with the spares left, in the largest layout that
        fits them all (:func:`~shardsmith.layout.shrink_layout`), survivors first (they hold
        the copies), grouped by node. Survivors the layout leaves over serve their copies to
        the shrink, then wait as spares, as do spares left over. Returns the restart line's
        words and those serving survivors.

        Raises:
            LaunchError: no layout fits the survivors (the reason, and the way forward).
        """
        assert self.cfg is not None and self.layout is not None
        old = self.layout
        order = {w: rank for rank, w in enumerate(self.members)}
        alive = [w for rank, w in enumerate(self.members) if rank not in dead]
        alive.sort(key=lambda w: (self.node_of.get(w, 0), order[w]))
        try:
            new = shrink_layout(
                old,
                self.cfg.model,
                len(alive) + len(warm),
                global_batch_size=self.cfg.global_batch_size,
                micro_batch_size=self.cfg.micro_batch_size,
            )
        except LayoutError as exc:
            raise LaunchError(
                f"rank(s) {dead} lost and {len(warm)} warm spare(s) left: cannot shrink: {exc}; "
                "run with more --spares to replace lost ranks instead"
            ) from None
        for worker_id, rank in zip(warm, dead):  # a spare joining takes a lost rank's node
            self.node_of[worker_id] = self.node_of.get(self.members[rank], 0)
        pool = alive + warm
        members, left = pool[: new.world_size], pool[new.world_size :]
        self.members = sorted(members, key=lambda w: (self.node_of.get(w, 0), pool.index(w)))
        self.spares = [w for w in self.spares if w not in members and w not in left] + left
        # with a local tier, survivors left out serve their copies to the shrink first
        leavers = [w for w in left if w in alive] if self.cfg.checkpoint.local_ckpt else []
        self.layout, self.nproc, self.shrunk = new, new.world_size, True
        if self.simulate_nodes:  # nodes left, if they hold equal numbers of ranks
            counts = [self.node_of[w] for w in self.members]
            sizes = {counts.count(n) for n in set(counts)}
            self.simulate_nodes = len(set(counts)) if len(sizes) == 1 else 0
        joined = len([w for w in members if w in warm])
        return (
            f"no spare left: shrinking {old.describe()} ({old.world_size} ranks) -> "
            f"{new.describe()} ({new.world_size} ranks), {SHRINK_RULE}"
            + (f"; {joined} warm spare(s) joined the survivors" if joined else "")
            + (
                f"; {len(leavers)} survivor(s) outside it serve their copies, then wait as spares"
                if leavers
                else ""
            )
            + (
                f"; {len(left) - len(leavers)} spare(s) left over"
                if len(left) > len(leavers)
                else ""
            )
        ), leavers

    def _failure_line(self, dead: list[int]) -> str:
        line = first_error(self.error_file) if self.error_file else ""
        if line:
            return line
        codes = {rank: self.procs[self.members[rank]].returncode for rank in dead}
        how = ", ".join(f"rank {r} exit code {c}" for r, c in codes.items()) or "a peer failure"
        return f"worker failed after {self.max_restarts} restart(s): {how}"

    def _stop_all(self) -> None:
        for worker_id, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    # ---- signals ------------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        sigs = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        return {sig: signal.signal(sig, self._forward) for sig in sigs}

    def _restore_signals(self, previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.signals:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once
        self.signals.append(signum)
        for worker_id in self.members:
            if self._alive(worker_id) and signum != signal.SIGINT:  # Ctrl-C reached them already
                self.procs[worker_id].send_signal(signum)


def replaced_words(num_dead: int, num_warm: int, nproc: int) -> str:
    """What a restart without a shrink does, for its line: ``num_dead`` of ``nproc`` ranks
    replaced by warm spares (``num_warm`` alive; new processes for the rest), the other ranks
    restart in place."""
    if not num_dead:
        return f"all {nproc} ranks restart in place"
    warm = min(num_dead, num_warm)
    cold = num_dead - warm
    by = [
        *(["a warm spare" if warm == 1 else f"{warm} warm spares"] if warm else []),
        *(["a new process" if cold == 1 else f"{cold} new processes"] if cold else []),
    ]
    others = nproc - num_dead
    rest = (
        ""
        if not others
        else ", the other rank restarts in place"
        if others == 1
        else f", the other {others} ranks restart in place"
    )
    return f"replaced by {' and '.join(by)}{rest}"


def launch_in_process(
    cfg: TrainConfig, nproc_per_node: int, *, max_restarts: int = 0, spares: int = 1
) -> int:
    """Like :func:`shardsmith.trainer.runtime.launch.launch`, with in-process restarts and warm spares.

    Returns:
        0, or :data:`~shardsmith.trainer.runtime.launch.EXIT_INTERRUPTED` after Ctrl-C.

    Raises:
        LaunchError: a worker failed after ``max_restarts`` restarts (its error line).
        LayoutError, ConfigError: a layout or batch a worker would refuse
            (:meth:`TrainConfig.check_layout`).
        CheckpointNotFound, CheckpointMismatch, StorageError: from the preflight checks.
    """
    fit_world_size(cfg, nproc_per_node).check_layout()  # before any worker starts
    resolved = prepare(cfg)
    if resolved is None:
        return 0
    cfg = resolved
    set_worker_env()
    with job_files(cfg) as (path, error_file):
        supervisor = Supervisor(
            path,
            nproc_per_node,
            max_restarts=max_restarts,
            spares=spares,
            refill_delay_s=float(os.environ.get(SPARES_REFILL_ENV) or 10.0),
            error_file=error_file,
            cfg=cfg,
        )
        try:
            return supervisor.run()
        except KeyboardInterrupt:
            print(
                "interrupted again: stopped the workers without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_INTERRUPTED
