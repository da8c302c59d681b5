"""One sampled rank of a pipeline rank's chunks, stepped under fake tensors (``bench/fake_scale.py``).

:func:`run_stage` builds every model chunk the rank holds, as the trainer does
(:func:`shardsmith.trainer.parallel.build_stage_model`: chunk ``c`` of
``ParallelDims.chunk_ids(pp_rank)`` is a :class:`~shardsmith.trainer.model.Transformer` on
``meta`` with its own :func:`~shardsmith.trainer.parallel.parallelize`: TP, sequence
parallelism, activation checkpointing, FSDP2 per chunk; several chunks in a
:class:`~shardsmith.trainer.pipeline.ChunkedStage`), and runs one (two under the ``never``
policy) microbatch through each chunk under PyTorch's memory tracker. Each chunk's kept
activation bytes per microbatch are measured apart, so :func:`measured_peak` can add the
microbatches the schedule holds beyond those run, chunk by chunk.

Microbatches in flight per chunk (:func:`in_flight_counts`) come from torch's own schedule:
:func:`schedule_events` builds the job's ``torch.distributed.pipelining`` schedule class
(``--pipeline-schedule``, default ``interleaved-1f1b`` with virtual stages) on stand-in stages
and reads its ``pipeline_order`` (torch 2.13 ``schedules.py``:
``ScheduleInterleaved1F1B._calculate_single_rank_operations`` -> ``_get_warmup_ops``,
``_get_1f1b_rank_ops``: rank ``r`` runs ``min((V-1)*R + 2*(P-1-r), M*V)`` chunk forwards,
``R = M // max(1, M // P)`` per round, before its first backward, then one forward and one
backward at a time). A microbatch of a chunk is in flight from its forward (``F``) to its full
backward (``B``) or, in the zero-bubble schedules, its weight half (``W``, which still needs
the saved inputs of the linears). The rank's peak is the point of that order where the held
bytes, weighted by each chunk's measured activation bytes, are largest. Without virtual
stages a 1F1B stage ``p`` holds ``min(P - p, M)``.
"""

from __future__ import annotations

import types
from typing import Any


def stand_in_schedule(c: Any, pp_rank: int) -> Any:
    """torch's schedule object of ``c.schedule`` for pipeline rank ``pp_rank``, built on
    stand-in stages (only its ``pipeline_order`` is read; nothing runs). Needs virtual stages."""
    from shardsmith.trainer.pipeline import SCHEDULES

    dims = c.dims
    stand_ins = [
        types.SimpleNamespace(
            num_stages=dims.num_chunks,
            group_size=dims.pp,
            group_rank=pp_rank,
            stage_index=i,
            is_first=i == 0,
            is_last=i == dims.num_chunks - 1,
            submod=None,
        )
        for i in dims.chunk_ids(pp_rank)
    ]
    return SCHEDULES[c.schedule][0](stand_ins, n_microbatches=c.num_microbatches)


def schedule_events(c: Any, pp_rank: int) -> list[tuple[int, int]]:
    """(local chunk index, +1 forward / -1 release) in the order torch's schedule class for
    ``c.schedule`` runs them on pipeline rank ``pp_rank`` (module doc). Needs virtual stages."""
    from torch.distributed.pipelining import schedules as S

    from shardsmith.trainer.pipeline import splits_backward

    schedule, ids = stand_in_schedule(c, pp_rank), c.dims.chunk_ids(pp_rank)
    release = S.BACKWARD_WEIGHT if splits_backward(schedule) else S.FULL_BACKWARD
    events = []
    for action in schedule.pipeline_order[pp_rank]:
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            if a.computation_type == S.FORWARD:
                events.append((ids.index(a.stage_index), 1))
            elif a.computation_type == release:
                events.append((ids.index(a.stage_index), -1))
    return events


def in_flight_counts(c: Any, pp_rank: int, chunk_nbytes: list[int]) -> dict[str, tuple[int, ...]]:
    """Microbatches of each of the rank's chunks in flight, per phase of the step: ``"fwd"`` at
    the point of :func:`schedule_events` where ``sum(held[k] * chunk_nbytes[k])`` is largest
    after a forward, ``"bwd<k>"`` at the largest such point just before a backward of local
    chunk ``k`` (module doc). Without virtual stages ``min(P - pp_rank, M)`` in every phase
    (1F1B's steady state: a backward follows a forward)."""
    from shardsmith.sizing.activations import peak_in_flight

    v = len(chunk_nbytes)
    if c.dims.virtual_stages == 1:
        return dict.fromkeys(("fwd", "bwd0"), (min(c.dims.pp - pp_rank, c.num_microbatches),))
    events = schedule_events(c, pp_rank)
    out = {"fwd": peak_in_flight(events, chunk_nbytes)}
    out.update({f"bwd{k}": peak_in_flight(events, chunk_nbytes, backward_of=k) for k in range(v)})
    return out


def _tracker_class() -> type:
    """PyTorch's ``MemTracker`` with two changes that alter no figure it reports (module doc,
    "The tracker"): DTensor's sharding propagation runs under a fake mode of its own, as it
    does in an eager run, so the tracker's own rule skips its global-shape tensors; and each
    op updates the peaks of the modules it runs in, found by name, instead of scanning every
    module seen so far."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.distributed.tensor import _sharding_prop

    propagation_mode = FakeTensorMode()
    _sharding_prop.detect_fake_mode = lambda *_: propagation_mode

    class Tracker(MemTracker):
        """``MemTracker`` whose per-op peak update looks at the active modules only."""

        _by_fqn: dict[str, list] = {}
        _indexed = -1

        def _update_peak_stats(self, peak_state: Any) -> None:
            if self._indexed != len(self.memory_tracking):
                self._by_fqn = {}
                for stats in self.memory_tracking.values():
                    self._by_fqn.setdefault(stats.mod_fqn, []).append(stats)
                self._indexed = len(self.memory_tracking)
            curr = self._curr_mem_snap
            for fqn in self._mod_tracker.parents:
                for stats in self._by_fqn.get(fqn, ()):
                    if peak_state not in stats.snapshots:
                        continue
                    for dev, snap in curr.items():
                        if stats.local_peak.get(dev, 0) < snap[_TOTAL_KEY]:
                            stats.local_peak[dev] = snap[_TOTAL_KEY]
                            stats.snapshots[peak_state][-1][dev] = dict(snap)
            for dev, snap in curr.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return Tracker


def _build_chunks(c: Any, mesh: Any, pp_rank: int) -> list:
    """The rank's model chunks on ``meta``, parallelized as the trainer does (module doc)."""
    from shardsmith.layout.sharding import param_specs
    from shardsmith.trainer.parallel import check_placements, chunk_model, parallelize

    dims, m = c.dims, c.model
    specs, chunks = param_specs(m, dims), []
    for k in dims.chunk_ids(pp_rank):
        chunk = chunk_model(m, dims, k)
        parallelize(
            chunk,
            mesh,
            dims,
            bf16=c.bf16,
            activation_checkpointing=c.ac,
            sequence_parallel=c.sp,
            reshard_after_forward=c.policy != "never",
        )
        check_placements(chunk, specs, dims)
        chunks.append(chunk)
    return chunks


def run_stage(c: Any, stage: int) -> dict[str, Any]:
    """Build and step one rank of pipeline rank ``stage`` (all its chunks) under fake tensors
    (module doc; ``bench/fake_scale.py``'s module doc); in this process."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardsmith.trainer.checkpoint.save_load import init_optimizer_state
    from shardsmith.trainer.optim import OptimConfig, build_optimizer
    from shardsmith.trainer.parallel import build_mesh
    from shardsmith.trainer.pipeline import ChunkedStage
    from shardsmith.trainer.step import StepMath, loss_fn

    dims, m = c.dims, c.model
    rank = dims.rank_of({"pp": stage, "dp_replicate": 0, "dp_shard": 0, "tp": 0})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    mesh = build_mesh(dims, "cpu")
    ids = dims.chunk_ids(stage)
    chunks = _build_chunks(c, mesh, stage)
    model = chunks[0] if len(chunks) == 1 else ChunkedStage(chunks, ids)
    keep = c.policy == "never"  # parameters gathered for the step, gradients accumulated unsharded
    run_k = 2 if keep else 1  # the second microbatch's backward meets the first's accumulated grads
    math = StepMath(model, None, m, dims, dims.coords(rank), 1, bf16=c.bf16)
    b, s = c.micro_batch_size, m.seq_length
    seq = s // dims.tp if c.sp and dims.tp > 1 else s
    cpu = torch.device("cpu")

    class Microbatches(nn.Module):
        """Root module: ``run_k`` forwards of every chunk (the tracker refuses a root called
        twice); the activation total before and after each (chunk, microbatch)."""

        def __init__(self) -> None:
            super().__init__()
            self.stage = model

        def forward(self, xs: list) -> list:
            outs = []
            for i, x in enumerate(xs):
                after.append(tracker.get_tracker_snapshot()[cpu][_MemRefType.ACT])
                outs.append(chunks[i % len(chunks)](x))
                after.append(tracker.get_tracker_snapshot()[cpu][_MemRefType.ACT])
            return outs

    with FakeTensorMode(allow_non_fake_inputs=True):
        for chunk in chunks:
            chunk.to_empty(device="cpu")
        optimizer = build_optimizer(model, OptimConfig())
        init_optimizer_state(model, optimizer)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if keep:  # a microbatch before the step's last: no reduce, no reshard
            for chunk in chunks:
                chunk.set_requires_gradient_sync(False)
                chunk.set_reshard_after_backward(False)
        tracker = _tracker_class()()
        tracker.track_external(model, optimizer)
        after: list[int] = []
        act_dtype = torch.bfloat16 if c.bf16 else torch.float32
        with tracker:
            xs = [
                torch.randint(0, m.vocab_size, (b, s))
                if k == 0
                else torch.randn(b, seq, m.hidden_size, dtype=act_dtype, requires_grad=True)
                for _ in range(run_k)
                for k in ids
            ]
            last_chunk, v = dims.num_chunks - 1, len(ids)
            readings: list[dict[str, Any]] = []
            with math._loss_ctx() if last_chunk in ids else contextlib.nullcontext():
                with math._autocast():
                    outs = Microbatches()(xs)
                readings.append(_reading(tracker, "fwd", [run_k] * v))
                held = [run_k] * v
                for mb in range(run_k):  # each microbatch's chunks backward, the last chunk first
                    for k in reversed(range(v)):
                        _reset_peak(tracker)
                        out = outs[mb * v + k]
                        if ids[k] == last_chunk:
                            loss_fn(out, torch.randint(0, m.vocab_size, (b, s))).backward()
                        else:
                            out.backward(torch.ones_like(out))
                        readings.append(_reading(tracker, f"bwd{k}", held))
                        held[k] -= 1
                del outs, out
            _reset_peak(tracker)
            optimizer.step()
        opt_peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    return {
        "stage": stage,
        "rank": rank,
        "chunk_ids": list(ids),
        "run_in_flight": run_k,
        "per_microbatch_bytes": [after[2 * k + 1] - after[2 * k] for k in range(len(ids))],
        "readings": readings,
        "optimizer_step_tracker_peak_bytes": opt_peak,
    }


def _reset_peak(tracker: Any) -> None:
    """Start the tracker's peak afresh from what is held now."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {d: v["Total"] for d, v in tracker._peak_mem_snap.items()}


def _reading(tracker: Any, phase: str, held: list[int]) -> dict[str, Any]:
    """The tracker's peak since its last reset, the phase it was in, the microbatches of each
    chunk the run held then, and the peak's bytes by kind."""
    import torch

    peak = dict(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
    return {
        "phase": phase,
        "peak_bytes": peak["Total"],
        "held": list(held),
        "by_kind": {str(k).split(".")[-1].strip("'>"): n for k, n in peak.items() if k != "Total"},
    }


def measured_peak(got: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The rank's peak with its own microbatches in flight, and the reading it came from: each
    reading of the run (the forwards' peak, each chunk's backward's own peak) with the
    activations the schedule holds in that phase (``got["in_flight"][phase]``, one count per
    chunk) instead of those the run held then: ``in_flight[k] - held[k]`` more microbatches of
    each chunk ``k``. Under ``never`` the second microbatch's backwards meet the first's
    accumulated unsharded gradients, the state of every microbatch after the step's first."""
    per_mb, best = got["per_microbatch_bytes"], (-1, {})
    for r in got["readings"]:
        want = got["in_flight"][r["phase"]]
        total = r["peak_bytes"] + sum((w - h) * n for w, h, n in zip(want, r["held"], per_mb))
        best = max(best, (total, r), key=lambda t: t[0])
    return best
