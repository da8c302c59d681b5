"""A rank slow inside its own forward is named as the straggler, under FSDP2, TP and a
pipeline (:mod:`shardsmith.trainer.detect.waits`: own work = wall time less the time blocked
in collectives; the slow rank waits least).

The runs are 4-process ``shardsmith train`` launches of the tiny model, 12 steps, windows of
2 steps, a rank slow at 1.5x its peers named after 2 slow windows in a row (so within K = 3 windows of the first):
rank 2 sleeps inside every attention forward (dp_shard 4), rank 1 after every feed-forward
output matmul (tp 2 x dp_shard 2), rank 3 after every output matmul (pp 2 x dp_shard 2);
the same pipeline layout unperturbed names no one.
"""

from __future__ import annotations

import pytest
from spawn_ranks import run_ranks
from train_runs import Run, train_tiny

from shardsmith.trainer.detect import DetectConfig
from shardsmith.trainer.detect.straggler import StragglerWatch, slow_ranks

FLAGS = ["--steps", "12", "--straggler-every", "2", "--straggler-windows", "2"]
FLAGS += ["--straggler-factor", "1.5"]
K = 3  # windows: named by the end of the third


def test_straggler_judged_against_its_pipeline_stage() -> None:
    # pp 2 x dp 2: the last stage does more (output layer); rank 3 is slow only next to rank 2
    own = [0.10, 0.11, 0.30, 0.65]
    assert slow_ranks(own, 1.5) == [2, 3]  # against the whole world: stage 1 looks slow
    assert slow_ranks(own, 1.5, [0, 0, 1, 1]) == [3]
    watch = StragglerWatch(DetectConfig(straggler_windows=1, straggler_factor=1.5), [0, 0, 1, 1])
    fields, event = watch.judge(2, own, [0.55, 0.54, 0.35, 0.01])
    assert fields["slowest_rank"] == 3 and fields["slowest_compute_ratio"] == round(0.65 / 0.30, 2)
    assert event is not None and event["ranks"] == [3] and event["wait_s"] == {"3": 0.01}
    assert slow_ranks([0.1, 0.5], 1.5, [0, 1]) == [1]  # alone in its stage: all other ranks


def _waits(rank: int, port: int, results) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from shardsmith.trainer.detect.waits import step_clock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    with step_clock() as plain:  # a torch.distributed call: Work.wait
        if rank == 1:
            time.sleep(0.5)
        dist.all_reduce(torch.ones(4))
    warm = DTensor.from_local(torch.ones(4), mesh, [Partial()])  # first use: not a wait
    warm.redistribute(mesh, [Replicate()]).to_local().sum().item()
    with step_clock() as dtensor:  # DTensor's functional collectives: wait_tensor
        partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        if rank == 1:
            time.sleep(0.5)
        partial.redistribute(mesh, [Replicate()]).to_local().sum().item()
    out = {
        name: (c.wall_s, c.blocked_s, c.own_s)
        for name, c in (("plain", plain), ("dtensor", dtensor))
    }
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_straggler_clock_counts_the_wait_on_the_fast_rank_only() -> None:
    got = run_ranks(_waits, 2, timeout=120)
    for kind in ("plain", "dtensor"):
        (_, fast_blocked, fast_own), (_, slow_blocked, slow_own) = got[0][kind], got[1][kind]
        assert fast_blocked > 0.4 and slow_blocked < fast_blocked / 4, (kind, got)
        assert slow_own > 0.4 and fast_own < slow_own / 4, (kind, got)


def _named(run: Run, rank: int) -> None:
    stragglers = run.events("straggler")
    assert stragglers and all(e["ranks"] == [rank] for e in stragglers), stragglers
    assert stragglers[0]["step"] <= 2 * K, stragglers  # windows of 2 steps
    assert stragglers[0]["wait_s"][str(rank)] < stragglers[0]["max_wait_s"]  # it waits least
    assert f"slowest rank {rank}" in run.output


def _run(tmp_path_factory, data_path: str, name: str, slow: str, *layout: str) -> Run:
    root = tmp_path_factory.mktemp("straggler") / name
    env = {"SHARDSMITH_TEST_SLOW_IN": slow} if slow else {}
    return train_tiny(root, 4, data_path, *layout, *FLAGS, env=env).check()


@pytest.mark.distributed
@pytest.mark.slow
def test_straggler_slow_inside_attention_named_under_fsdp2(tmp_path_factory, data_path) -> None:
    _named(_run(tmp_path_factory, data_path, "fsdp", "2:attention:0.02", "--dp-shard", "4"), 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_straggler_slow_inside_a_matmul_named_under_tp(tmp_path_factory, data_path) -> None:
    run = _run(tmp_path_factory, data_path, "tp", "1:matmul:0.02", "--tp", "2", "--dp-shard", "2")
    _named(run, 1)


@pytest.mark.distributed
@pytest.mark.slow
def test_straggler_slow_inside_a_matmul_named_under_pp(tmp_path_factory, data_path) -> None:
    run = _run(tmp_path_factory, data_path, "pp", "3:matmul:0.02", "--pp", "2", "--dp-shard", "2")
    _named(run, 3)


@pytest.mark.distributed
@pytest.mark.slow
def test_no_straggler_in_an_unperturbed_pipeline(tmp_path_factory, data_path) -> None:
    run = _run(tmp_path_factory, data_path, "plain", "", "--pp", "2", "--dp-shard", "2")
    assert not run.events("straggler"), run.events("straggler")
