"""``shardsmith plot``: a run's curves as one PNG (loss, LR, gradient norm, tokens/s), from
the ``metrics.jsonl`` of one or more run directories (the main job writes two: before and
after the move), drawn as one curve with restarts, reshards and rollbacks marked.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from shardsmith.trainer.observe.metrics import METRICS_FILE, iter_json_lines

#: Panels: (record field, axis label).
PANELS = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
)
_STYLES = {
    "restarts": ("C1", "--", "restart"),
    "reshards": ("C2", ":", "reshard"),
    "rollbacks": ("C3", "-.", "rollback"),
}


def loss_segments(
    records: list[dict[str, Any]], key: str = "loss"
) -> list[list[tuple[int, float]]]:
    """A curve in pieces: one piece as long as the steps go forward (across restarts,
    relaunches and reshards that continue from where the last piece ended); a new piece
    wherever the steps go back (a rollback, or steps lost since the last checkpoint). Each
    piece is ``[(step, value), ...]`` of the step records' ``key``; skipped steps (non-finite
    loss) and missing values are left out."""
    segments: list[list[tuple[int, float]]] = []
    last = None
    for r in records:
        value = r.get(key)
        if "event" in r or not isinstance(value, (int, float)) or r.get("skipped"):
            continue
        if last is None or r["step"] <= last:
            segments.append([])
        segments[-1].append((int(r["step"]), float(value)))
        last = r["step"]
    return segments


#: Why a stretch of steps was run again (the event seen between it and the steps that
#: replaced it; the first that applies), for the legend.
_LEFT_BECAUSE = (
    ("timeline", "abandoned timeline"),  # a resume of an older step in the same root
    ("rollback", "rolled back"),  # bad steps rolled back to a checkpoint
)
_RESTARTED = "run again after a restart"  # steps since the last checkpoint, lost to a failure


@dataclass
class LeftBehind:
    """Steps the current timeline does not hold: run once, then run again from an older step.

    Attributes:
        label: the legend's words, e.g. ``abandoned timeline (steps 21-40)``.
        points: ``[(step, value), ...]``, from the step they branched off (when drawn).
    """

    label: str
    points: list[tuple[int, float]]


def timelines(
    records: list[dict[str, Any]], key: str = "loss"
) -> tuple[list[tuple[int, float]], list[LeftBehind]]:
    """The curve of :func:`loss_segments` split into the run's current timeline (the newest
    value of every step it holds) and the stretches it left behind, each named by why it
    was run again: a resume of an older step (``timeline`` event), a rollback, or else a
    restart from the last checkpoint.

    Returns:
        ``(current, left_behind)``: the current timeline's ``[(step, value), ...]`` and the
        stretches, oldest first.
    """
    pieces: list[tuple[str, list[tuple[int, float]]]] = []
    events: set[str] = set()
    last = None
    for r in records:
        value = r.get(key)
        if "event" in r:
            events.add(str(r["event"]))
            continue
        if not isinstance(value, (int, float)) or r.get("skipped"):
            continue
        if last is None or r["step"] <= last:
            why = next((w for kind, w in _LEFT_BECAUSE if kind in events), _RESTARTED)
            pieces.append((why, []))
        events.clear()
        pieces[-1][1].append((int(r["step"]), float(value)))
        last = r["step"]
    if not pieces:
        return [], []
    current, left = list(pieces[-1][1]), []
    for (_, points), (why, _) in zip(reversed(pieces[:-1]), reversed(pieces[1:])):
        start = current[0][0] if current else math.inf
        kept = [p for p in points if p[0] < start]
        gone = [p for p in points if p[0] >= start]
        if gone:
            steps = f"step {gone[0][0]}" if len(gone) == 1 else f"steps {gone[0][0]}-{gone[-1][0]}"
            left.append(LeftBehind(f"{why} ({steps})", kept[-1:] + gone))
        current = kept + current
    return current, left[::-1]


def run_markers(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Steps to mark on the plot: ``restarts`` (a process group resumed from a checkpoint:
    elastic restart or relaunch), ``reshards`` (that resume changed the layout) and
    ``rollbacks`` (bad steps rolled back to a checkpoint), each at the step resumed from."""
    out: dict[str, list[int]] = {"restarts": [], "reshards": [], "rollbacks": []}
    for r in records:
        kind = r.get("event")
        if kind == "resume" and r.get("reason", "resume") != "rollback":
            out["restarts"].append(int(r["step"]))
            if r.get("resharded"):
                out["reshards"].append(int(r["step"]))
        elif kind == "rollback":
            out["rollbacks"].append(int(r["to_step"]))
    return out


def read_runs(run_dirs: list[str]) -> list[dict[str, Any]]:
    """The records of every run directory's ``metrics.jsonl``, in the order given.

    Raises:
        FileNotFoundError: a directory has no metrics.jsonl.
        ValueError: no step with a finite loss in any of them.
    """
    records: list[dict[str, Any]] = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, METRICS_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} does not exist; pass the --run-dir (or local --ckpt) of a training run"
            )
        records += iter_json_lines(path)
    if not loss_segments(records):
        raise ValueError(f"{', '.join(run_dirs)}: no step with a finite loss to plot")
    return records


def goodput_caption(records: list[dict[str, Any]]) -> str:
    """The last job's goodput line (:func:`shardsmith.trainer.detect.goodput.goodput_line`):
    the ``goodput`` event it wrote at its end, else computed from its records."""
    from shardsmith.trainer.detect.goodput import breakdown, current_job, goodput_line

    job = [r for r in current_job(records) if isinstance(r.get("time"), (int, float))]
    final = [r for r in job if r.get("event") == "goodput"]
    return goodput_line(final[-1] if final else breakdown(job)) if job else ""


def runs_caption(run_dirs: list[str]) -> str:
    """The goodput line of each run directory's last job (:func:`goodput_caption`), one line
    each, named by its directory when there are several (each job accounts its own time)."""
    lines = []
    for run_dir in run_dirs:
        caption = goodput_caption(list(iter_json_lines(os.path.join(run_dir, METRICS_FILE))))
        name = os.path.basename(os.path.abspath(run_dir))
        if caption:
            lines.append(caption if len(run_dirs) == 1 else f"{name}: {caption}")
    return "\n".join(lines)


def plot_runs(run_dirs: list[str], out_path: str = "") -> str:
    """Draw the runs' loss, LR, gradient norm and tokens/s as one PNG (one curve across the
    runs; steps run again after a resume of an older step, a rollback or a restart drawn and
    named apart: :func:`draw_runs`), resumes marked by vertical lines: a reshard (the layout
    changed), a restart (same layout) or a rollback; each run's last job's goodput and where the rest of its time went
    below (:func:`runs_caption`). The file is written atomically (temporary file, then rename).

    Args:
        run_dirs: run directories holding ``metrics.jsonl``, oldest first.
        out_path: where to write (default ``<last run_dir>/loss.png``).

    Returns:
        The path written.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_runs`.
        ImportError: matplotlib is missing (``pip install -e ".[plot]"`` in a clone).
    """
    fig = draw_runs(run_dirs)
    plt = _pyplot()
    out_path = out_path or os.path.join(run_dirs[-1], "loss.png")
    fd, tmp = tempfile.mkstemp(
        prefix=".plot-", suffix=".png", dir=os.path.dirname(os.path.abspath(out_path))
    )
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 -> what any other output gets
        os.replace(tmp, out_path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def draw_runs(run_dirs: list[str]) -> Any:
    """The figure :func:`plot_runs` writes (a matplotlib ``Figure``; the caller closes it):
    four panels, the current timeline solid and each stretch left behind (:func:`timelines`)
    in its own colour, named in the first panel's legend with its steps.

    Raises:
        As :func:`plot_runs`.
    """
    records = read_runs(run_dirs)
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    markers = run_markers(records)
    markers["restarts"] = [s for s in markers["restarts"] if s not in markers["reshards"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        _draw_panel(ax, timelines(records, key), label, markers)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.suptitle(" + ".join(os.path.basename(os.path.abspath(d)) for d in run_dirs))
    caption = runs_caption(run_dirs)
    fig.tight_layout(rect=(0, 0.04 * max(1, caption.count("\n") + 1), 1, 1))
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=9)
    return fig


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "shardsmith plot needs matplotlib, which `pip install -e .` does not install: "
            'pip install -e ".[plot]" in a clone (else: pip install "shardsmith[plot]")'
        ) from exc
    return plt


#: Colours of the stretches left behind, in turn (the current timeline is C0).
_LEFT_COLORS = ("C7", "C4", "C5", "C8", "C9")


def _draw_panel(
    ax: Any,
    curve: tuple[list[tuple[int, float]], list[LeftBehind]],
    label: str,
    markers: dict[str, list[int]],
) -> None:
    current, left = curve
    for i, piece in enumerate(left):
        ax.plot(
            [s for s, _ in piece.points],
            [v for _, v in piece.points],
            color=_LEFT_COLORS[i % len(_LEFT_COLORS)],
            lw=1.0,
            alpha=0.8,
            label=piece.label,
        )
    ax.plot(
        [s for s, _ in current],
        [v for _, v in current],
        color="C0",
        lw=1.2,
        label=f"{label} (current timeline)" if left else label,
    )
    for kind, steps in markers.items():
        color, ls, name = _STYLES[kind]
        for j, step in enumerate(steps):
            ax.axvline(step, color=color, ls=ls, lw=1.2, label=name if j == 0 else None)
    ax.set_ylabel(label)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
