"""What a training job prints: the step line and one human line per event.

The JSON records stay in ``metrics.jsonl`` (:mod:`shardsmith.trainer.observe.metrics`); the console
gets what a person reads while the job runs::

    step 41/60  loss 5.1234  lr 2.95e-04  grad 1.234  12,345 tok/s  310 ms/step  1.3M tok  mem 1.2 GB  ETA 6s
    saved step 40 → runs/b/step-000000040 (0.6 GB, 0.3 s blocked)
    resumed step 40 from runs/a/step-000000040 (layout pp2·tp2 → dps2)

Everything here is pure (no torch, no I/O), except :func:`peak_memory_nbytes` and
:func:`known_peak_flops`, which ask the process and the device.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys
from collections import deque
from typing import Any, Sequence

from shardsmith.layout import MESH_AXIS_TABLE, format_nbytes

#: Dense bf16 peak FLOP/s of one device by name fragment (vendor data sheets), for MFU
#: when ``--peak-flops`` is not given.
KNOWN_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("L4", 121e12),
    ("V100", 125e12),
)


def peak_memory_nbytes() -> int:
    """Peak memory of this process: CUDA max allocated when on a GPU, else the peak RSS."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def known_peak_flops() -> float:
    """Peak FLOP/s of this process's GPU when its name is in :data:`KNOWN_PEAK_FLOPS`, else 0."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in KNOWN_PEAK_FLOPS if key in name), 0.0)


class EtaClock:
    """Estimates the time left from the median of the last ``window`` step durations."""

    def __init__(self, window: int = 20) -> None:
        self._recent: deque[float] = deque(maxlen=window)

    def eta_s(self, duration_s: float, steps_left: int) -> float:
        """Record one step's duration; seconds until ``steps_left`` more steps are done."""
        self._recent.append(duration_s)
        ordered = sorted(self._recent)
        return ordered[len(ordered) // 2] * max(steps_left, 0)


def step_line(record: dict[str, Any]) -> str:
    """The console line of a step record: step/total, loss, LR, gradient norm, tokens/s,
    ms/step, tokens seen, peak memory, MFU, the MoE router's load imbalance (max/mean routed
    tokens per expert, the worst layer) and aux loss, the slowest rank when one stands out
    (:mod:`shardsmith.trainer.detect.straggler`), a replay check's outcome
    (``--check-replay-every``), and ETA (each when the record has it)."""

    def num(x: Any, fmt: str) -> str:
        return "nan" if x is None else format(x, fmt)

    total = record.get("steps")
    where = f"{record['step']:>{len(str(total))}}/{total}" if total else f"{record['step']:>6}"
    parts = [
        f"step {where}",
        f"loss {num(record['loss'], '.4f')}",
        f"lr {record['lr']:.2e}",
        f"grad {num(record['grad_norm'], '.3f')}",
        f"{record['tokens_per_s']:,.0f} tok/s",
        f"{record['seconds'] * 1000:,.0f} ms/step",
    ]
    if "tokens_seen" in record:
        parts.append(f"{count(record['tokens_seen'])} tok")
    if "peak_mem_nbytes" in record:
        parts.append(f"mem {format_nbytes(record['peak_mem_nbytes'])}")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if record.get("moe_load_imbalance"):
        parts.append(
            f"experts max/mean {max(record['moe_load_imbalance']):.2f}  aux {record['moe_aux_loss']:.3f}"
        )
    if "slowest_rank" in record:
        parts.append(
            f"slowest rank {record['slowest_rank']} ({record['slowest_compute_ratio']:.1f}x median compute)"
        )
    if "replay" in record:
        parts.append(f"replay {record['replay']}")
    if "eta_s" in record:
        parts.append(f"ETA {duration(record['eta_s'])}")
    return "  ".join(parts) + ("  SKIPPED (non-finite)" if record["skipped"] else "")


def count(n: float) -> str:
    """``950``, ``12.3k``, ``1.3M``, ``4.1B``."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h20m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def layout_name(layout: dict[str, Any] | None) -> str:
    """A layout record in short form: only the axes above 1 (``tp2·pp2``, ``dps2``; ``1 rank``),
    then virtual stages and expert parallelism when above 1 (``pp2·dps2·ep2``)."""
    if not layout:
        return "?"
    parts = [
        f"{a.short}{layout[a.name]}" for a in MESH_AXIS_TABLE if int(layout.get(a.name, 1)) > 1
    ]
    parts += [
        f"{short}{layout[key]}"
        for key, short in (("virtual_stages", "v"), ("expert_parallel", "ep"))
        if int(layout.get(key, 1)) > 1
    ]
    return "·".join(parts) or "1 rank"


def short_url(url: str) -> str:
    """A local URL relative to the working directory when under it; others as given."""
    path = url[len("file://") :] if url.startswith("file://") else url
    if "://" in path or not os.path.isabs(path):
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def user_spelling(text: str, argv: Sequence[str]) -> str:
    """``text`` with the absolute paths the code made of relative path arguments (``r`` ->
    ``/home/me/r``, ``file:///home/me/r``) written back as the user typed them, including
    paths inside them (``r/step-000000004``). Pure apart from the working directory."""
    spelled: dict[str, str] = {}
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        if not value or value.startswith("-") or "://" in value or os.path.isabs(value):
            continue
        absolute = os.path.normpath(os.path.abspath(value))
        if absolute != os.sep:
            spelled.setdefault(absolute, os.path.normpath(value))
    for absolute in sorted(spelled, key=len, reverse=True):
        for form in ("file://" + absolute, absolute):
            text = text.replace(form + os.sep, spelled[absolute] + os.sep).replace(
                form, spelled[absolute]
            )
    return text


def console_paths(text: str, argv: Sequence[str] = ()) -> str:
    """``text`` as the console shows it: the paths made of the user's arguments ``argv`` as
    typed (:func:`user_spelling`: ``../runs/a`` stays ``../runs/a``), then every other
    absolute path under the working directory relative to it (``/home/me/ckpt/step-4`` ->
    ``ckpt/step-4``, ``file://`` URLs too); paths elsewhere and remote URLs as they are.
    For console lines only: records (``metrics.jsonl``) keep their paths whole. Pure apart
    from the working directory."""
    text = user_spelling(text, argv)
    cwd = os.getcwd()
    if cwd == os.sep:
        return text
    # at a path's start only: /data/home/me/x is not under /home/me
    under = re.compile(r"(?<![\w.~/-])(?:file://)?" + re.escape(cwd + os.sep))
    return under.sub("", text)


class PathsFormatter(logging.Formatter):
    """A log formatter for the console that writes paths as :func:`console_paths` does."""

    def __init__(self, fmt: str = "%(message)s", argv: Sequence[str] = ()) -> None:
        super().__init__(fmt)
        self.argv = list(argv)

    def format(self, record: logging.LogRecord) -> str:
        return console_paths(super().format(record), self.argv)


def event_line(record: dict[str, Any]) -> str:
    """One human line for an event record, or ``""`` for events the console leaves out
    (``start``, whose restarts the launcher reports; ``preempt``, which rank 0 reports
    itself)."""
    kind = record.get("event")
    describe = _EVENT_LINES.get(str(kind))
    if describe is None:
        return f"{kind}: " + ", ".join(
            f"{k} {v}" for k, v in record.items() if k not in ("time", "event")
        )
    return describe(record)


def _resume(r: dict[str, Any]) -> str:
    if r.get("reason") == "rollback":
        return f"rolled back to step {r['step']} from {short_url(r.get('from', '?'))}"
    saved, now = layout_name(r.get("saved_layout")), layout_name(r.get("layout"))
    layout = f"layout {saved} → {now}" if r.get("resharded") else f"layout {now}"
    shared = r.get("replicas_sharing_reads", 1)
    once = f", tensors of 1 MiB or more read by 1 of {shared} replicas" if shared > 1 else ""
    once += ", chunks the TP group shares read once" if r.get("tp_siblings_share_reads") else ""
    return (
        f"resumed step {r['step']} from {short_url(r.get('from', '?'))} ({layout}; "
        f"{format_nbytes(r.get('nbytes_read', 0))} read by all ranks{once} in {r.get('seconds', 0):.1f} s)"
    )


def _peer_reshard(r: dict[str, Any]) -> str:
    saved, now = layout_name(r.get("saved_layout")), layout_name(r.get("layout"))
    return (
        f"shrink: step {r['step']} resharded {saved} → {now} from the survivors' tiers; "
        f"{format_nbytes(r.get('nbytes_received', 0))} received over the process group by "
        f"{r.get('ranks_receiving', 0)} rank(s), none from the persistent store ({r.get('seconds', 0):.2f} s)"
        + (
            f"; {r['leavers_serving']} survivor(s) outside the new layout served "
            f"{format_nbytes(r.get('nbytes_from_leavers', 0))}, then left"
            if r.get("leavers_serving")
            else ""
        )
    )


def _save(r: dict[str, Any]) -> str:
    where = f" → {short_url(r['url'])}" if r.get("url") else ""
    return (
        f"saved step {r['step']}{where} ({format_nbytes(r.get('nbytes', 0))}, "
        f"{r.get('blocked_seconds', 0):.1f} s blocked)"
    )


_EVENT_LINES = {
    # a restart is said once, by the launcher (trainer/runtime/agent.py, supervisor.py)
    "start": lambda r: "",
    "resume": _resume,
    "peer_reshard": _peer_reshard,
    "save": _save,
    "preempt": lambda r: "",
    "warning": lambda r: "",  # logged once where it was raised
    "save_failed": lambda r: "",  # logged once, with its cause, where it was seen (rank 0)
    "timeline": lambda r: "",  # logged once where the steps were marked
    "schedule_change": lambda r: f"warning: {r.get('message', 'the LR schedule changed')}",
    "gc": lambda r: "\n".join(  # one line per step (records before "deleted": steps only)
        [f"deleted {short_url(d['url'])} ({d['reason']})" for d in r.get("deleted", [])]
        or [f"deleted step {s}" for s in r.get("deleted_steps", [])]
    ),
    "init_from": lambda r: (
        f"initialized the weights from {short_url(r.get('from', '?'))} "
        f"(step {r.get('source_step')}, layout {layout_name(r.get('saved_layout'))}"
        + (f"; {'/'.join(r['upcast_from'])} upcast to F32, exact" if r.get("upcast_from") else "")
        + ")"
    ),
    "corrupt_step": lambda r: (
        ""
        if r.get("fallback_step") is None  # no fallback: the job's error says it
        else f"warning: step {r['step']} ({short_url(r.get('url', '?'))}) is corrupt: "
        f"{r.get('error')}; loading step {r['fallback_step']}, the newest older committed "
        "step of its run (the corrupt one is marked: `shardsmith ls` shows it)"
    ),
    "data_change": lambda r: (
        f"data change at step {r['step']} (--data-change {r['how']}): {r['from']} -> {r['to']}; "
        f"the new data starts at global sample {r['sample_index']}"
    ),
    "batch_change": lambda r: (
        f"global batch size changes at step {r['step']}: {r['from']} -> {r['to']} samples; "
        f"the data continues at global sample {r['sample_index']}"
    ),
    "bad_step": lambda r: (
        f"step {r['step']}: non-finite loss {r.get('loss')} or grad norm "
        f"{r.get('grad_norm')}; update skipped ({r.get('consecutive')} in a row)"
    ),
    "recovery": lambda r: (
        f"recovered step {r['step']} from {r.get('source')}"  # benches parse this
        + (f" ({r['detail']})" if r.get("detail") else "")
    ),
    "rollback": lambda r: (
        f"rolled back from step {r['from_step']} to {r['to_step']}, skipping "
        f"{r.get('skip_samples')} samples"
    ),
    "data_skip": lambda r: (
        f"skipping samples {r['from_sample']}..{r['to_sample']} (marked bad by a rollback)"
    ),
    "straggler": lambda r: (
        f"straggler: rank(s) {r['ranks']} computed {r['factor']}x the median "
        f"({r['median_compute_s'] * 1000:,.0f} ms) or more for {r['windows']} windows in a row "
        f"(step {r['step']})"
    ),
    "sdc": lambda r: (
        f"silent data corruption? step {r['step']} replayed gave other gradients on rank(s) "
        f"{r['ranks']} (first: rank {r['rank']}, {r['tensor']}); --on-sdc {r['policy']}"
    ),
    "nonfinite": lambda r: (
        f"step {r['step']}: first non-finite value on rank {r['rank']} in {r['tensor']} "
        f"(ranks {r['ranks']})"
    ),
    "goodput": lambda r: "",  # the final line says it
    "hang_suspected": lambda r: (
        f"step {r['step']} has run {r['seconds']:.0f} s (> {r['threshold']:.0f} s): "
        "stacks dumped under hang-stacks/"
    ),
}
