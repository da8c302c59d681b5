"""Goodput: where a job's wall time went, from its ``metrics.jsonl`` (pure, no torch).

The wall time runs from the launch (``start`` event's ``launch_time``: when ``shardsmith
train`` started, else this process) to the last record, and is cut into intervals that
tile it, each given to one category:

* ``startup``: launch to the first step's start (imports, process groups, model build,
  the first resume).
* ``productive``: from the previous step's record to this step's record (the step and the
  boundary after the one before it), for every step that counted: its step number is never
  run again later in the job and its update was applied.
* ``lost``: the same intervals of steps that did not count: recomputed after a restart or a
  rollback (work lost), or skipped as non-finite.
* ``checkpoint``: the blocking part of each save (``save`` event's ``blocked_seconds``),
  taken out of the interval it fell in: the one after the saved step's record; a failed
  save's too (``save_failed``: its blocking part was spent all the same), and the breakdown
  counts them (``failed_saves``).
* ``recovery``: from the last record of a failed attempt to the first step of the next
  (the failure, its detection, the restart, the resume; a step killed midway is in here),
  plus a rollback's reload (``resume`` with ``reason: rollback``).
* ``other``: what is after the last step and not a save (shutdown, the final events).

Because the intervals tile the wall time, the fractions sum to 1 up to rounding. "Goodput"
is the ``productive`` fraction (as Llama 3's "effective training time", Dubey et al. 2024,
section 3.3.4). Costs nothing per step: rank 0 computes it once, at the end of the run.
The job is the records since the last ``start`` event with ``restart_count`` 0 (earlier
launches into the same run directory are other jobs).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

#: The categories, in the order they are reported.
CATEGORIES = ("productive", "lost", "checkpoint", "recovery", "startup", "other")
LAUNCH_ENV = "SHARDSMITH_LAUNCH_TIME"


def launch_time() -> float:
    """Unix time the job started: ``$SHARDSMITH_LAUNCH_TIME`` (set by ``shardsmith train``
    before it starts the workers), else this process's start time (Linux ``/proc``), else now."""
    value = os.environ.get(LAUNCH_ENV, "")
    if value:
        return float(value)
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _is_step(r: dict[str, Any]) -> bool:
    return "event" not in r and "step" in r and "seconds" in r


def current_job(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the last job: from its last first-attempt ``start`` event on."""
    firsts = [
        i for i, r in enumerate(records) if r.get("event") == "start" and not r.get("restart_count")
    ]
    return records[firsts[-1] :] if firsts else list(records)


def _attempts(job: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for r in job:
        if r.get("event") == "start" or not out:
            out.append([])
        out[-1].append(r)
    return out


def _step_intervals(
    attempt: list[dict[str, Any]], counted: set[int]
) -> tuple[float, list[list[Any]]]:
    """(first step's start, [[kind, seconds, record] per step]) of one attempt."""
    steps = [r for r in attempt if _is_step(r)]
    if not steps:
        return attempt[-1]["time"], []
    first = steps[0]["time"] - steps[0]["seconds"]
    boundary, out = first, []
    for r in steps:
        kind = "productive" if id(r) in counted and not r.get("skipped") else "lost"
        out.append([kind, max(r["time"] - boundary, 0.0), r])
        boundary = r["time"]
    return first, out


def _take_pauses(
    attempt: list[dict[str, Any]],
    intervals: list[list[Any]],
    tail: list[float],
    seconds: dict[str, float],
) -> None:
    """Move save blocking and rollback reloads out of the step interval they fell in."""
    position = {id(iv[2]): n for n, iv in enumerate(intervals)}
    last_of_step: dict[int, int] = {}
    after = 0  # the interval a synchronous event falls in: the next step's
    for r in attempt:
        if id(r) in position:
            last_of_step[r["step"]] = position[id(r)]
            after = position[id(r)] + 1
            continue
        if r.get("event") in ("save", "save_failed"):
            where, kind, amount = (
                last_of_step.get(r.get("step", -1), after - 1) + 1,
                "checkpoint",
                r.get("blocked_seconds", 0.0),
            )
        elif r.get("event") == "resume" and r.get("reason") == "rollback":
            where, kind, amount = after, "recovery", r.get("seconds", 0.0)
        else:
            continue
        if where < len(intervals):
            moved = min(float(amount), intervals[where][1])
            intervals[where][1] -= moved
        else:
            moved = min(float(amount), tail[0])
            tail[0] -= moved
        seconds[kind] += moved


def breakdown(
    records: Iterable[dict[str, Any]], *, end_time: float | None = None
) -> dict[str, Any]:
    """Where the wall time of the last job in ``records`` went.

    Args:
        records: ``metrics.jsonl`` records in file order (each has ``time``, Unix seconds).
        end_time: the end of the wall time (default: the last record's time).

    Returns:
        ``{"wall_s", "goodput", "<category>": fraction, "<category>_s": seconds (for each of
        CATEGORIES), "steps_counted", "steps_lost", "restarts", "failed_saves"}``; fractions
        sum to 1.

    Raises:
        ValueError: no records.
    """
    job = current_job(list(records))
    if not job:
        raise ValueError("goodput: no metrics records (is the run directory right?)")
    last = {r["step"]: id(r) for r in job if _is_step(r)}
    counted = set(last.values())
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    launch = float(job[0].get("launch_time", job[0]["time"]))
    end = max(end_time or 0.0, max(r["time"] for r in job))
    attempts, previous_end, lost_steps = _attempts(job), launch, 0
    for n, attempt in enumerate(attempts):
        first, intervals = _step_intervals(attempt, counted)
        seconds["startup" if n == 0 else "recovery"] += max(first - previous_end, 0.0)
        final = end if n == len(attempts) - 1 else attempt[-1]["time"]
        tail = [max(final - (intervals[-1][2]["time"] if intervals else first), 0.0)]
        _take_pauses(attempt, intervals, tail, seconds)
        for kind, length, _ in intervals:
            seconds[kind] += length
        lost_steps += sum(1 for kind, _, _ in intervals if kind == "lost")
        seconds["other"] += tail[0]
        previous_end = max(final, first)
    wall = max(end - launch, 1e-9)
    out: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "goodput": round(seconds["productive"] / wall, 4),
    }
    for kind in CATEGORIES:
        out[kind] = round(seconds[kind] / wall, 4)
        out[f"{kind}_s"] = round(seconds[kind], 3)
    out.update(steps_counted=len(counted), steps_lost=lost_steps, restarts=len(attempts) - 1)
    out["failed_saves"] = sum(1 for r in job if r.get("event") == "save_failed")
    return out


def goodput_line(g: dict[str, Any]) -> str:
    """``goodput 91.2% (lost 3.1%, checkpoint 1.0%, recovery 2.5%, startup 2.2%, other 0.0%) of 5m10s``."""
    parts = ", ".join(f"{kind} {g[kind]:.1%}" for kind in CATEGORIES[1:])
    failed = g.get("failed_saves", 0)
    saves = f"; {failed} failed save{'s' if failed != 1 else ''}" if failed else ""
    return f"goodput {g['goodput']:.1%} ({parts}) of {g['wall_s']:.1f} s{saves}"
