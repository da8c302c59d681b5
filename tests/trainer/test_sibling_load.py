"""TP siblings read a saved chunk once: a load that raises TP has one member read the union of
the siblings' boxes and broadcast it in blocks (trainer/checkpoint/shared_reads.py: load_into_siblings).

The selection is pure and tested without processes; the load runs on real gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import write_step
from spawn_ranks import run_ranks, saved_tiny_run

from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.reading.ranges import planned_read_nbytes
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.shared_reads import _row_blocks, _union_batches, sibling_unions

CHUNK = 1 << 16
SIBLINGS = 2


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(256, 1024, generator=g),  # 1 MiB, rows of 4 KiB: siblings split columns
        "r": torch.randn(512, 512, generator=g),  # 1 MiB: siblings split rows (contiguous)
        "small": torch.randn(16, generator=g),
    }


def _whole(t: torch.Tensor) -> Box:
    return Box((0,) * t.dim(), tuple(t.shape))


def _boxes(member: int) -> dict[str, Box]:
    return {
        "w": Box((0, 512 * member), (256, 512)),
        "r": Box((256 * member, 0), (256, 512)),
        "small": Box((0,), (16,)),
    }


def _save(root: Store, steps: tuple[int, ...]) -> None:
    full = _state()
    for step in steps:
        write_step(
            root,
            step,
            {"rank-00000.safetensors": {f: (t, _whole(t)) for f, t in full.items()}},
            dims=ParallelDims(),
            chunk_nbytes=CHUNK,
        )


def test_sibling_unions_pick_only_tensors_whose_chunks_members_share(tmp_path) -> None:
    root = Store(str(tmp_path))
    _save(root, (1,))
    manifest = read_manifest(root.child(step_dir(1)))
    members = [_boxes(m) for m in range(SIBLINGS)]
    # column halves of 4 KiB rows: each member alone reads every chunk of the tensor
    w = manifest.tensors["w"]
    assert planned_read_nbytes(w, members[0]["w"], CHUNK) == 256 * 4096
    assert planned_read_nbytes(w, Box((0, 0), (256, 1024)), CHUNK) == 256 * 4096
    assert sibling_unions(manifest, members) == {"w": Box((0, 0), (256, 1024))}
    # overlapping boxes, a gap, a member without the tensor, one member: nothing shared
    overlap = [{"w": Box((0, 0), (256, 600))}, {"w": Box((0, 500), (256, 524))}]
    gap = [{"w": Box((0, 0), (256, 400))}, {"w": Box((0, 512), (256, 512))}]
    assert sibling_unions(manifest, overlap) == {}
    assert sibling_unions(manifest, gap) == {}
    assert sibling_unions(manifest, [members[0], {"r": members[1]["r"]}]) == {}
    assert sibling_unions(manifest, members[:1]) == {}
    # a union under the size threshold is read apart
    quarter = [{"w": Box((0, 0), (64, 512))}, {"w": Box((0, 512), (64, 512))}]
    assert sibling_unions(manifest, quarter) == {}


def test_row_blocks_cover_the_box_in_whole_rows() -> None:
    blocks = _row_blocks(Box((10, 0), (100, 1024)), 4, 40 * 4096)
    assert [b.lengths[0] for b in blocks] == [40, 40, 20]
    assert [b.offsets for b in blocks] == [(10, 0), (50, 0), (90, 0)]
    assert _row_blocks(Box((0, 0), (3, 1024)), 4, 16) == [Box((r, 0), (1, 1024)) for r in range(3)]


def test_union_batches_split_each_batch_evenly_among_members() -> None:
    unions = {"a": Box((0, 0), (256, 1024)), "b": Box((0, 0), (64, 1024))}  # 1 MiB, 256 KiB of fp32
    batches = _union_batches(unions, {"a": 4, "b": 4}, 2, 256 << 10)
    assert [[(f, b.offsets[0], m) for f, b, m in batch] for batch in batches] == [
        [("a", 0, 0), ("a", 64, 1)],
        [("a", 128, 0), ("a", 192, 1)],
        [("b", 0, 0)],
    ]
    whole = _union_batches(unions, {"a": 4, "b": 4}, 4, 1 << 30)  # one batch, LPT by bytes
    assert [(f, m) for f, _, m in whole[0]] == [("a", 0), ("b", 1)]


def _worker(rank: int, port: int, root: str, results) -> None:
    import torch.distributed as dist

    from shardsmith.errors import CheckpointError, IntegrityError
    from shardsmith.trainer.checkpoint.save_load import load_into
    from shardsmith.trainer.checkpoint.shared_reads import load_into_siblings

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIBLINGS
    )
    full, boxes = _state(), _boxes(rank)
    out: dict = {}
    for step, how in ((1, "siblings"), (1, "apart"), (2, "siblings"), (3, "siblings")):
        step_store = Store(root).child(step_dir(step))
        manifest = read_manifest(step_store)
        dest = {f: torch.zeros(b.lengths) for f, b in boxes.items()}
        shapes = {f: tuple(t.shape) for f, t in full.items()}
        if step == 3 and rank == 1:
            shapes["r"] = (512, 513)  # this member's model disagrees
        try:
            if how == "siblings":
                stats = load_into_siblings(
                    step_store,
                    manifest,
                    dest,
                    boxes,
                    shapes,
                    group=dist.group.WORLD,
                    block_nbytes=256 << 10,
                )
            else:
                stats = load_into(step_store, manifest, dest, boxes, shapes)
            out[(step, how)] = {
                "equal": all(
                    torch.equal(dest[f], full[f][boxes[f].relative_to(_whole(full[f]))])
                    for f in full
                ),
                "read": stats.nbytes_read,
                "needed": stats.nbytes_needed,
            }
        except (IntegrityError, CheckpointError) as exc:
            out[(step, how)] = {"error": f"{type(exc).__name__}: {exc}"}
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_siblings_read_shared_chunks_once_and_fail_together(tmp_path) -> None:
    root = Store(str(tmp_path))
    _save(root, (1, 2, 3))
    broken = read_manifest(root.child(step_dir(2))).tensors["w"].shards[0]
    path = tmp_path / step_dir(2) / broken.file
    raw = bytearray(path.read_bytes())
    raw[broken.byte_offset + 700_000] ^= 0x10  # inside w's last block
    path.write_bytes(bytes(raw))

    got = run_ranks(_worker, SIBLINGS, str(tmp_path))

    shared, apart = (
        [got[r][(1, "siblings")] for r in range(2)],
        [got[r][(1, "apart")] for r in range(2)],
    )
    assert all(x["equal"] for x in shared + apart), got
    needed = (512 * 256 + 256 * 512) * 4 + 16 * 4
    assert all(x["needed"] == needed for x in shared + apart)
    # apart, both members read all of w (their column halves touch every chunk); shared, once
    w, r = 1 << 20, 1 << 20
    assert sum(x["read"] for x in apart) >= 2 * w + r
    assert w + r <= sum(x["read"] for x in shared) <= w + r + 4 * CHUNK
    assert max(x["read"] for x in shared) <= (w + r) / 2 + 2 * CHUNK  # the blocks split evenly

    errors = [got[r][(2, "siblings")]["error"] for r in range(2)]
    assert all(e.startswith("IntegrityError") and broken.file in e for e in errors), errors
    assert sum("failed to read its share" in e for e in errors) == 1
    errors = [got[r][(3, "siblings")]["error"] for r in range(2)]
    assert all(e.startswith("CheckpointError") and "513" in e for e in errors), errors
    assert "sibling 1 of this rank's group" in errors[0]


def _trainer_worker(rank: int, port: int, data_path: str, ckpt: str, results) -> None:
    import dataclasses
    import json
    import os

    import torch.distributed as dist

    from shardsmith.trainer.checkpoint import shared_reads as shared_reads_module
    from shardsmith.trainer.train import Trainer

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    base, cfg, first = saved_tiny_run(rank, port, ParallelDims(dp_shard=2), data_path, ckpt)
    want = {k: full(v).detach().clone() for k, v in first.model.state_dict().items()}
    shared_reads_module.SHARED_READ_MIN_NBYTES = 0  # the tiny model's tensors are KiB
    resumed = Trainer.create(
        dataclasses.replace(
            base,
            steps=1,
            parallel=ParallelDims(tp=2),
            checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"),
        )
    )
    assert resumed.resume() and resumed.step == 1
    got = {k: full(v) for k, v in resumed.model.state_dict().items()}
    same = sorted(k for k, v in want.items() if k in got and torch.equal(got[k], v))
    dist.barrier()
    event = None
    if rank == 0:
        records = [json.loads(line) for line in open(os.path.join(ckpt, "metrics.jsonl"))]
        event = next(r for r in records if r.get("event") == "resume")
    results.put((rank, (same, sorted(want), event)))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_trainer_resume_into_more_tp_reads_shared_chunks_once(tmp_path, data_path) -> None:
    got = run_ranks(_trainer_worker, 2, data_path, str(tmp_path / "ckpt"), timeout=300)
    for r in range(2):
        same, names, _ = got[r]
        assert same == names, set(names) - set(same)  # every weight as saved, resharded dp2 -> tp2
    event = got[0][2]
    assert event["layout"]["tp"] == 2 and event["resharded"] and event["tp_siblings_share_reads"]
    # apart the members read 1.23x the bytes they need here (793,656 of 646,200: the halves of a
    # row-parallel weight touch the same chunks); shared, each saved chunk is read once
    assert event["nbytes_needed"] <= event["nbytes_read"] <= event["nbytes_needed"] * 1.05, event
