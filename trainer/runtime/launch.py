"""Launching worker processes through torchrun's agent (``torch.distributed.elastic``).

``shardsmith train --nproc-per-node N`` calls :func:`launch`, which starts N workers
with the elastic agent (:mod:`shardsmith.trainer.runtime.agent`: c10d rendezvous on
localhost, restarts up to ``max_restarts``, each named on the console with the ranks that
failed and how);
each worker runs :func:`shardsmith.trainer.train.run_training`. Under an external
``torchrun`` the CLI runs the worker body directly instead (``cli/train_commands.py: under_torchrun``).

Elastic restarts: when a worker dies, the agent stops the others (SIGTERM, then SIGKILL
after 30 s) and starts the whole group again, up to ``max_restarts`` times; every rank
then resumes from the newest committed checkpoint (``TORCHELASTIC_RESTART_COUNT`` > 0).
Under ``torchrun --nnodes MIN:MAX`` the new group may have another world size:
``run_training`` re-derives ``dp_shard`` when the user left it free (``--dp-shard -1``)
and the checkpoint loads by resharding.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
import uuid
from typing import Iterator

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig

from shardsmith.errors import ShardsmithError
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.fault.elastic import fit_world_size
from shardsmith.trainer.fault.preemption import PREEMPT_SIGNALS
from shardsmith.trainer.runtime.agent import failure_text, run_agent
from shardsmith.trainer.runtime.preflight import prepare

#: Where a worker writes its error line; the first one to fail creates the file (O_EXCL) and
#: the launcher prints it once, instead of every rank's echo of the same failure.
from shardsmith.trainer.runtime.worker import ERROR_FILE_ENV

#: Exit code of a job stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 128 + signal.SIGINT


class LaunchError(ShardsmithError, RuntimeError):
    """A worker process failed (its rank and exit code are named)."""


def config_payload(cfg: TrainConfig) -> dict:
    """The config JSON handed to workers, storage options (credentials) included.

    Local checkpoint and run directories are made absolute, so every worker start (the
    first and each elastic restart, wherever its working directory) finds the same
    checkpoint root; with ``resume`` at ``auto`` (the default) a restarted group resumes
    from its newest committed step (``CheckpointPolicy.resume_source`` says how ``none`` and URLs
    behave on a restart).
    """
    data = cfg.to_json()
    data["checkpoint"]["storage_options"] = cfg.checkpoint.storage_options
    data["checkpoint"]["resume_step"] = (
        cfg.checkpoint.resume_step
    )  # resolved once, here (preflight.resolve)
    for section, key in (("checkpoint", "url"), ("checkpoint", "local_ckpt"), (None, "run_dir")):
        holder = data[section] if section else data
        if holder.get(key) and "://" not in holder[key]:
            holder[key] = os.path.abspath(holder[key])
    return data


def launch(cfg: TrainConfig, nproc_per_node: int, *, max_restarts: int = 0) -> int:
    """Check what can be checked here and resolve the step to load once
    (:func:`~shardsmith.trainer.runtime.preflight.prepare`; a config the CLI resolved is taken as
    is), then run training on ``nproc_per_node`` local worker processes and wait for them.

    A SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) to this process, at any moment, is forwarded to the
    workers, which checkpoint at their next step boundary and exit (a worker that has not
    reached its training loop dies of it at once: nothing to save); the agent waits
    ``fault.preempt_deadline`` (+5 s) for them. A second Ctrl-C interrupts that wait: the agent then stops the workers
    with SIGTERM (which a worker that got a Ctrl-C takes as the second signal and exits at
    once), SIGKILL after the same wait.

    The workers inherit ``OMP_NUM_THREADS=1`` and :data:`MALLOC_ENV` unless already set.

    Returns:
        The exit code for the command: 0, or :data:`EXIT_INTERRUPTED` after Ctrl-C.

    Raises:
        LaunchError: a worker failed (after ``max_restarts`` restarts of the group; the
            message is the first failing rank's error line), or another signal (SIGHUP...)
            stopped the job.
        LayoutError, ConfigError: a layout or batch a worker would refuse
            (:meth:`TrainConfig.check_layout`).
        CheckpointNotFound, CheckpointMismatch, StorageError: from the preflight checks.
    """
    fit_world_size(cfg, nproc_per_node).check_layout()  # before any worker starts
    resolved = prepare(cfg)
    if resolved is None:
        return 0
    cfg = resolved
    _quiet_elastic_logs()
    set_worker_env()
    with job_files(cfg) as (path, error_file):
        lc = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc_per_node,
            run_id=f"shardsmith-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            **_shutdown_timeout(cfg),
        )
        try:
            run_agent(lc, sys.executable, ("-m", "shardsmith.trainer.runtime.worker", path))
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            raise LaunchError(
                first_error(error_file)
                or f"worker rank {rank} {failure_text(failure.exitcode)}; "
                f"{len(exc.failures)} worker(s) failed"
            ) from None
        except SignalException as exc:
            return _stopped_by(exc)
    return 0


@contextlib.contextmanager
def job_files(cfg: TrainConfig) -> Iterator[tuple[str, str]]:
    """A temporary directory with the workers' config JSON and the path of the error file
    (exported as ``SHARDSMITH_ERROR_FILE``); both are removed on exit."""
    workdir = tempfile.mkdtemp(prefix="shardsmith-launch-")
    path, error_file = os.path.join(workdir, "config.json"), os.path.join(workdir, "error.txt")
    os.environ[ERROR_FILE_ENV] = error_file
    try:
        with open(path, "w") as f:
            json.dump(config_payload(cfg), f)
        yield path, error_file
    finally:
        os.environ.pop(ERROR_FILE_ENV, None)
        for name in (path, error_file):
            if os.path.exists(name):
                os.unlink(name)
        os.rmdir(workdir)


#: glibc malloc settings for the workers, unless the user set them. A fixed mmap threshold
#: (64 KiB) turns off glibc's dynamic one, which rises to 32 MiB after the first large free
#: and then keeps every freed tensor below that in the heap, fragmented and resident (a
#: tp2·pp2·dp_shard2 worker of bench/init_memory.py peaked at 2.0-2.5 GiB instead of 1.5);
#: two arenas stop each gloo/loader thread from keeping an arena of freed memory resident.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}


def set_worker_env() -> None:
    """Environment the workers inherit (each value only where the user has not set it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name, value in MALLOC_ENV.items():
        os.environ.setdefault(name, value)
    # The agent's shared TCPStore keeps the previous group's keys across restarts, so a
    # restarted group can read stale peer addresses and fail to connect (pytorch#135712);
    # let rank 0 of each group host a fresh store instead.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _quiet_elastic_logs() -> None:
    """torchelastic's agent logs every signal it forwards and every worker it stops; without
    ``--debug`` only its errors about itself reach the console (workers report their own)."""
    if not os.environ.get("SHARDSMITH_DEBUG"):
        # Its modules' loggers set WARNING themselves (torch's elastic get_logger), so the
        # parent's level alone did not reach them: a Ctrl-C printed "W... Received 2 death
        # signal, shutting down workers" above shardsmith's own line.
        prefix = "torch.distributed.elastic"
        for name in [
            prefix,
            *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + ".")),
        ]:
            logging.getLogger(name).setLevel(logging.CRITICAL)


def first_error(error_file: str) -> str:
    """The first failing worker's error line, if one wrote it."""
    try:
        with open(error_file) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stopped_by(exc: SignalException) -> int:
    """The launcher's one line after a signal stopped the job, and the exit code."""
    second = isinstance(exc.__context__, SignalException)
    if exc.sigval == signal.SIGINT:
        if second:
            print(
                "interrupted again: stopped the workers without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_INTERRUPTED
    if exc.sigval not in PREEMPT_SIGNALS or second:
        raise LaunchError(
            f"stopped by {exc.sigval.name}; the workers were told to stop too"
        ) from None
    print(
        f"preempted by {exc.sigval.name}: the workers checkpointed at their next step boundary "
        "and exited",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _shutdown_timeout(cfg: TrainConfig) -> dict:
    """How long the agent waits for workers it stops (a preemption: their checkpoint);
    ``LaunchConfig.shutdown_timeout`` exists in recent torch only (else 30 s)."""
    if "shutdown_timeout" not in getattr(LaunchConfig, "__dataclass_fields__", {}):
        return {}
    return {"shutdown_timeout": math.ceil(cfg.fault.preempt_deadline) + 5}
