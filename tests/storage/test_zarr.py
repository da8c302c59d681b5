"""The zarr v3 checkpoint format (``--format zarr``).

* the chunk grid: the largest regular grid on every box boundary (even, ``torch.chunk``
  uneven, nested tp-then-dp_shard splits, 0-d);
* safetensors -> zarr -> safetensors is bitwise identical (tensors, and the shard files
  byte for byte), also through ``shardsmith reshard --format``;
* a zarr checkpoint saved in one layout loads in every other (``read_boxes`` over the
  boxes of the other layout);
* plain ``zarr.open_group`` shows every tensor with its global shape and the same values
  (BF16 as uint16 bit patterns, 0-d step counters);
* ``verify`` passes, and names a corrupt or missing chunk; loading names it too; hostile
  metadata (a codec outside the whitelist) is refused;
* compressed optimizer state round-trips and is smaller when compressible;
* the trainer's save path on a 1-rank gloo group (sync and async): data and metadata
  before the manifest, nothing extra on storage; and one torchrun launch (tp2 x pp2):
  a real training run saves zarr with zstd, a fresh job loads it and saves it again.

Checkpoints are built without processes (``ckpt_factory.save_offline`` + ``convert_format``)
except where noted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from ckpt_factory import (
    CHUNK_NBYTES,
    MODEL,
    assert_bitwise_equal,
    full_tensors,
    load_full,
    save_offline,
)
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import ConfigError, IntegrityError
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.reshard.api import reshard
from shardsmith.reshard.planner import ReshardOptions
from shardsmith.reshard.zarr_convert import convert_format
from shardsmith.storage.checksum import crc32c
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.formats.registry import layout_arrays, read_box, read_boxes
from shardsmith.storage.formats.zarr_format import parse_codec, regular_chunks
from shardsmith.storage.gc import describe_steps, gc
from shardsmith.storage.manifest.records import MANIFEST_NAME, FileRecord
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.reading.execute import ReadStats
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint
from shardsmith.trainer.checkpoint.async_save import AsyncCheckpointer
from shardsmith.trainer.checkpoint.save_load import load_into, save_checkpoint
from shardsmith.trainer.config import CheckpointConfig

STEP = 7
SAVE_DIMS = ParallelDims(dp_shard=2, tp=2)
ZARR_DIMS = ParallelDims(pp=2, tp=2)
OTHER_LAYOUTS = [
    ParallelDims(),
    ParallelDims(tp=2),
    ParallelDims(dp_shard=2),
    ParallelDims(pp=2, dp_shard=2),
    ParallelDims(dp_shard=2, tp=2),
    ParallelDims(dp_replicate=2, tp=2),
]


def _compressible(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Optimizer state with few distinct values (as zstd would find in real state)."""
    return {
        f: (torch.round(t * 2) / 2 if f.startswith("optim.exp") else t) for f, t in full.items()
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A safetensors checkpoint (SAVE_DIMS), its zarr copy (ZARR_DIMS, zstd) and the copy of
    that back in safetensors (SAVE_DIMS)."""
    base = tmp_path_factory.mktemp("zarr")
    full = _compressible(full_tensors(seed=1, with_optimizer=True))
    save_offline(Store(str(base / "st")), STEP, SAVE_DIMS, full)
    st = Store(str(base / "st")).child(step_dir(STEP))
    convert_format(st, str(base / "z"), ZARR_DIMS, "zarr", codec="zstd", chunk_nbytes=CHUNK_NBYTES)
    z = Store(str(base / "z")).child(step_dir(STEP))
    convert_format(z, str(base / "back"), SAVE_DIMS, "safetensors")
    return {
        "base": base,
        "full": full,
        "st": st,
        "z": z,
        "back": Store(str(base / "back")).child(step_dir(STEP)),
    }


# ---- pure --------------------------------------------------------------------------------


def test_regular_chunks_lie_on_every_box_boundary() -> None:
    even = [Box((0, 0), (4, 8)), Box((4, 0), (4, 8))]
    assert regular_chunks((8, 8), even) == (4, 8)
    uneven = [Box((o,), (n,)) for o, n in ((0, 3), (3, 3), (6, 3), (9, 1))]  # torch.chunk(10, 4)
    assert regular_chunks((10,), uneven) == (3,)
    nested = [
        Box((0,), (3,)),
        Box((3,), (3,)),
        Box((6,), (2,)),
    ]  # tp2 of 8, then dp_shard2 of 4... uneven
    assert regular_chunks((8,), nested) == (3,)
    tp_then_dp = [Box((o,), (n,)) for o, n in ((0, 6), (6, 6), (12, 6), (18, 4))]
    assert regular_chunks((22,), tp_then_dp) == (6,)
    mixed = [Box((0,), (4,)), Box((4,), (2,)), Box((6,), (4,))]  # edges 4, 6 -> gcd 2
    assert regular_chunks((10,), mixed) == (2,)
    assert regular_chunks((), [Box((), ())]) == ()
    assert regular_chunks((5, 0), [Box((0, 0), (5, 0))]) == (5, 1)


def test_layout_arrays_compress_only_optimizer_state() -> None:
    specs = checkpoint_specs(MODEL, ZARR_DIMS)
    arrays = layout_arrays(specs, ZARR_DIMS, "zstd")
    assert arrays["layers.0.attention.wq.weight"].chunks == (16, 32)  # tp2 rows
    assert arrays["layers.0.attention.wo.weight"].chunks == (32, 16)  # tp2 columns
    assert arrays["optim.exp_avg.layers.0.attention.wq.weight"].codec == "zstd:3"
    assert arrays["layers.0.attention.wq.weight"].codec == ""
    assert (
        arrays["optim.step.norm.weight"].codec == ""
        and arrays["optim.step.norm.weight"].chunks == ()
    )
    assert parse_codec("gzip:9") == ("gzip", 9)
    for bad in ("lz4", "zstd:x"):
        with pytest.raises(ConfigError, match="zarr codec"):
            parse_codec(bad)


def test_checkpoint_config_validates_format_and_codec() -> None:
    assert CheckpointConfig(tensor_format="zarr", zarr_codec="zstd:5").zarr_codec == "zstd:5"
    with pytest.raises(ConfigError, match="tensor_format"):
        CheckpointConfig(tensor_format="hdf5")
    with pytest.raises(ConfigError, match="needs tensor_format='zarr'"):
        CheckpointConfig(zarr_codec="zstd")
    with pytest.raises(ConfigError, match="zarr codec"):
        CheckpointConfig(tensor_format="zarr", zarr_codec="snappy")


# ---- conversion and loading ---------------------------------------------------------------


def test_safetensors_zarr_safetensors_round_trip_is_bitwise(ckpts: dict) -> None:
    full = ckpts["full"]
    assert read_manifest(ckpts["z"]).tensor_format == "zarr"
    assert_bitwise_equal(load_full(ckpts["z"]), full, "zarr copy")
    assert_bitwise_equal(load_full(ckpts["back"]), full, "back in safetensors")
    src, back = Path(ckpts["st"].url), Path(ckpts["back"].url)
    names = sorted(p.name for p in (src / "shards").iterdir())
    assert names == sorted(
        p.name for p in (back / "shards").iterdir()
    )  # data files and their sidecars
    for name in (
        n for n in names if not n.endswith(".crc32c")
    ):  # the same bytes a save in SAVE_DIMS writes
        # (sidecars hold the CRCs of the chunk size each writer chose)
        assert (src / "shards" / name).read_bytes() == (back / "shards" / name).read_bytes(), name


def test_reshard_cli_converts_both_ways(ckpts: dict) -> None:
    base = ckpts["base"]
    runner = CliRunner()
    out = runner.invoke(
        cli,
        [
            "reshard",
            ckpts["st"].url,
            str(base / "cli-z"),
            "--tp",
            "2",
            "--format",
            "zarr",
            "--zarr-codec",
            "gzip",
            "--verify",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "equal: 84 tensors" in out.output
    assert read_manifest(Store(str(base / "cli-z")).child(step_dir(STEP))).tensor_format == "zarr"
    out = runner.invoke(
        cli,
        [
            "reshard",
            str(base / "cli-z"),
            str(base / "cli-st"),
            "--dp-shard",
            "2",
            "--model-only",
            "--verify",
        ],
    )  # format follows the source: zarr
    assert out.exit_code == 0, out.output
    m = read_manifest(Store(str(base / "cli-st")).child(step_dir(STEP)))
    assert m.tensor_format == "zarr" and not any(f.startswith("optim.") for f in m.tensors)
    out = runner.invoke(
        cli, ["reshard", str(base / "cli-z"), str(base / "cli-st2"), "--format", "safetensors"]
    )
    assert out.exit_code == 0, out.output
    assert_bitwise_equal(
        load_full(Store(str(base / "cli-st2")).child(step_dir(STEP))), ckpts["full"], "cli"
    )


@pytest.mark.parametrize("dims", OTHER_LAYOUTS, ids=lambda d: d.describe())
def test_zarr_checkpoint_loads_in_other_layouts(ckpts: dict, dims: ParallelDims) -> None:
    z, full = ckpts["z"], ckpts["full"]
    manifest = read_manifest(z)
    specs = checkpoint_specs(MODEL, dims)
    for rank in range(dims.world_size):
        boxes = {f: b for f, b in rank_boxes(specs, dims, rank).items() if not b.is_empty}
        stats = ReadStats()
        got = read_boxes(z, manifest, [(f, b, None) for f, b in boxes.items()], stats=stats)
        for (fqn, box), tensor in zip(boxes.items(), got):
            want = full[fqn][box.relative_to(Box((0,) * len(box.lengths), tuple(full[fqn].shape)))]
            assert torch.equal(tensor, want), (dims.describe(), rank, fqn, box)
        assert stats.nbytes_needed == sum(b.numel * 4 for b in boxes.values())


def test_raw_chunks_are_read_by_range_compressed_ones_whole(ckpts: dict) -> None:
    z = ckpts["z"]
    manifest = read_manifest(z)
    half = Box((0, 0), (8, 32))  # half of a (16, 32) tp chunk
    for fqn, want_data in (
        ("layers.0.attention.wq.weight", 8 * 32 * 4),
        (
            "optim.exp_avg.layers.0.attention.wq.weight",
            manifest.tensors["optim.exp_avg.layers.0.attention.wq.weight"].shards[0].nbytes,
        ),
    ):
        stats = ReadStats()
        got = read_box(z, manifest, fqn, half, stats=stats)
        assert torch.equal(got, ckpts["full"][fqn][:8])
        metadata = manifest.files[f"zarr/{fqn}/zarr.json"].nbytes
        assert stats.nbytes_read - metadata == want_data, fqn  # CHUNK_NBYTES divides 1024


def test_plain_zarr_opens_with_global_shapes_and_values(ckpts: dict) -> None:
    group = zarr.open_group(str(Path(ckpts["z"].url) / "zarr"), mode="r")
    manifest = read_manifest(ckpts["z"])
    assert sorted(group.array_keys()) == sorted(manifest.tensors)
    for fqn, rec in manifest.tensors.items():
        array = group[fqn]
        assert list(array.shape) == rec.shape, fqn
        assert array.attrs["shardsmith"]["dtype"] == rec.dtype
        assert np.array_equal(array[...], ckpts["full"][fqn].numpy()), fqn
    assert group["optim.step.norm.weight"].shape == ()


def test_bf16_tensors_are_uint16_bit_patterns(ckpts: dict) -> None:
    base = ckpts["base"]
    reshard(ckpts["st"], str(base / "bf16"), SAVE_DIMS, options=ReshardOptions(dtype="BF16"))
    bf16 = Store(str(base / "bf16")).child(step_dir(STEP))
    convert_format(bf16, str(base / "bf16-z"), ZARR_DIMS, "zarr")
    z = Store(str(base / "bf16-z")).child(step_dir(STEP))
    want = load_full(bf16)
    assert (
        want["norm.weight"].dtype == torch.bfloat16
        and want["optim.step.norm.weight"].dtype == torch.float32
    )
    assert_bitwise_equal(load_full(z), want, "bf16 zarr")
    array = zarr.open_group(str(Path(z.url) / "zarr"), mode="r")["tok_embeddings.weight"]
    assert array.dtype == np.uint16 and array.attrs["shardsmith"]["dtype"] == "BF16"
    got = torch.from_numpy(array[...].view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got, want["tok_embeddings.weight"])


def test_compressed_optimizer_state_round_trips_and_shrinks(ckpts: dict) -> None:
    base = Path(ckpts["z"].url)
    meta = json.loads((base / "zarr" / "optim.exp_avg.norm.weight" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
    meta = json.loads((base / "zarr" / "norm.weight" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes"]
    manifest = read_manifest(ckpts["z"])
    rec = manifest.tensors["optim.exp_avg.tok_embeddings.weight"]
    assert sum(s.nbytes for s in rec.shards) < rec.nbytes / 2  # few distinct values: compresses
    assert sum(s.nbytes for s in manifest.tensors["tok_embeddings.weight"].shards) == 256 * 32 * 4


# ---- integrity ------------------------------------------------------------------------------


def test_verify_passes_and_names_a_corrupt_or_missing_chunk(ckpts: dict, tmp_path: Path) -> None:
    report = verify_checkpoint(ckpts["z"])
    assert report.ok, report.problems
    manifest = read_manifest(ckpts["z"])
    assert report.num_files == len(manifest.files) and not report.extra_files
    convert_format(ckpts["st"], str(tmp_path), ZARR_DIMS, "zarr")
    step = Store(str(tmp_path)).child(step_dir(STEP))
    bad = read_manifest(step).tensors["layers.1.feed_forward.w2.weight"].shards[1].file
    path = Path(step.url) / bad
    data = bytearray(path.read_bytes())
    data[5] ^= 0x40
    path.write_bytes(bytes(data))
    report = verify_checkpoint(step)
    assert report.bad_files == [bad]
    out = CliRunner().invoke(cli, ["verify", step.url])
    assert out.exit_code != 0 and bad in out.output
    with pytest.raises(IntegrityError, match=bad.replace(".", r"\.")):
        load_full(step)
    path.unlink()
    assert verify_checkpoint(step).bad_files == [bad]
    with pytest.raises(IntegrityError, match="missing"):
        load_full(step)


def test_hostile_codec_in_metadata_is_refused(ckpts: dict, tmp_path: Path) -> None:
    convert_format(ckpts["st"], str(tmp_path), ZARR_DIMS, "zarr")
    step = Store(str(tmp_path)).child(step_dir(STEP))
    key = "zarr/norm.weight/zarr.json"
    meta = json.loads(step.read(key))
    meta["codecs"].append({"name": "numcodecs.pickle", "configuration": {}})
    raw = json.dumps(meta).encode()
    step.write(key, raw)
    manifest = read_manifest(step)  # a forged manifest: checksums match
    manifest.files[key] = FileRecord(nbytes=len(raw), crc32c=crc32c(raw))
    step.write(MANIFEST_NAME, dumps_manifest(manifest))
    with pytest.raises(IntegrityError, match="unsupported codec"):
        read_box(step, read_manifest(step), "norm.weight", Box((0,), (32,)))


def test_ls_and_gc_handle_zarr_steps(ckpts: dict, tmp_path: Path) -> None:
    root = Store(str(tmp_path))
    for step in (1, 2):
        save_offline(root, step, ParallelDims(), full_tensors(seed=step))
        convert_format(root.child(step_dir(step)), str(tmp_path / "z"), ParallelDims(tp=2), "zarr")
    zroot = Store(str(tmp_path / "z"))
    summaries = describe_steps(zroot)
    assert [(s.step, s.status) for s in summaries] == [(1, "committed"), (2, "committed")]
    assert summaries[0].num_files == len(read_manifest(zroot.child(step_dir(1))).files) + 1
    gc(zroot, keep_last=1)
    assert not (tmp_path / "z" / step_dir(1)).exists()
    assert verify_checkpoint(zroot.child(step_dir(2))).ok


# ---- the trainer's save path -----------------------------------------------------------------


def test_trainer_saves_zarr_sync_and_async(
    gloo_group, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dims = ParallelDims()
    specs = checkpoint_specs(MODEL, dims)
    full = _compressible(full_tensors(seed=3, with_optimizer=True))
    writes: list[str] = []
    real_write_parts = Store.write_parts
    monkeypatch.setattr(
        Store,
        "write_parts",
        lambda self, key, parts: (
            writes.append(self.url_of(key)),
            real_write_parts(self, key, parts),
        )[1],
    )
    root = Store(str(tmp_path))
    save_checkpoint(
        root,
        4,
        dict(full),
        model_cfg=MODEL,
        dims=dims,
        config={},
        state={"step": 4},
        tensor_format="zarr",
        zarr_codec="zstd",
    )
    saver = AsyncCheckpointer(root, MODEL, dims, tensor_format="zarr")
    saver.save(6, dict(full), config={}, state={"step": 6})
    saver.wait()
    for step in (4, 6):
        step_store = root.child(step_dir(step))
        manifest = read_manifest(step_store)
        assert manifest.tensor_format == "zarr" and verify_checkpoint(step_store).ok
        on_disk = {
            str(p.relative_to(step_store.url))
            for p in Path(step_store.url).rglob("*")
            if p.is_file()
        }
        assert on_disk == set(manifest.files) | {MANIFEST_NAME}
        mine = [w for w in writes if w.startswith(step_store.url + "/")]
        assert mine[-1] == step_store.url_of(MANIFEST_NAME)  # the commit marker is last
        assert sum(w.endswith("zarr.json") for w in mine) == len(specs) + 1
        out = {f: torch.zeros_like(t) for f, t in full.items()}
        load_into(
            step_store,
            manifest,
            out,
            rank_boxes(specs, dims, 0),
            {f: s.shape for f, s in specs.items()},
        )
        assert_bitwise_equal(out, full, f"trainer zarr step {step}")
    codecs = json.loads(
        (tmp_path / step_dir(4) / "zarr" / "optim.exp_avg_sq.norm.weight" / "zarr.json").read_text()
    )
    assert codecs["codecs"][-1]["name"] == "zstd"


@pytest.mark.distributed
def test_training_job_saves_and_loads_zarr(tmp_path: Path, data_path: str) -> None:
    """One launch, tp2 x pp2 (4 processes): train 2 steps saving zarr (zstd); a fresh job
    loads that checkpoint and saves it again (zarr)."""
    from conftest import run_torchrun, tiny_train_config

    dims = ParallelDims(pp=2, tp=2)
    cfg = tiny_train_config(dims, data_path)
    cfg = dataclasses.replace(
        cfg, checkpoint=CheckpointConfig(tensor_format="zarr", zarr_codec="zstd")
    )
    trained, reloaded = tmp_path / "trained", tmp_path / "reloaded"
    spec = {
        "config": cfg.to_json(),
        "tasks": [
            {
                "kind": "train",
                "steps": 2,
                "ckpt": str(trained),
                "save_interval": 2,
                "out": str(tmp_path / "m.json"),
            },
            {"kind": "reload", "src": str(trained / step_dir(2)), "dst": str(reloaded)},
        ],
    }
    run_torchrun(spec, 4, tmp_path, "zarr").check()
    step_store = Store(str(trained)).child(step_dir(2))
    manifest = read_manifest(step_store)
    assert manifest.tensor_format == "zarr"
    report = verify_checkpoint(step_store)
    assert report.ok and not report.extra_files, report.problems
    full = load_full(step_store)
    assert float(full["optim.step.norm.weight"]) == 2.0
    assert_bitwise_equal(load_full(Store(str(reloaded)).child(step_dir(2))), full, "reloaded")
    group_ = zarr.open_group(str(Path(step_store.url) / "zarr"), mode="r")
    for fqn, tensor in full.items():
        assert group_[fqn].shape == tuple(tensor.shape) and np.array_equal(
            group_[fqn][...], tensor.numpy()
        )
    # every chunk of a box written by its one writer: the wq chunks are the tp halves
    assert [s.lengths for s in manifest.tensors["layers.0.attention.wq.weight"].shards] == [
        [16, 32],
        [16, 32],
    ]
