"""The PyTorch profiler (``--profile-steps``); per-step peak memory is
:func:`shardsmith.trainer.observe.console.peak_memory_nbytes`.

* :func:`profile_step`: a Chrome trace of one step per rank under
  ``<run dir>/profile/step-NNNNNNNNN/rank-NNNNN.json`` (open in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


def trace_path(directory: str, step: int, rank: int) -> str:
    """Where rank ``rank``'s Chrome trace of ``step`` goes under the run directory."""
    return os.path.join(directory, "profile", f"step-{step:09d}", f"rank-{rank:05d}.json")


@contextlib.contextmanager
def profile_step(step: int, steps: tuple[int, ...], directory: str, rank: int) -> Iterator[None]:
    """Profile the body when ``step`` is in ``steps`` and there is a run ``directory``;
    write the Chrome trace at exit. Otherwise do nothing."""
    if step not in steps or not directory:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        yield
    path = trace_path(directory, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
