"""Paired-round statistics shared by the benches: ratios that survive a noisy, shared machine.

Every bench runs its rivals alternately inside each round (A B A B ...), so the two figures of
one round saw the same machine load. A ratio is then the median of the per-round ratios, shown
with its spread: the interquartile range (``statistics.quantiles(..., method="inclusive")``,
so with 2-3 rounds it lies inside min-max) and min-max, together with the machine's load average
(``os.getloadavg``) at the time. A goal is judged on the spread, not on the median alone:

* ``met`` / ``missed``: the whole IQR is on one side of the goal;
* ``within noise``: the IQR straddles the goal; such a ratio goes into the ``within_noise``
  dict of the bench's JSON line, with its spread, instead of being called met or missed.

No dependency beyond the standard library, so the peers' interpreters can import it too.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages, rounded to 0.1."""
    return [round(x, 1) for x in os.getloadavg()]


def paired(num: Iterable[float], den: Iterable[float]) -> dict[str, Any]:
    """``num[i] / den[i]`` per round (both lists in round order, measured alternately): the median,
    the IQR (``q1``, ``q3``), ``min``/``max``, and the per-round values. Rounds where either side
    is missing (None) or ``den`` is 0 are dropped. Raises ValueError when none is left."""
    ratios = [a / b for a, b in zip(num, den) if a is not None and b]
    if not ratios:
        raise ValueError("no round has both figures: nothing to compare")
    return spread(ratios)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, IQR (inclusive quartiles; for one value q1 = q3 = it), min, max, rounds."""
    q1, q3 = (
        (statistics.quantiles(values, n=4, method="inclusive")[i] for i in (0, 2))
        if len(values) > 1
        else (values[0], values[0])
    )
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "rounds": [round(v, 4) for v in values],
    }


def verdict(stat: dict[str, Any], op: str, goal: float) -> str:
    """``met``, ``missed`` or ``within noise`` for ``median op goal`` (``op`` ``>=`` or ``<=``),
    judged on the IQR of :func:`paired`."""
    lo, hi = stat["q1"], stat["q3"]
    if lo <= goal <= hi and lo != hi:
        return "within noise"
    good = (lo >= goal) if op == ">=" else (hi <= goal)
    return "met" if good else "missed"


def judge(
    goals: dict[str, tuple[dict[str, Any] | None, str | None, float | None]],
) -> tuple[list[str], dict[str, Any]]:
    """Table lines (``key  median [q1-q3] min-max  goal  verdict``) and the ``within_noise`` dict
    (key -> {median, q1, q3, min, max, goal, load}) for ``{key: (paired stat or None, op, goal)}``.
    An ``op`` of None shows the ratio and its spread without a goal or verdict."""
    load = load_average()
    lines, noise = [], {}
    for key, (stat, op, goal) in goals.items():
        if stat is None:
            lines.append(f"{key:36s}{'n/a':>8s}   (not measured)")
            continue
        line = (
            f"{key:36s}{stat['median']:8.3f}  IQR {stat['q1']:.3f}-{stat['q3']:.3f}  "
            f"min-max {stat['min']:.3f}-{stat['max']:.3f}"
        )
        if op is None or goal is None:
            lines.append(line)
            continue
        v = verdict(stat, op, goal)
        lines.append(f"{line}  goal {op} {goal:g}: {v}")
        if v == "within noise":
            noise[key] = {
                **{k: round(stat[k], 4) for k in ("median", "q1", "q3", "min", "max")},
                "goal": f"{op} {goal:g}",
                "load": load,
            }
    lines.append(
        f"load average {load[0]} / {load[1]} / {load[2]} (1/5/15 min), {os.cpu_count()} CPUs"
    )
    return lines, noise


def rotated(names: Sequence[T], round_index: int) -> list[T]:
    """``names`` rotated left by ``round_index`` (A B C, then B C A, then C A B, ...): each round
    of :func:`alternate` starts with the next rival, so none always runs first (cold caches) or
    always right after the same neighbour (its leftover page cache, heap or background work)."""
    k = round_index % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def alternate(
    rivals: dict[str, Callable[[int], T]],
    rounds: int,
    warmup: int = 0,
    log: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """Run every rival once per round, in :func:`rotated` order, ``warmup + rounds`` rounds; each
    rival is called with the round index (0-based, warm-up rounds included) and its result kept
    for the last ``rounds`` rounds. Returns name -> results in round order, the lists
    :func:`paired` compares. ``log(round, name, result)`` is called after every run (warm-up too).
    Raises ValueError when ``rounds`` < 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}: pass --rounds 1 or more")
    out: dict[str, list[T]] = {name: [] for name in rivals}
    for r in range(warmup + rounds):
        for name in rotated(list(rivals), r):
            result = rivals[name](r)
            if log is not None:
                log(r, name, result)
            if r >= warmup:
                out[name].append(result)
    return out


def report(
    title: str, goals: dict[str, tuple[dict[str, Any] | None, str | None, float | None]]
) -> dict[str, Any]:
    """Print ``title`` and the :func:`judge` lines of ``goals``; return what every bench's JSON
    line carries: ``spread`` (key -> the paired stat, measured keys only), ``within_noise`` and
    ``load_average``. The keys' own values (the medians) are the bench's to place
    (:func:`medians`)."""
    lines, noise = judge(goals)
    print(title + "\n" + "\n".join(lines))
    return {
        "spread": {k: stat for k, (stat, _, _) in goals.items() if stat is not None},
        "within_noise": noise,
        "load_average": load_average(),
    }


def medians(stats: dict[str, dict[str, Any] | None], digits: int = 4) -> dict[str, float | None]:
    """key -> the median of its paired stat, rounded to ``digits``; None where not measured."""
    return {k: None if v is None else round(v["median"], digits) for k, v in stats.items()}
