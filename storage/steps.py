"""Step directories under a checkpoint root: their names, the listing with commit status, the
``latest`` hint, and deleting one. The bottom of the commit / lineage / gc rooms, so none of them
imports another to learn what a step is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.store.fs import Store

LATEST_NAME = "latest"
_STEP_RE = re.compile(r"^step-(\d{9,})$")


def step_dir(step: int) -> str:
    """Directory name of a step, e.g. ``step-000000040``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """Step number of a directory name, or ``None`` when it is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass
class StepInfo:
    """A step directory under a checkpoint root."""

    step: int
    name: str
    committed: bool


def list_steps(root: Store) -> list[StepInfo]:
    """All step directories under ``root``, oldest first, with commit status."""
    out = []
    for name in root.list_dir():
        step = parse_step_dir(name)
        if step is not None:
            out.append(StepInfo(step, name, root.exists(f"{name}/{MANIFEST_NAME}")))
    return sorted(out, key=lambda s: s.step)


def read_latest_hint(root: Store) -> str | None:
    """Contents of ``<root>/latest`` (a step directory name) or ``None``."""
    try:
        text = root.read(LATEST_NAME).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return text or None


def delete_step(root: Store, name: str) -> None:
    """Delete one step directory, manifest first (it stops being committed at once)."""
    root.delete(f"{name}/{MANIFEST_NAME}")
    root.delete(name, recursive=True)
