"""Saves, reshards, format conversions and HF exports stay byte-identical across refactors.

``tests/fixtures/byte_identity.json`` holds the SHA-256 of every file written by a tiny
pipeline (storage-path save -> offline reshard -> zarr conversion -> zarr->safetensors
conversion -> HF export) as produced by the code before the storage/reshard restructure.
The test runs the same pipeline and compares. Manifests are compared after dropping their
``created`` timestamp (the only field that depends on the clock) and a reshard's source URL
(``state.run.parent.url``, a temporary path).

Regenerate (only when a format change is intended): run this file with ``python``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from shardsmith.layout import ParallelDims
from shardsmith.reshard.api import reshard
from shardsmith.reshard.foreign.hf_io import export_hf
from shardsmith.reshard.planner import ReshardOptions
from shardsmith.reshard.zarr_convert import convert_format
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.manifest.records import SIDECAR_SUFFIX
from shardsmith.storage.manifest.sidecar import load_chunk_crcs
from shardsmith.storage.store.fs import Store

TESTS_DIR = next(p for p in Path(__file__).resolve().parents if p.name == "tests")
sys.path[:0] = [str(TESTS_DIR / "helpers"), str(TESTS_DIR)]  # also when run as a script
from ckpt_factory import full_tensors, save_offline  # noqa: E402

FIXTURE = TESTS_DIR / "fixtures" / "byte_identity.json"
STEP = 3


def _version1_view(step: Path) -> bytes:
    """A step's manifest as the version-1 document it stands for: chunk CRCs fetched from
    the sidecars back inline, the sidecars left out of the file table (the fixture predates
    version 2; the content must not have changed)."""
    store = Store(str(step))
    manifest = read_manifest(store)
    load_chunk_crcs(
        store, manifest.chunk_nbytes, [s for t in manifest.tensors.values() for s in t.shards]
    )
    manifest.files = {k: v for k, v in manifest.files.items() if not k.endswith(SIDECAR_SUFFIX)}
    manifest.version = 1
    doc = manifest.to_json()
    doc.pop("created", None)
    parent = doc.get("state", {}).get("run", {}).get("parent") or {}
    parent.pop("url", None)  # a reshard's source URL: the machine's temp path
    return json.dumps(doc, sort_keys=True).encode()


def _digest(path: Path) -> str:
    data = _version1_view(path.parent) if path.name == "manifest.json" else path.read_bytes()
    return hashlib.sha256(data).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    """path -> digest of every file but the chunk-CRC sidecars (``verify`` covers those)."""
    return {
        str(p.relative_to(root)): _digest(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(SIDECAR_SUFFIX)
    }


def run_pipeline(tmp: Path) -> dict[str, str]:
    """Write every output of the pipeline under ``tmp``; path -> SHA-256."""
    full = full_tensors(seed=1, with_optimizer=True)
    save_offline(Store(str(tmp / "save")), STEP, ParallelDims(tp=2, pp=2), full)
    src = Store(str(tmp / "save")).child(step_dir(STEP))
    opts = ReshardOptions(chunk_nbytes=256, slab_nbytes=512, max_buffer_nbytes=4096, workers=2)
    reshard(src, str(tmp / "reshard"), ParallelDims(tp=1, dp_shard=2), options=opts)
    reshard(
        src,
        str(tmp / "reshard_bf16"),
        ParallelDims(tp=4),
        options=ReshardOptions(dtype="BF16", model_only=True, chunk_nbytes=128, workers=1),
    )
    convert_format(
        src,
        str(tmp / "zarr"),
        ParallelDims(tp=2, dp_shard=2),
        "zarr",
        codec="zstd",
        chunk_nbytes=256,
    )
    zsrc = Store(str(tmp / "zarr")).child(step_dir(STEP))
    convert_format(
        zsrc, str(tmp / "zarr_back"), ParallelDims(pp=2), "safetensors", chunk_nbytes=256
    )
    export_hf(str(tmp / "save"), str(tmp / "hf"), dtype="bf16")
    export_hf(str(tmp / "save"), str(tmp / "hf_sharded"), dtype="fp32", max_shard_nbytes=40_000)
    return _tree(tmp)


def test_outputs_byte_identical(tmp_path: Path) -> None:
    want = json.loads(FIXTURE.read_text())
    got = run_pipeline(tmp_path)
    assert sorted(got) == sorted(want), f"files differ: {sorted(set(got) ^ set(want))[:10]}"
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} files changed bytes, e.g. {bad[:10]}"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hashes = run_pipeline(Path(d))
    FIXTURE.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(hashes)} hashes to {FIXTURE}")
