"""Async save and ranged reads: correctness only (speed is measured by ``bench/``).

* async and sync saves of the same state write byte-identical checkpoints, and the async
  one is a snapshot: changing the tensors after ``save`` returns does not change it;
* a background failure is raised as ``SaveError`` by the next ``save`` or ``wait`` and the
  step is never committed;
* a save started while one is in flight waits for it;
* with ``overlap_with(optimizer)`` the snapshot overlaps until the optimizer's next step, which
  waits for it;
* ``read_box``/``read_boxes`` of sub-boxes of every shape (row and column slices, single
  rows/columns, 3-D, 0-d, non-contiguous destinations, odd chunk sizes) return exactly what
  whole-file reads with ``safetensors`` give, and skip chunks that hold only gap bytes.

The async tests run in-process on a 1-rank gloo group.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from ckpt_factory import write_step

from shardsmith.errors import IntegrityError, SaveError, StorageError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import checkpoint_specs
from shardsmith.storage.checksum import crc32c
from shardsmith.storage.commit import find_latest_committed, read_manifest, step_dir
from shardsmith.storage.formats import registry as formats_module
from shardsmith.storage.formats.registry import read_box, read_boxes
from shardsmith.storage.formats.tensor_files import DTYPE_NAMES
from shardsmith.storage.manifest.records import MANIFEST_NAME, SIDECAR_SUFFIX, Manifest
from shardsmith.storage.reading.execute import ReadStats
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint import save_load as checkpoint_module
from shardsmith.trainer.checkpoint.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint.save_load import save_checkpoint

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=96,
    seq_length=16,
)
DIMS = ParallelDims()


# ---- async save -----------------------------------------------------------------------------


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state of MODEL on one rank (random values)."""
    g = torch.Generator().manual_seed(seed)
    return {
        fqn: torch.randn(spec.shape, generator=g) if spec.shape else torch.tensor(5.0)
        for fqn, spec in checkpoint_specs(MODEL, DIMS).items()
    }


def save_sync(root: Store, step: int, tensors: dict[str, torch.Tensor]) -> None:
    save_checkpoint(
        root, step, tensors, model_cfg=MODEL, dims=DIMS, config={"run": "x"}, state={"step": step}
    )


def save_async(ckpt: AsyncCheckpointer, step: int, tensors: dict[str, torch.Tensor]) -> float:
    return ckpt.save(step, tensors, config={"run": "x"}, state={"step": step})


def step_files(root: Path, step: int) -> dict[str, bytes]:
    """Every data file of a step directory, by relative path (the manifest excluded)."""
    base = root / step_dir(step)
    return {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def manifest_sections(root: Path, step: int) -> dict:
    data = json.loads((root / step_dir(step) / MANIFEST_NAME).read_text())
    return {
        k: data[k] for k in ("tensors", "files", "layout", "model", "config", "state", "checksum")
    }


def test_async_and_sync_saves_are_byte_identical_snapshots(gloo_group, tmp_path: Path) -> None:
    tensors = model_state()
    original = {k: v.clone() for k, v in tensors.items()}
    save_sync(Store(str(tmp_path / "sync")), 4, tensors)
    ckpt = AsyncCheckpointer(Store(str(tmp_path / "async")), MODEL, DIMS)
    save_async(ckpt, 4, tensors)
    for t in tensors.values():  # training goes on while the save runs in background
        t.add_(1.0)
    ckpt.wait()
    sync_files, async_files = step_files(tmp_path / "sync", 4), step_files(tmp_path / "async", 4)
    assert sync_files and sorted(sync_files) == sorted(async_files)
    assert all(sync_files[k] == async_files[k] for k in sync_files), "data files differ"
    assert manifest_sections(tmp_path / "sync", 4) == manifest_sections(tmp_path / "async", 4)
    files = manifest_sections(tmp_path / "sync", 4)["files"]  # whole-file CRCs (combined
    assert {name: crc for name, _, crc in files} == {  # from the chunks') are right
        k: crc32c(data) for k, data in sync_files.items()
    }
    # the saved values are the snapshot taken by save(), not the later ones
    saved = safetensors.torch.load_file(
        str(tmp_path / "async" / step_dir(4) / "shards/rank-00000.safetensors")
    )
    assert all(torch.equal(saved[k], original[k]) for k in saved)
    # a second save reuses the staging buffers and is still identical
    save_sync(Store(str(tmp_path / "sync")), 5, tensors)
    save_async(ckpt, 5, tensors)
    ckpt.wait()
    assert step_files(tmp_path / "sync", 5) == step_files(tmp_path / "async", 5)


def test_background_failure_is_raised_and_not_committed(
    gloo_group, tmp_path: Path, monkeypatch
) -> None:
    root = Store(str(tmp_path / "ckpt"))
    ckpt = AsyncCheckpointer(root, MODEL, DIMS)
    tensors = model_state()
    save_async(ckpt, 1, tensors)
    ckpt.wait()
    real_write = Store.write_parts

    def failing(self: Store, key: str, parts) -> None:
        if key.startswith("shards/"):
            raise StorageError(f"{self.url_of(key)}: injected failure")
        real_write(self, key, parts)

    monkeypatch.setattr(Store, "write_parts", failing)
    save_async(ckpt, 2, tensors)  # returns after the snapshot; the write fails behind
    with pytest.raises(SaveError, match=r"step 2 not committed: .*injected failure"):
        ckpt.wait()
    assert not root.exists(f"{step_dir(2)}/{MANIFEST_NAME}") and find_latest_committed(root) == 1

    save_async(ckpt, 3, tensors)  # fails again; this time the next save() reports it
    with pytest.raises(SaveError, match=r"step 3 not committed"):
        save_async(ckpt, 4, tensors)
    ckpt.wait()  # the failure was reported once; no save in flight
    assert find_latest_committed(root) == 1 and not root.exists(step_dir(4))

    monkeypatch.setattr(Store, "write_parts", real_write)
    save_async(ckpt, 5, tensors)
    ckpt.wait()
    assert find_latest_committed(root) == 5


def test_commit_failure_is_reported_and_not_committed(
    gloo_group, tmp_path: Path, monkeypatch
) -> None:
    root = Store(str(tmp_path / "ckpt"))

    def failing_commit(*args, **kwargs) -> None:
        raise RuntimeError("injected commit failure")

    monkeypatch.setattr(checkpoint_module, "commit", failing_commit)
    with pytest.raises(
        SaveError, match=r"step 7 not committed: commit: RuntimeError: injected commit failure"
    ):
        save_sync(root, 7, model_state())
    assert find_latest_committed(root) is None


def test_save_while_one_is_in_flight_waits_for_it(gloo_group, tmp_path: Path, monkeypatch) -> None:
    root = Store(str(tmp_path / "ckpt"))
    ckpt = AsyncCheckpointer(root, MODEL, DIMS)
    tensors = model_state()
    release, events = threading.Event(), []
    real_write = formats_module.write_shard_file
    real_plan = checkpoint_module.plan_local_writes

    def blocking_write(store, key, entries, *args, **kwargs):
        step = int(store.url.rstrip("/").rsplit("-", 1)[-1])
        events.append(f"write {step} start")
        if step == 1:
            assert release.wait(timeout=60), "test never released the first write"
        result = real_write(store, key, entries, *args, **kwargs)
        events.append(f"write {step} end")
        return result

    def logged_plan(step, *args, **kwargs):
        events.append(f"plan {step}")
        return real_plan(step, *args, **kwargs)

    monkeypatch.setattr(formats_module, "write_shard_file", blocking_write)
    monkeypatch.setattr("shardsmith.trainer.checkpoint.async_save.plan_local_writes", logged_plan)
    save_async(ckpt, 1, tensors)
    second = threading.Thread(target=save_async, args=(ckpt, 2, tensors))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive(), "the second save did not wait for the one in flight"
    assert "plan 2" not in events
    release.set()
    second.join()
    ckpt.wait()
    assert events == [
        "plan 1",
        "write 1 start",
        "write 1 end",
        "plan 2",
        "write 2 start",
        "write 2 end",
    ]
    assert find_latest_committed(root) == 2 and root.exists(f"{step_dir(1)}/{MANIFEST_NAME}")


def test_overlapped_snapshot_is_taken_before_the_optimizer_step(
    gloo_group, tmp_path: Path, monkeypatch
) -> None:
    """With overlap_with(optimizer), save() returns before the copy; the optimizer's next step waits
    for it, so the checkpoint holds the values save() was called with."""
    tensors = model_state()
    original = {k: v.clone() for k, v in tensors.items()}
    params = [torch.nn.Parameter(t) for k, t in tensors.items() if not k.startswith("optim.")]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.SGD(params, lr=1.0)
    root = Store(str(tmp_path / "ckpt"))
    ckpt = AsyncCheckpointer(root, MODEL, DIMS)
    ckpt.overlap_with(optimizer)
    copy_may_start = threading.Event()
    real_stage, real_wait = AsyncCheckpointer._stage, AsyncCheckpointer.wait_snapshot

    def gated_stage(self, plan, ready):
        assert copy_may_start.wait(timeout=60), "the snapshot was not taken in the background"
        return real_stage(self, plan, ready)

    def opening_wait(self) -> None:
        copy_may_start.set()  # the step is about to wait: the copy may run now
        real_wait(self)

    monkeypatch.setattr(AsyncCheckpointer, "_stage", gated_stage)
    monkeypatch.setattr(AsyncCheckpointer, "wait_snapshot", opening_wait)
    save_async(ckpt, 1, tensors)  # returns before the copy (it is gated)
    optimizer.step()  # must wait for the snapshot before updating
    copy_may_start.set()
    ckpt.wait()
    assert all(
        torch.equal(p, original[k] - 1.0)
        for p, k in zip(params, [k for k in tensors if not k.startswith("optim.")])
    )
    saved = safetensors.torch.load_file(
        str(tmp_path / "ckpt" / step_dir(1) / "shards/rank-00000.safetensors")
    )
    assert sorted(saved) == sorted(original) and all(
        torch.equal(saved[k], original[k]) for k in saved
    )
    assert ckpt.last_result is not None and ckpt.last_result.step == 1


# ---- ranged reads -----------------------------------------------------------------------------

FILES = ("shards/a.safetensors", "shards/b.safetensors")


def logical_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(64, 96, generator=g),  # dim 0 split
        "cols": torch.randn(48, 256, generator=g),  # dim 1 split (TP rowwise)
        "grid": torch.randn(32, 40, generator=g).to(torch.bfloat16),  # 2 x 2 grid
        "cube": torch.randn(6, 10, 12, generator=g),  # 3-D, dim 1 split
        "vec": torch.randn(300, generator=g).to(torch.float16),  # 1-D
        "scalar": torch.tensor(2.5),  # 0-d
    }


def saved_boxes() -> dict[str, list[tuple[int, Box]]]:
    """fqn -> (file index, saved box)."""
    return {
        "rows": [(0, Box((0, 0), (40, 96))), (1, Box((40, 0), (24, 96)))],
        "cols": [(0, Box((0, 0), (48, 128))), (1, Box((0, 128), (48, 128)))],
        "grid": [
            (0, Box((0, 0), (16, 20))),
            (1, Box((0, 20), (16, 20))),
            (1, Box((16, 0), (16, 20))),
            (0, Box((16, 20), (16, 20))),
        ],
        "cube": [(0, Box((0, 0, 0), (6, 4, 12))), (1, Box((0, 4, 0), (6, 6, 12)))],
        "vec": [(1, Box((0,), (123,))), (0, Box((123,), (177,)))],
        "scalar": [(1, Box((), ()))],
    }


def write_checkpoint(root: Store, chunk_nbytes: int) -> None:
    """Commit step 1 holding :func:`logical_tensors` split over two files as :func:`saved_boxes`
    (a file holds at most one box per tensor: the grid's boxes are split by key suffix)."""
    full = logical_tensors()
    files = {}
    for index, name in enumerate(FILES):
        for part in range(2):  # "grid" has two boxes in each file: two key sets
            local = {
                fqn: (
                    full[fqn][box.relative_to(Box((0,) * t.dim(), tuple(t.shape)))].contiguous(),
                    box,
                )
                for fqn, t in full.items()
                for k, (i, box) in enumerate(saved_boxes()[fqn])
                if i == index and (k // 2 if fqn == "grid" else 0) == part
            }
            if local:
                files[name if part == 0 else name.replace(".safetensors", "-2.safetensors")] = local
    write_step(
        root,
        1,
        files,
        dims=ParallelDims(dp_shard=2),
        chunk_nbytes=chunk_nbytes,
        tensors={fqn: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for fqn, t in full.items()},
    )


def whole_file_tensors(step_store: Store, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every logical tensor assembled from whole files loaded with safetensors."""
    full = {
        fqn: torch.zeros(
            rec.shape,
            dtype=getattr(
                torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[rec.dtype]
            ),
        )
        for fqn, rec in manifest.tensors.items()
    }
    for file in manifest.files:
        if file.endswith(SIDECAR_SUFFIX):  # chunk CRCs, not tensors
            continue
        loaded = safetensors.torch.load(step_store.read(file))
        for fqn, rec in manifest.tensors.items():
            for s in rec.shards:
                if s.file == file:
                    box = Box(tuple(s.offsets), tuple(s.lengths))
                    full[fqn][box.relative_to(Box((0,) * len(rec.shape), tuple(rec.shape)))] = (
                        loaded[fqn]
                    )
    return full


def sub_boxes(shape: tuple[int, ...], g: torch.Generator) -> list[Box]:
    """Whole, single rows, single columns, column slices, row slices and random boxes."""
    if not shape:
        return [Box((), ())]
    boxes = [Box((0,) * len(shape), shape)]
    if len(shape) >= 2:
        boxes += [
            Box((3,) + (0,) * (len(shape) - 1), (1,) + shape[1:]),  # one row
            Box((0,) * (len(shape) - 1) + (shape[-1] - 1,), shape[:-1] + (1,)),  # one column
            Box((0,) * (len(shape) - 1) + (shape[-1] // 4,), shape[:-1] + (shape[-1] // 2,)),
        ]
    for _ in range(12):
        offsets, lengths = [], []
        for n in shape:
            o = int(torch.randint(0, n, (1,), generator=g))
            offsets.append(o)
            lengths.append(int(torch.randint(1, n - o + 1, (1,), generator=g)))
        boxes.append(Box(tuple(offsets), tuple(lengths)))
    return boxes


@pytest.mark.parametrize("chunk_nbytes", [64, 1002, 2**20])
@pytest.mark.parametrize("backend", ["local", "memory"])
def test_ranged_reads_match_whole_file_reads(
    tmp_path: Path, backend: str, chunk_nbytes: int
) -> None:
    url = (
        str(tmp_path / "ckpt")
        if backend == "local"
        else f"memory://ranged-{tmp_path.name}-{chunk_nbytes}"
    )
    root = Store(url)
    write_checkpoint(root, chunk_nbytes)
    step_store = root.child(step_dir(1))
    manifest = read_manifest(step_store)
    want = whole_file_tensors(step_store, manifest)
    g = torch.Generator().manual_seed(11)
    requests, expected = [], []
    for fqn, full in want.items():
        whole = Box((0,) * full.dim(), tuple(full.shape))
        for box in sub_boxes(tuple(full.shape), g):
            got = read_box(step_store, manifest, fqn, box)
            assert torch.equal(got, full[box.relative_to(whole)]), f"{fqn} {box}"
            out = torch.empty(box.lengths[::-1], dtype=full.dtype).t() if full.dim() == 2 else None
            requests.append((fqn, box, out))  # transposed views: non-contiguous destinations
            expected.append(full[box.relative_to(whole)])
    stats = ReadStats()
    got_all = read_boxes(step_store, read_manifest(step_store), requests, stats)
    assert all(torch.equal(a, b) for a, b in zip(got_all, expected))
    assert all(out is None or got is out for got, (_, _, out) in zip(got_all, requests))
    assert stats.nbytes_needed == sum(t.numel() * t.element_size() for t in expected)
    assert stats.nbytes_needed <= stats.nbytes_read


def test_column_slice_reads_only_the_chunks_it_needs(tmp_path: Path) -> None:
    """Saved rows of 512 bytes, 64-byte chunks: a 16-column slice is one chunk per row, and
    the chunks between (only gap bytes) are not read — a corrupt one goes unnoticed by this
    read but not by a read of the whole box."""
    root = Store(str(tmp_path / "ckpt"))
    write_checkpoint(root, 64)
    step_store = root.child(step_dir(1))
    manifest = read_manifest(step_store)
    want = whole_file_tensors(step_store, manifest)["cols"]
    box = Box((0, 0), (48, 16))
    stats = ReadStats()
    assert torch.equal(read_box(step_store, manifest, "cols", box, stats=stats), want[:, :16])
    assert stats.nbytes_read == stats.nbytes_needed == 48 * 16 * 4
    shard = next(s for s in manifest.tensors["cols"].shards if s.offsets == [0, 0])
    path = tmp_path / "ckpt" / step_dir(1) / shard.file
    data = bytearray(path.read_bytes())
    data[shard.byte_offset + 200] ^= 0x10  # row 0, column 50: in a gap chunk
    path.write_bytes(bytes(data))
    assert torch.equal(read_box(step_store, manifest, "cols", box), want[:, :16])
    start = shard.byte_offset + 192  # file offsets, as `verify` gives them
    with pytest.raises(
        IntegrityError,
        match=f"checksum mismatch in 'cols' at bytes \\[{start}, {start + 64}\\) of the file",
    ):
        read_box(step_store, manifest, "cols", Box((0, 0), (48, 256)))


def test_destination_of_the_wrong_dtype_is_refused(tmp_path: Path) -> None:
    root = Store(str(tmp_path / "ckpt"))
    write_checkpoint(root, 64)
    step_store = root.child(step_dir(1))
    with pytest.raises(ValueError, match="destination is torch.float64"):
        read_box(
            step_store,
            read_manifest(step_store),
            "rows",
            Box((0, 0), (2, 2)),
            out=torch.empty(2, 2, dtype=torch.float64),
        )
