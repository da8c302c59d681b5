"""Worker process body: ``python -m shardsmith.trainer.runtime.worker CONFIG.json`` (started by torchrun).

Errors are reported as one line prefixed by the rank (once per job under the launcher, see
:func:`report_error`), and the process exits 1; a Ctrl-C before the loop ends the process
at once (:func:`die_on_interrupt`). A run that
returns early after a preemption checkpoint exits 0. Fatal signals (SIGSEGV, SIGABRT...)
print every thread's Python stack (:mod:`faulthandler`); ``kill -USR2 PID`` prints them
on demand.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import warnings
from typing import NoReturn

from shardsmith.trainer.checkpoint.resume import COMMAND_ENV
from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.observe.console import PathsFormatter, console_paths

#: Set by :func:`shardsmith.trainer.runtime.launch.launch` (kept in sync there).
ERROR_FILE_ENV = "SHARDSMITH_ERROR_FILE"


def setup_process() -> None:
    """Logging, warnings and stack dumps of a worker process (rank 0 logs INFO, others WARNING)."""
    # Known-noisy upstream warnings (FSDP2 hook registration, torchrun's OMP notice).
    warnings.filterwarnings("ignore", message=".*_register_pre_backward_hook.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    logging.getLogger().setLevel(level)  # also when the CLI configured logging first
    for handler in logging.getLogger().handlers:  # paths under the working directory, relative
        handler.setFormatter(PathsFormatter(argv=user_argv()))
    if not os.environ.get("SHARDSMITH_DEBUG"):  # third-party log lines only with --debug
        for name in ("torch", "botocore", "s3fs", "fsspec", "urllib3", "aiobotocore"):
            logging.getLogger(name).setLevel(logging.ERROR)
    faulthandler.enable()  # stacks on SIGSEGV/SIGABRT/...
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 PID` dumps stacks


def main(argv: list[str]) -> int:
    setup_process()
    with open(argv[0]) as f:
        cfg = TrainConfig.from_json(json.load(f))
    try:
        from shardsmith.trainer.train import (
            run_training,  # imports torch: seconds a Ctrl-C may land in
        )

        run_training(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the loop's handlers
        if os.environ.get("RANK", "0") == "0":
            print("interrupted before the first step: nothing saved", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        if os.environ.get("SHARDSMITH_DEBUG"):
            raise
        report_error(f"rank {os.environ.get('RANK', '?')}: {type(exc).__name__}: {exc}")
        return 1
    return 0


def report_error(line: str) -> None:
    """Print ``line`` once for the whole job: under the launcher, the first failing rank
    writes it to the launcher's error file (the others' echoes of the failure are dropped)
    and the launcher prints it; elsewhere (external torchrun) each rank prints its own.
    Paths in it are written as the console writes them (:func:`console_paths`: relative
    under the working directory, as typed when the user typed them)."""
    line = console_paths(line, user_argv())
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        print(f"error: {line}", file=sys.stderr, flush=True)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")


def user_argv() -> list[str]:
    """The arguments of the ``shardsmith`` command that launched this worker (the launcher
    exports them as ``SHARDSMITH_COMMAND``), for writing paths as the user typed them."""
    try:
        command = json.loads(os.environ.get(COMMAND_ENV, "[]"))
    except ValueError:
        return []
    return [str(a) for a in command[1:]] if isinstance(command, list) else []


def exit_process(code: int) -> NoReturn:
    """End a worker with ``code`` once its work is done and written: stdio and logging
    flushed, then ``os._exit``, without the interpreter's teardown. Collecting process
    groups, device meshes and DTensors at shutdown runs C++ destructors in no fixed order;
    under load one of them can abort a finished worker (``terminate called without an
    active exception``, exit -6; seen in tests/e2e/test_multinode.py), so torchrun would
    report a job that had committed its last step as failed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing to keep
            pass
    logging.shutdown()
    try:  # what native code printf'ed (libc's buffers)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


def die_on_interrupt() -> None:
    """Leave SIGINT at the system's default (the process ends at once) until the trainer
    installs its preemption handler at the start of its loop. Python's own handler only
    raises ``KeyboardInterrupt`` when the main thread next runs Python code, which a worker
    blocked in a rendezvous or a collective with a peer already gone did not do for minutes
    (the launcher waited out its whole shutdown timeout). Before the loop nothing is
    trained, so nothing is lost; the launcher says so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    die_on_interrupt()
    exit_process(main(sys.argv[1:]))
