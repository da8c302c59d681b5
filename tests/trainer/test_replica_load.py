"""Replicas read a checkpoint once: each member of a replica group reads ~1/R, then broadcasts.

Real gloo processes (3 replicas). The pure assignment is tested without processes.
"""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_factory import write_step
from spawn_ranks import run_ranks, saved_tiny_run

from shardsmith.layout import ParallelDims
from shardsmith.layout.assignment import lpt_assign
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.shared_reads import SHARED_READ_MIN_NBYTES

REPLICAS = 3
ROWS = {"a": 512, "b": 300, "c": 700, "d": 640}  # x 1024 fp32: 1.2-2.8 MiB each


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {f: torch.randn(n, 1024, generator=g) for f, n in ROWS.items()}
    out["small"] = torch.randn(16, generator=g)  # under the threshold: read by all
    return out


def _whole(t: torch.Tensor) -> Box:
    return Box((0,) * t.dim(), tuple(t.shape))


def test_lpt_assign_balances_bytes_deterministically() -> None:
    sizes = {"a": 10, "b": 7, "c": 6, "d": 5, "e": 4, "f": 1}
    readers = lpt_assign(sizes, 3)
    assert readers == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 1, "f": 0}
    load = [sum(sizes[f] for f, r in readers.items() if r == m) for m in range(3)]
    assert load == [11, 11, 11]
    assert lpt_assign(sizes, 1) == dict.fromkeys(sizes, 0)
    assert lpt_assign(dict(reversed(list(sizes.items()))), 3) == readers  # order-independent


def _worker(rank: int, port: int, root: str, results) -> None:
    import torch.distributed as dist
    from ckpt_factory import memory_root

    from shardsmith.errors import IntegrityError
    from shardsmith.trainer.checkpoint.shared_reads import load_into_replicas, shares_reads

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=REPLICAS
    )
    full = _state()
    out: dict = {"shares": []}
    for per_node, store in (("3", Store(root)), ("1", Store(root)), ("3", memory_root())):
        os.environ["LOCAL_WORLD_SIZE"] = per_node
        out["shares"].append(shares_reads(store, dist.group.WORLD))
    for step in (1, 2):
        step_store = Store(root).child(step_dir(step))
        manifest = read_manifest(step_store)
        dest = {f: torch.zeros_like(t) for f, t in full.items()}
        try:
            stats = load_into_replicas(
                step_store,
                manifest,
                dest,
                {f: _whole(t) for f, t in full.items()},
                {f: tuple(t.shape) for f, t in full.items()},
                dist.group.WORLD,
            )
            out[step] = {
                "equal": all(torch.equal(dest[f], full[f]) for f in full),
                "read": stats.nbytes_read,
                "needed": stats.nbytes_needed,
            }
        except IntegrityError as exc:
            out[step] = {"error": str(exc)}
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_replicas_read_once_and_fail_together(tmp_path) -> None:
    full = _state()
    root = Store(str(tmp_path))
    files = {
        "rank-00000.safetensors": {f: (full[f], _whole(full[f])) for f in ("a", "b", "small")},
        "rank-00001.safetensors": {f: (full[f], _whole(full[f])) for f in ("c", "d")},
    }
    for step in (1, 2):
        write_step(
            root, step, files, dims=ParallelDims(dp_replicate=REPLICAS), chunk_nbytes=1 << 16
        )
    broken = read_manifest(root.child(step_dir(2))).tensors["c"].shards[0]
    path = tmp_path / step_dir(2) / broken.file
    raw = bytearray(path.read_bytes())
    raw[broken.byte_offset + 100_000] ^= 0x08
    path.write_bytes(bytes(raw))

    got = run_ranks(_worker, REPLICAS, str(tmp_path))

    # one node with a local checkpoint: the page cache shares; two nodes or an object store: we do
    assert all(got[r]["shares"] == [False, True, True] for r in range(REPLICAS)), got
    total = sum(t.numel() * 4 for t in full.values())
    small = full["small"].numel() * 4
    assert all(got[r][1]["equal"] and got[r][1]["needed"] == total for r in range(REPLICAS))
    reads = [got[r][1]["read"] for r in range(REPLICAS)]
    big = total - small
    assert (
        big <= sum(reads) - REPLICAS * small <= big * 1.02
    )  # every big byte read once (+ chunk margins)
    assert max(reads) < total * 0.5  # no member read the whole state
    assert all(ROWS[f] * 4096 >= SHARED_READ_MIN_NBYTES for f in ROWS)

    errors = [got[r][2]["error"] for r in range(REPLICAS)]  # every member fails, naming the file
    assert all(broken.file in e for e in errors), errors
    assert sum("failed to read its share" in e for e in errors) == REPLICAS - 1


def _trainer_worker(rank: int, port: int, data_path: str, ckpt: str, results) -> None:
    import dataclasses
    import json
    import os

    import torch.distributed as dist

    from shardsmith.trainer.checkpoint import shared_reads as shared_reads_module
    from shardsmith.trainer.train import Trainer

    _, cfg, first = saved_tiny_run(rank, port, ParallelDims(dp_replicate=2), data_path, ckpt)
    want = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    shared_reads_module.SHARED_READ_MIN_NBYTES = 0  # the tiny model's tensors are KiB
    resumed = Trainer.create(
        dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
    )
    assert resumed.resume() and resumed.step == 1
    got = resumed.model.state_dict()
    same = all(
        torch.equal(
            got[k].full_tensor() if hasattr(got[k], "full_tensor") else got[k],
            v.full_tensor() if hasattr(v, "full_tensor") else v,
        )
        for k, v in want.items()
    )
    dist.barrier()
    event = None
    if rank == 0:
        records = [json.loads(line) for line in open(os.path.join(ckpt, "metrics.jsonl"))]
        event = next(r for r in records if r.get("event") == "resume")
    results.put((rank, (same, event)))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_trainer_resume_reads_once_per_replica_group(tmp_path, data_path) -> None:
    got = run_ranks(_trainer_worker, 2, data_path, str(tmp_path / "ckpt"), timeout=300)
    assert got[0][0] and got[1][0]
    event = got[0][1]
    assert event["layout"]["dp_replicate"] == 2 and not event["resharded"]
    assert event["replicas_sharing_reads"] == 2 and not event["tp_siblings_share_reads"]
    # each replica read about half: the pair read the state once (chunk margins aside), not twice
    assert event["nbytes_needed"] / 2 <= event["nbytes_read"] <= event["nbytes_needed"] / 2 * 1.1, (
        event
    )


def _fail_holding(group) -> None:
    """A collective, then an exception whose traceback frame holds ``group`` (a cycle: the
    exception -> its traceback -> this frame -> ``error``), as a failed share leaves."""
    import torch.distributed as dist

    dist.all_reduce(torch.ones(3), group=group)
    error = RuntimeError("a share failed")
    raise error


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _exit_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from shardsmith.trainer.parallel import end_distributed

    before = _threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _fail_holding(dist.group.WORLD)
    except RuntimeError:
        pass
    dist.destroy_process_group()
    kept = _threads()  # the cycle keeps the group, and its gloo threads, alive
    end_distributed()
    results.put((rank, (before, kept, _threads())))


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_rank_ends_its_gloo_threads_while_the_interpreter_is_alive() -> None:
    """The cause of the exit-time abort (``terminate called without an active exception``
    after a rank returned its result, see ``end_distributed``): a group kept alive past
    ``destroy_process_group`` by a reference cycle keeps gloo threads into the interpreter's
    teardown. ``end_distributed`` (every test rank's end, ``spawn_ranks.end_rank``) ends them."""
    got = run_ranks(_exit_worker, 2)
    for before, kept, after in got.values():
        assert kept > before  # the condition of the abort, reproduced every time
        assert after == before  # and ended while the interpreter is alive
