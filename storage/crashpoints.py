"""Crash points: a test hook that SIGKILLs this process at a named point inside a save.

Inert unless ``SHARDSMITH_TEST_CRASH_AT`` is set (never in production), and then read once,
at import: a point costs one check of an empty list otherwise.

``SHARDSMITH_TEST_CRASH_AT="RANK:POINT[:STEP],..."``: the process whose ``RANK`` environment
variable (torchrun's; 0 when unset) is RANK SIGKILLs itself the first time it reaches POINT,
during the save of step STEP (any step when left out). POINT is a name below, or
``NAME@FILE`` for the storage points, which then fire only for a file of that base name
(``fs.mid_write@rank-00001.safetensors``, ``fs.before_publish@manifest.json``). Before dying
the process writes ``test hook: SIGKILL at crash point POINT (rank R, step S)`` to stderr.
With ``SHARDSMITH_TEST_MARKER_DIR`` set, each (rank, point, step) fires once across elastic
restarts (a marker file there, as the step hooks of ``trainer/fault/hooks.py``), so a restarted
group that saves the same step again gets through.

Points, in the order a save reaches them (``c`` = the coordinator, rank 0, only):

===========================  ==================================================================
``async.before_snapshot``    async save: before this rank's tensors are copied to host buffers
``async.after_snapshot``     async save: snapshot taken, nothing written yet
``local.before_write``       local tier: retention done, this rank's files not yet written
``local.before_commit``      local tier: data and sidecar written, the rank manifest not yet
``local.before_replicate``   local tier: committed here, nothing sent to or from the buddies
``save.begin``               ``write_and_commit`` entered: nothing of this step written
``shard.before_write``       this rank's shard file encoded (header), nothing on storage
``fs.mid_write``             the first part of a file written (a local temp file / the first
                             S3 multipart part uploaded): mid-upload, not yet visible
``fs.before_publish``        every byte of a file written, before it becomes visible (the
                             rename of the temp file / ``CompleteMultipartUpload``)
``shard.after_write``        this rank's shard file is visible under its final name
``save.after_gather``        every rank's data is written (the records were all-gathered)
``commit.before_check``      c: manifest built and validated, file sizes not yet checked
``commit.before_manifest``   c: every file checked, ``manifest.json`` not written
``commit.after_manifest``    c: committed (manifest written), ``latest`` still names the old step
``commit.after_latest``      c: ``latest`` names the new step
``save.end``                 every rank was told the commit succeeded
``async.after_commit``       async save: committed, before the ``on_commit`` callback (gc, logs)
===========================  ==================================================================

The module imports nothing of ``torch``: storage code calls it too.
"""

from __future__ import annotations

import os
import posixpath
import signal

ENV_VAR = "SHARDSMITH_TEST_CRASH_AT"

#: (point, step or None) this process must crash at; empty when the hook is inert.
_SPECS: list[tuple[str, int | None]] = []
#: Step of the save in progress (the last step a point was given), for points that do not know it.
_save_step: int | None = None


def configure(spec: str | None = None, rank: int | None = None) -> None:
    """(Re)read the crash points: ``spec`` (default: the environment variable) for ``rank``
    (default: the ``RANK`` environment variable, else 0). Called at import; tests call it
    again after changing the environment.

    Raises:
        ValueError: an item is not ``RANK:POINT[:STEP]`` with integer RANK and STEP.
    """
    global _save_step
    spec = os.environ.get(ENV_VAR, "") if spec is None else spec
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    specs: list[tuple[str, int | None]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise ValueError(f"{ENV_VAR}={spec!r}: item {item!r} is not RANK:POINT[:STEP]")
        try:
            item_rank, step = int(parts[0]), int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(
                f"{ENV_VAR}={spec!r}: item {item!r}: RANK and STEP must be integers"
            ) from None
        if item_rank == rank:
            specs.append((parts[1], step))
    _SPECS[:] = specs
    _save_step = None


def crash_point(point: str, *, key: str = "", step: int | None = None) -> None:
    """SIGKILL this process here if the test hook asks for ``point`` (see the module docstring).

    Args:
        point: the point's name.
        key: the file being written, for the storage points (``NAME@FILE`` matches its base name).
        step: the step being saved, when the caller knows it; it is remembered for the
            points of the same save that do not (storage writes).
    """
    global _save_step
    if not _SPECS:
        return
    if step is not None:
        _save_step = step
    names = {point, f"{point}@{posixpath.basename(key.rstrip('/'))}"} if key else {point}
    for name, want_step in _SPECS:
        if name in names and (want_step is None or want_step == _save_step) and _first_time(name):
            _die(name)


def _first_time(name: str) -> bool:
    """False when ``SHARDSMITH_TEST_MARKER_DIR`` says this point already fired (before a restart)."""
    marker_dir = os.environ.get("SHARDSMITH_TEST_MARKER_DIR", "")
    if not marker_dir:
        return True
    os.makedirs(marker_dir, exist_ok=True)
    marker = f"crash-rank{os.environ.get('RANK', '0')}-{name.replace('/', '_')}-step{_save_step}"
    try:
        os.close(os.open(os.path.join(marker_dir, marker), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _die(name: str) -> None:
    message = f"test hook: SIGKILL at crash point {name} (rank {os.environ.get('RANK', '0')}, step {_save_step})\n"
    try:
        os.write(2, message.encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


configure()
