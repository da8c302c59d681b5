"""Ctrl-C a ``shardsmith train`` launch at a chosen moment and report what outlived it.

``python interrupt_probe.py MOMENT TIMEOUT_S CMD...`` runs CMD (the launcher) as a child of
this process, made a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so a worker the
launcher leaves behind becomes this process's child instead of init's and can be counted.
MOMENT is when SIGINT goes to the launcher:

* ``first_line``: as soon as it prints its first line (``training ... on N processes``);
* ``first_worker``: as soon as its first worker process exists (it may still be spawning
  the others);
* ``all_workers``: as soon as every worker exists (``--nproc-per-node``), or
  ``all_workers+S``: S seconds later (the workers import torch, rendezvous, build).

Prints one JSON object: ``returncode`` (None when the launcher outlived TIMEOUT_S seconds
after the signal; it is then killed), ``seconds`` (signal to exit), ``workers`` (the worker
PIDs seen), ``survivors`` (processes the launcher left behind when it exited: running, or
dead and never reaped by it; each ``[pid, "STATE COMMAND"]``; they are then killed) and ``output`` (the launcher's stdout and stderr).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``)."""
    pids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def command(pid: int) -> str:
    """``STATE COMMAND`` of ``pid`` (state ``Z``: dead, never reaped by the launcher)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return state + " " + f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def main(argv: list[str]) -> int:
    moment, timeout_s, cmd = argv[0], float(argv[1]), argv[2:]
    nproc = int(cmd[cmd.index("--nproc-per-node") + 1])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    first_line = threading.Event()

    def read() -> None:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            first_line.set()
        first_line.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    name, _, delay = moment.partition("+")
    workers: set[int] = set()
    while launcher.poll() is None:
        workers.update(children(launcher.pid))
        if (
            (name == "first_line" and first_line.is_set())
            or (name == "first_worker" and workers)
            or (name == "all_workers" and len(workers) >= nproc)
        ):
            break
    time.sleep(float(delay or 0))
    workers.update(children(launcher.pid))
    launcher.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        returncode: int | None = launcher.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    seconds = time.monotonic() - t0
    survivors = [[pid, command(pid)] for pid in children(os.getpid()) if pid != launcher.pid]
    for pid in [pid for pid, _ in survivors] + ([launcher.pid] if returncode is None else []):
        os.kill(pid, signal.SIGKILL)
    for pid, _ in survivors:
        os.waitpid(pid, 0)
    launcher.wait()
    reader.join(timeout=10)
    report = {
        "returncode": returncode,
        "seconds": round(seconds, 2),
        "workers": sorted(workers),
        "survivors": survivors,
        "output": "".join(lines),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
