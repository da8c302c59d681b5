"""What a run reports: per-step metrics and events as JSON lines (and TensorBoard when
installed, Weights & Biases with ``--wandb``), model-FLOPs utilization, and the console's human lines (the step line and one
line per event; JSON stays in metrics.jsonl). The plot is :mod:`shardsmith.trainer.observe.plot`.

Records of ``<run_dir>/metrics.jsonl`` (written by rank 0, one ``write()`` per line so a
SIGKILL never leaves half a line):

* step records: ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", "seconds",
  "flops_per_s", "mfu"?, "skipped", "skipped_steps", "rollbacks", "restarts", "steps"?,
  "tokens_seen"?, "peak_mem_nbytes"?, "eta_s"?, "moe_load_imbalance"? (max/mean routed
  tokens per expert, one per MoE layer), "moe_aux_loss"?, and at a straggler window's end
  "compute_s_median", "compute_s_max", "wait_s_max", "slowest_rank"?, "slowest_compute_ratio"?,
  and on a ``--check-replay-every`` step "replay" ("match" or "mismatch")}``;
* events, with an ``"event"`` key: ``start`` (``restart_count``, ``world_size``, ``layout``),
  ``resume`` (``step``, ``saved_layout``, ``layout``, ``resharded``, ``reason``, ``seconds``,
  ``nbytes_read``, ``replicas_sharing_reads``, ``tp_siblings_share_reads``, ``rng``),
  ``save`` (``step``, ``nbytes``, ``seconds``, ``blocked_seconds``),
  ``bad_step``, ``rollback`` (``from_step``, ``to_step``, ``skip_samples``), ``data_skip``,
  ``preempt``, ``hang_suspected``; ``straggler``, ``sdc``, ``nonfinite`` and, at the end,
  ``goodput`` (:mod:`shardsmith.trainer.detect`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

from shardsmith.trainer.config import TrainConfig
from shardsmith.trainer.observe.console import event_line, step_line  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
#: Step-record fields also written to TensorBoard as scalars (``train/<name>``).
TB_SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "skipped_steps",
    "rollbacks",
    "restarts",
)
#: Event fields written to TensorBoard as ``checkpoint/<tag>`` scalars: (event, field, tag).
TB_EVENT_SCALARS = (
    ("save", "seconds", "save_seconds"),
    ("save", "blocked_seconds", "save_blocked_seconds"),
    ("save", "nbytes", "save_nbytes"),
    ("resume", "seconds", "load_seconds"),
    ("resume", "nbytes_read", "load_nbytes"),
)


def model_flops_utilization(
    tokens_per_s: float, flops_token: float, peak_flops: float, num_devices: int
) -> float | None:
    """MFU = achieved model FLOP/s / (peak FLOP/s per device * devices) (PaLM, section 4.1).

    Args:
        tokens_per_s: global training throughput, tokens per second.
        flops_token: :func:`flops_per_token`.
        peak_flops: peak FLOP/s of one device (``--peak-flops``); 0 = unknown.
        num_devices: devices of the job (the world size).

    Returns:
        A fraction in [0, 1] (more only if ``peak_flops`` is wrong), or None when
        ``peak_flops`` is 0.
    """
    if peak_flops <= 0:
        return None
    return tokens_per_s * flops_token / (peak_flops * num_devices)


class MetricsWriter:
    """Appends records to ``<run_dir>/metrics.jsonl`` and, when ``tensorboard`` is
    installed, to a TensorBoard event file under ``<run_dir>/tensorboard``; with ``wandb``,
    to a Weights & Biases run under ``<run_dir>/wandb`` (the same scalars; ``goodput/*``).

    Only rank 0 makes one (the others pass ``run_dir=""``, which writes nothing).
    Thread-safe: the watchdog and the background save report through it too. Nothing is
    created in the run directory before the first record (metrics.jsonl, the TensorBoard
    file, the wandb run): a job refused before it writes one (:meth:`EventLog.hold`) leaves
    the run directory as it was.

    Args:
        run_dir: directory of the run; empty = write nothing.
        tensorboard: also write TensorBoard scalars when the package is importable.
        wandb: also log to Weights & Biases (``pip install wandb``), offline unless
            ``WANDB_MODE`` says otherwise; ``config`` is the run's config there.

    Raises:
        ImportError: ``wandb`` asked for and not installed.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE) if run_dir else ""
        self._lock = threading.Lock()
        self._tb: Any = None
        self._wandb: Any = None
        self._tensorboard = tensorboard
        self._wandb_config = (config or {}) if wandb else None
        self._opened = False  # the writers are made at the first record
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
        if run_dir and wandb:
            _import_wandb()  # a missing package is said at the start, not at the first record

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON-safe dict) as one line; scalars of step records go to
        TensorBoard at ``global_step=record["step"]``."""
        if not self.path:
            return
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            if not self._opened:
                self._open()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write(): a kill never splits a line
            finally:
                os.close(fd)
            if self._tb is not None:
                self._write_tensorboard(record)
            if self._wandb is not None:
                self._wandb.log(_wandb_scalars(record))

    def _open(self) -> None:
        """Make the TensorBoard writer and the wandb run, at the first record (under the lock)."""
        self._opened = True
        if self._tensorboard:
            self._tb = _tensorboard_writer(os.path.join(self.run_dir, "tensorboard"))
        if self._wandb_config is not None:
            self._wandb = _wandb_run(self.run_dir, self._wandb_config)

    def _write_tensorboard(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        kind = record.get("event")
        if kind is None:
            for name in TB_SCALARS:
                if isinstance(record.get(name), (int, float)) and not isinstance(
                    record[name], bool
                ):
                    self._tb.add_scalar(f"train/{name}", record[name], step)
            return
        for event, name, tag in TB_EVENT_SCALARS:
            if kind == event and isinstance(record.get(name), (int, float)):
                self._tb.add_scalar(f"checkpoint/{tag}", record[name], step)
        self._tb.add_text("events", json.dumps(record), step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer (the JSONL file is never held open)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # finish() returns before the wandb-core service wrote the run out
            self._wandb = None


class EventLog:
    """The one channel every training component reports through (``log(record)``).

    Rank 0 stamps each record with ``time`` (Unix seconds), logs the ones with an
    ``"event"`` key and appends all to its :class:`MetricsWriter`; other ranks drop them.
    Between :meth:`hold` and :meth:`release` the records are kept back from the writer (their
    lines are logged at once): a job's start and resume reach metrics.jsonl only once the
    resume succeeded, so a refused one (a corrupt ``--resume`` step) leaves the file as it was.
    Thread-safe (the background save and the watchdog report through it).
    """

    def __init__(self, writer: MetricsWriter, *, rank: int) -> None:
        self.writer, self.rank = writer, rank
        self._held: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        record = {"time": round(time.time(), 3), **record}
        if "event" in record:
            line = event_line(record)
            if line:
                log.info("%s", line)
        with self._lock:
            if self._held is not None:
                self._held.append(record)
                return
        self.writer.write(record)

    def hold(self) -> None:
        """Keep the records back from the writer until :meth:`release` (:meth:`close` before
        it drops them)."""
        with self._lock:
            self._held = [] if self._held is None else self._held

    def release(self) -> None:
        """Write the records held back, in order, and write each later one at once."""
        with self._lock:
            held, self._held = self._held or [], None
            for record in held:  # under the lock: a concurrent record waits behind them
                self.writer.write(record)

    def close(self) -> None:
        """Close the writer; records still held back are dropped."""
        with self._lock:
            self._held = None
        self.writer.close()


def run_dir(cfg: TrainConfig) -> str:
    """Where metrics.jsonl and hang stack dumps go: ``cfg.run_dir``; else a local checkpoint
    root; else, for a checkpoint root on object storage (nothing can be appended there), the
    local directory :func:`object_store_run_dir` names; else nowhere (``""``: no ``--ckpt``)."""
    if cfg.run_dir:
        return cfg.run_dir
    url = cfg.checkpoint.url
    if url.startswith("file://"):
        return url[len("file://") :]
    if url and "://" not in url:
        return url
    return object_store_run_dir(url) if url and _protocol(url) not in _NOT_OBJECT_STORES else ""


#: Protocols of a ``--ckpt`` that :func:`run_dir` does not treat as object storage.
_NOT_OBJECT_STORES = ("file", "local", "memory")


def _protocol(url: str) -> str:
    """The storage protocol of a (possibly chained, ``faulty::s3://``) fsspec URL."""
    return url.rsplit("::", 1)[-1].split("://", 1)[0]


def object_store_run_dir(url: str) -> str:
    """The run directory of a job whose ``--ckpt`` is on object storage and that gave no
    ``--run-dir``: ``shardsmith-runs/<bucket-and-path>`` under the working directory (where a
    SLURM job was submitted), absolute, e.g. ``s3://bucket/runs/70b`` ->
    ``$PWD/shardsmith-runs/bucket-runs-70b``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rsplit("://", 1)[-1]).strip("-.") or "run"
    return os.path.abspath(os.path.join("shardsmith-runs", name))


def run_dir_note(cfg: TrainConfig) -> str:
    """For a job's first line: ``; metrics in DIR (...)`` when its metrics go to a directory
    other than its checkpoint root (an object-store ``--ckpt`` without ``--run-dir``), else ``""``."""
    where = run_dir(cfg)
    if cfg.run_dir or not where or not cfg.checkpoint.url or "://" not in cfg.checkpoint.url:
        return ""
    if cfg.checkpoint.url.startswith("file://"):
        return ""
    return f"; metrics in {where} (--ckpt is object storage; --run-dir picks another directory)"


def announced_run_dir(cfg: TrainConfig) -> str:
    """:func:`run_dir`, saying where it is (stderr) when :func:`run_dir_note` has something to
    say and no shardsmith launcher said it already (an external torchrun, e.g. under SLURM).
    Call on rank 0 only."""
    note = run_dir_note(cfg)
    if note and "SHARDSMITH_LAUNCH_TIME" not in os.environ:
        print(note.removeprefix("; "), file=sys.stderr, flush=True)
    return run_dir(cfg)


def step_record(
    *,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    duration_s: float,
    tokens: int,
    skipped: bool,
    flops_token: float,
    peak_flops: float,
    world_size: int,
    counters: dict[str, int],
) -> dict[str, Any]:
    """The metrics.jsonl record of one step (non-finite values become ``null``).

    Args:
        step, loss, lr, grad_norm, skipped: the step's results.
        duration_s: its wall time (seconds; the record's ``seconds``); tokens: tokens in the
            global batch.
        flops_token: :func:`flops_per_token`; peak_flops: per device, 0 = no MFU.
        world_size: devices in the job.
        counters: ``skipped_steps``, ``rollbacks``, ``restarts``.
    """
    tokens_per_s = tokens / max(duration_s, 1e-9)
    record: dict[str, Any] = {
        "step": step,
        "loss": _finite(loss),
        "lr": lr,
        "grad_norm": _finite(grad_norm),
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_s": tokens_per_s * flops_token,
        "seconds": round(duration_s, 4),
        "skipped": skipped,
        **counters,
    }
    mfu = model_flops_utilization(tokens_per_s, flops_token, peak_flops, world_size)
    if mfu is not None:
        record["mfu"] = round(mfu, 6)
    return record


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _tensorboard_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: `pip install tensorboard`
        return None
    return SummaryWriter(log_dir=log_dir)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("--wandb needs the wandb package: pip install wandb") from exc
    return wandb


def _wandb_run(run_dir: str, config: dict[str, Any]) -> Any:
    return _import_wandb().init(
        dir=run_dir,
        project=os.environ.get("WANDB_PROJECT", "shardsmith"),
        config=config,
        # compute nodes often have no network
        mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
    )


def _wandb_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's scalars under TensorBoard's tags (``train/*``, ``checkpoint/*``), and every
    number of a ``goodput`` event as ``goodput/*``."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    kind = record.get("event")
    if kind is None:
        out = {f"train/{n}": record[n] for n in TB_SCALARS if number(record.get(n))}
        return {**out, "train/step": record.get("step", 0)}
    if kind == "goodput":
        return {f"goodput/{k}": v for k, v in record.items() if number(v) and k != "time"}
    return {
        f"checkpoint/{tag}": record[name]
        for event, name, tag in TB_EVENT_SCALARS
        if kind == event and number(record.get(name))
    }


def iter_json_lines(path: str) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON (names the file and line number).
    """
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON record ({exc})") from None
