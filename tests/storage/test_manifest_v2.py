"""Manifest version 2: sidecars, the head + index layout, partial reads that read only what a
rank loads (counted), hostile version-2 documents, the version-1 fixture, and
``write_assignment`` against the rank-by-rank algorithm it replaced."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from ckpt_factory import (
    FILE0,
    FILE1,
    MODEL,
    flip_byte,
    full_tensors,
    load_full,
    make_checkpoint,
    memory_root,
    save_offline,
)
from conftest import FIXTURES

from shardsmith.errors import IntegrityError, ManifestError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.assignment import TINY_BOX_SHARE, write_assignment
from shardsmith.layout.box import Box
from shardsmith.layout.dtypes import DTYPE_NBYTES
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.reshard.api import reshard
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.formats.registry import read_box, read_boxes
from shardsmith.storage.manifest import read as manifest_read
from shardsmith.storage.manifest.parse import parse_manifest
from shardsmith.storage.manifest.read import ManifestReader
from shardsmith.storage.manifest.records import MANIFEST_NAME, sidecar_name
from shardsmith.storage.manifest.v2 import PREFIX_NBYTES, PREFIXES, dumps_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint

PREFIX = PREFIXES[3]

FIXTURE = FIXTURES / "v1-ckpt"
STEP = 4


class CountingStore(Store):
    """A Store that counts the bytes read per object (every read path goes through read_range/read)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads: dict[str, int] = {}

    def child(self, key: str) -> "CountingStore":
        return CountingStore(self.url_of(key))

    def read_range(self, key: str, start: int, end: int) -> bytes:
        data = super().read_range(key, start, end)
        self.reads[key] = self.reads.get(key, 0) + len(data)
        return data

    def read(self, key: str) -> bytes:
        data = super().read(key)
        self.reads[key] = self.reads.get(key, 0) + len(data)
        return data


# ---- the document -----------------------------------------------------------------------


def test_document_is_one_json_whose_index_tiles_the_tensors() -> None:
    root = memory_root()
    make_checkpoint(root, STEP)
    raw = root.child(step_dir(STEP)).read(MANIFEST_NAME)
    doc = json.loads(raw)  # one valid JSON document
    assert raw.startswith(PREFIXES[3]) and doc["version"] == 3 and raw.endswith(b'},"grids":{}}')
    head_nbytes = doc["head_nbytes"]
    assert raw[head_nbytes - len(b'"tensors":{') : head_nbytes] == b'"tensors":{'
    body = raw[head_nbytes:]
    for fqn, (start, end) in doc["index"].items():  # two shards per tensor: no grids
        assert json.loads(b"{" + body[start:end] + b"}") == {fqn: doc["tensors"][fqn]}
    assert [f[0] for f in doc["files"]] == sorted(
        [FILE0, sidecar_name(FILE0), FILE1, sidecar_name(FILE1)]
    )
    shard = doc["tensors"]["w"]["shards"][0]
    assert {k: v for k, v in shard.items() if k not in ("byte_offset", "crc")} == {
        "file": FILE0,
        "key": "w",
        "offsets": [0, 0],
        "lengths": [3, 4],
    }  # nbytes: the box's raw size
    assert isinstance(shard["crc"], int) and "crc32c" not in shard  # CRCs in the sidecar
    assert (
        '"vocab_size": ' in raw[:head_nbytes].decode() or '"model": {' in raw[:head_nbytes].decode()
    )
    manifest = parse_manifest(raw, "m")
    assert dumps_manifest(manifest) == raw  # round trip, byte for byte


def test_sidecar_holds_the_chunk_crcs_in_file_order() -> None:
    root = memory_root()
    make_checkpoint(root, STEP)
    step_store = root.child(step_dir(STEP))
    manifest = read_manifest(step_store)
    side = step_store.read(sidecar_name(FILE0))
    shards = sorted(
        (s for t in manifest.tensors.values() for s in t.shards if s.file == FILE0 and s.nbytes),
        key=lambda s: s.byte_offset,
    )
    assert [s.crc_index for s in shards] == [
        0,
        *torch.tensor([s.num_chunks(16) for s in shards]).cumsum(0)[:-1].tolist(),
    ]
    assert len(side) == 4 * sum(s.num_chunks(16) for s in shards)
    assert manifest.files[sidecar_name(FILE0)].nbytes == len(side)


# ---- partial reads ------------------------------------------------------------------------


def _pp_checkpoint(tmp_path: Path) -> tuple[CountingStore, dict[str, torch.Tensor]]:
    full = full_tensors(with_optimizer=True)
    save_offline(Store(str(tmp_path)), STEP, ParallelDims(pp=2, tp=2), full)
    return CountingStore(str(tmp_path / step_dir(STEP))), full


def test_rank_reads_only_the_metadata_of_what_it_loads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(manifest_read, "PROBE_NBYTES", 256)  # a tiny step: no whole-head probe
    monkeypatch.setattr(manifest_read, "MERGE_GAP_NBYTES", 0)
    store, full = _pp_checkpoint(tmp_path)
    size = store.size(MANIFEST_NAME)
    dims = ParallelDims(pp=2, dp_shard=2)  # resharding load, stage 1 rank
    boxes = rank_boxes(checkpoint_specs(MODEL, dims), dims, dims.world_size - 1)
    reader = ManifestReader(store)
    manifest = reader.manifest(boxes)
    assert manifest.partial and sorted(manifest.tensors) == sorted(boxes)
    assert set(manifest.tensor_names) == set(full)
    head = reader.head
    assert head is not None
    wanted = sum(head.index[f][1] - head.index[f][0] for f in boxes)
    assert store.reads[MANIFEST_NAME] == reader.count.nbytes
    assert reader.count.nbytes <= max(head.nbytes, 256) + wanted
    assert reader.count.nbytes < size  # not the whole document
    whole = read_manifest(store)
    assert all(manifest.tensors[f] == whole.tensors[f] for f in boxes)
    # the data and the chunk CRCs of exactly the shards read
    store.reads.clear()
    requests = [(f, b, None) for f, b in boxes.items() if b.numel]
    got = read_boxes(store, manifest, requests)
    for (fqn, box, _), t in zip(requests, got):
        assert torch.equal(
            t, full[fqn][box.relative_to(Box((0,) * len(box.lengths), tuple(full[fqn].shape)))]
        )
    touched = {s.file: 0 for t in manifest.tensors.values() for s in t.shards if s.crc32c}
    for t in manifest.tensors.values():
        for s in t.shards:
            if s.crc32c:
                touched[s.file] += 4 * len(s.crc32c)
    sidecar_reads = {k: v for k, v in store.reads.items() if k.endswith(".crc32c")}
    assert sidecar_reads and all(
        sidecar_reads[sidecar_name(f)] <= n + 4096 for f, n in touched.items()
    )


def test_partial_manifest_of_a_version1_step_and_missing_names() -> None:
    store = CountingStore(str(FIXTURE / step_dir(3)))
    manifest = read_manifest(store, fqns=["tok_embeddings.weight", "no.such.tensor"])
    assert manifest.version == 1 and list(manifest.tensors) == ["tok_embeddings.weight"]
    assert "norm.weight" in manifest.tensor_names


# ---- version 1 keeps loading --------------------------------------------------------------


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        f: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for f, t in tensors.items()
    }


def test_version1_fixture_loads_verifies_reshards(tmp_path: Path) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    src_root = tmp_path / "v1"
    shutil.copytree(FIXTURE, src_root)
    step_store = Store(str(src_root / step_dir(3)))
    assert read_manifest(step_store).version == 1
    assert _digests(load_full(step_store)) == expected["sha256"]
    report = verify_checkpoint(step_store)
    assert report.ok and report.num_files == 4, report.problems
    reshard(step_store, str(tmp_path / "v2"), ParallelDims(tp=1, pp=1, dp_shard=1))
    out = Store(str(tmp_path / "v2" / step_dir(3)))
    assert read_manifest(out).version == 3
    assert _digests(load_full(out)) == expected["sha256"]
    assert verify_checkpoint(out).ok
    from click.testing import CliRunner

    from shardsmith.cli.main import cli

    result = CliRunner().invoke(cli, ["inspect", "--json", str(src_root / step_dir(3))])
    assert result.exit_code == 0 and json.loads(result.output)["version"] == 1


# ---- integrity of the sidecars ------------------------------------------------------------


def test_damaged_or_missing_sidecar_refused_and_named() -> None:
    root = memory_root()
    full = make_checkpoint(root, STEP)
    step_store = root.child(step_dir(STEP))
    w1 = read_manifest(step_store).tensors["w"].shards[1]
    assert w1.file == FILE1
    flip_byte(step_store, sidecar_name(FILE1), 4 * w1.crc_index)
    manifest = read_manifest(step_store)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        read_box(step_store, manifest, "w", Box((3, 0), (3, 4)))
    assert torch.equal(
        read_box(step_store, read_manifest(step_store), "b", Box((0,), (5,))), full["b"]
    )
    report = verify_checkpoint(step_store)
    assert sidecar_name(FILE1) in report.bad_files and FILE1 in report.bad_files
    step_store.delete(sidecar_name(FILE1))
    with pytest.raises(IntegrityError, match=f"{sidecar_name(FILE1)}: missing"):
        read_box(step_store, read_manifest(step_store), "w", Box((3, 0), (3, 4)))
    assert sidecar_name(FILE1) in verify_checkpoint(step_store).bad_files


def test_verify_workers_give_the_same_report(tmp_path: Path) -> None:
    store, _ = _pp_checkpoint(tmp_path)
    one = verify_checkpoint(store, files_per_pass=1)
    assert (
        one.ok
        and one.num_files == 8
        and one.nbytes_checked == sum(store.size(f) for f in store.walk() if f != MANIFEST_NAME)
    )
    flip_byte(store, "shards/rank-00001.safetensors", -1)
    bad = verify_checkpoint(store, workers=2)
    assert bad.bad_files == ["shards/rank-00001.safetensors"]
    assert bad.problems == verify_checkpoint(store).problems


# ---- hostile version-2 documents ----------------------------------------------------------


def encode_doc(
    doc: dict[str, Any], index_fn: Callable[[dict], None] | None = None, *, extra: bytes = b""
) -> bytes:
    """A version-2 or -3 document of ``doc`` (parsed JSON, without grids) laid out as the
    writer does, index recomputed."""
    entries, index, pos = [], {}, 0
    for fqn, value in doc["tensors"].items():
        entry = (json.dumps(fqn) + ":" + json.dumps(value, separators=(",", ":"))).encode()
        index[fqn] = [pos, pos + len(entry)]
        entries.append(entry)
        pos += len(entry) + 1
    if index_fn:
        index_fn(index)
    readable = {
        k: v
        for k, v in doc.items()
        if k not in ("format", "version", "head_nbytes", "files", "index", "tensors", "grids")
    }
    compact = {"files": doc["files"], "index": index}
    tail = (
        json.dumps(readable)[1:-1] + "," + json.dumps(compact, separators=(",", ":"))[1:-1]
    ).encode() + b',"tensors":{'
    end = b'},"grids":{}}' if doc["version"] == 3 else b"}}"
    return (
        PREFIXES[doc["version"]]
        + f"{PREFIX_NBYTES + len(tail):>16},".encode()
        + tail
        + b",".join(entries)
        + extra
        + end
    )


@pytest.fixture(scope="module")
def valid2() -> tuple[Store, dict[str, Any], bytes]:
    root = memory_root()
    make_checkpoint(root, STEP)
    step_store = root.child(step_dir(STEP))
    raw = step_store.read(MANIFEST_NAME)
    return step_store, json.loads(raw), raw


def _shard(i_tensor: str, i: int, key: str, value: Any) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        doc["tensors"][i_tensor]["shards"][i][key] = value

    return mutate


def _file(name: str) -> int:
    return sorted([FILE0, sidecar_name(FILE0), FILE1, sidecar_name(FILE1)]).index(name)


CASES2: list[tuple[str, Callable[[dict], Any], str, str]] = [
    (
        "sidecar_range_outside",
        _shard("w", 0, "crc", 1000),
        "tensors['w'].shards[0].crc32c",
        "lie outside sidecar",
    ),
    (
        "sidecar_unlisted",
        lambda d: d.__setitem__("files", [f for f in d["files"] if f[0] != sidecar_name(FILE0)]),
        "tensors['",
        "which is not listed in files",
    ),
    (
        "shard_in_a_sidecar",
        _shard("b", 0, "file", sidecar_name(FILE0)),
        "tensors['b'].shards[0].file",
        "is a checksum sidecar",
    ),
    (
        "sidecar_ranges_overlap",
        lambda d: d["tensors"]["h"]["shards"][0].__setitem__(
            "crc", d["tensors"]["w"]["shards"][0]["crc"]
        ),
        ".crc32c",
        "overlap those of",
    ),
    (
        "sidecar_file_outside",
        lambda d: d["files"][_file(sidecar_name(FILE0))].__setitem__(0, "../x.crc32c"),
        "files[",
        "points outside",
    ),
    (
        "file_unlisted",
        _shard("w", 0, "file", "shards/nowhere.safetensors"),
        "tensors['w']",
        "not listed in files",
    ),
    (
        "file_outside",
        _shard("w", 0, "file", "../x.safetensors"),
        "tensors['w'].shards[0].file",
        "points outside",
    ),
    (
        "both_crc_forms",
        _shard("w", 0, "crc32c", [1]),
        "tensors['w'].shards[0]",
        "exactly one of crc (index",
    ),
    (
        "file_listed_twice",
        lambda d: d["files"].append(list(d["files"][0])),
        "files[4]",
        "listed twice",
    ),
    (
        "shard_lengths",
        _shard("w", 0, "lengths", None),
        "tensors['w'].shards[0].lengths",
        "expected a list",
    ),
    (
        "shard_missing_field",
        lambda d: d["tensors"]["w"]["shards"][0].pop("key"),
        "tensors['w'].shards[0]",
        "missing fields ['key']",
    ),
    (
        "shard_nbytes_wrong",
        _shard("w", 0, "nbytes", 7),
        "tensors['w'].shards[0].nbytes",
        "but the box holds",
    ),
    (
        "sidecar_size",
        lambda d: d["files"][_file(sidecar_name(FILE0))].__setitem__(1, 4096),
        f"files['{sidecar_name(FILE0)}']",
        "checksums of 4 bytes",
    ),
]


@pytest.mark.parametrize(
    "mutate, where, fragment", [c[1:] for c in CASES2], ids=[c[0] for c in CASES2]
)
def test_hostile_v2_records_refused_whole_and_partial(valid2, mutate, where, fragment) -> None:
    step_store, doc, raw = valid2
    assert encode_doc(doc) == raw
    doc = copy.deepcopy(doc)
    mutate(doc)
    bad = encode_doc(doc)
    with pytest.raises(ManifestError) as info:
        parse_manifest(bad, "m.json")
    assert where in str(info.value) and fragment in str(info.value), str(info.value)
    if fragment == "checksums of 4 bytes":
        return  # needs the whole step: commit / verify
    store = memory_root().child(step_dir(STEP))
    store.write(MANIFEST_NAME, bad)
    with pytest.raises(ManifestError, match="do not load it"):
        ManifestReader(store).manifest(["w", "h", "b", "s"])


def _index(fn: Callable[[dict], None]) -> Callable[[dict], bytes]:
    return lambda doc: encode_doc(doc, fn)


def _swap(index: dict) -> None:
    """The first two names swapped, the ranges kept in order: each points at the other's entry."""
    (a, ra), (b, rb), *rest = index.items()
    index.clear()
    index.update({b: ra, a: rb, **dict(rest)})


CASES_INDEX: list[tuple[str, Callable[[dict], bytes], str, str]] = [
    (
        "index_outside_file",
        _index(lambda i: i.__setitem__("w", [10**6, 10**6 + 10])),
        "index['w']",
        "[1000000, ",
    ),
    (
        "index_overlap",
        _index(lambda i: i.__setitem__("w", [i["h"][0] + 1, i["w"][1]])),
        "index",
        "overlap",
    ),
    (
        "index_empty_range",
        _index(lambda i: i.__setitem__("s", [5, 5])),
        "index['s']",
        "start < end",
    ),
    ("index_other_tensor", _index(_swap), "index", "points at the entry of"),
    (
        "index_missing_tensor",
        _index(lambda i: i.pop("w")),
        "tensors",
        "every tensor must be in the index",
    ),
    (
        "unindexed_tail",
        lambda d: encode_doc(d, extra=b',"zz":{}'),
        "tensors",
        "every tensor must be in the index",
    ),
    (
        "head_nbytes_wrong",
        lambda d: encode_doc(d).replace(PREFIX + b" ", PREFIX + b"1", 1),
        "head_nbytes",
        "",
    ),
    (
        "head_nbytes_text",
        lambda d: encode_doc(d)[: len(PREFIX)] + b"x" * 16 + encode_doc(d)[PREFIX_NBYTES - 1 :],
        "head_nbytes",
        "does not begin with a version-2 head",
    ),
]


@pytest.mark.parametrize(
    "make, where, fragment", [c[1:] for c in CASES_INDEX], ids=[c[0] for c in CASES_INDEX]
)
def test_hostile_v2_index_refused(valid2, make, where, fragment) -> None:
    _, doc, _ = valid2
    bad = make(copy.deepcopy(doc))
    with pytest.raises(ManifestError) as info:
        parse_manifest(bad, "m.json")
    assert f"{where}" in str(info.value) and fragment in str(info.value), str(info.value)
    store = memory_root().child(step_dir(STEP))
    store.write(MANIFEST_NAME, bad)
    if make is CASES_INDEX[4][1] or "unindexed" in repr(make):
        return  # a partial reader never looks past its tensors
    with pytest.raises(ManifestError):
        reader = ManifestReader(store)
        reader.manifest(["w", "h", "b", "s"])
        list(reader.iter_tensors())
    assert verify_checkpoint(store).bad_files == [MANIFEST_NAME]


# ---- write_assignment ----------------------------------------------------------------------


def _assignment_by_ranks(specs: dict, dims: ParallelDims) -> dict[int, list[tuple[str, Box]]]:
    """write_assignment's rule the slow way: every rank x every tensor, then a sort (tiny boxes to
    their lowest holder, the others by greedy LPT over their holders)."""
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank in range(dims.world_size):
        for fqn, box in rank_boxes(specs, dims, rank).items():
            if not box.is_empty:
                holders.setdefault((fqn, box), []).append(rank)

    def nbytes(key: tuple[str, Box]) -> int:
        return key[1].numel * DTYPE_NBYTES[specs[key[0]].dtype]

    tiny = sum(map(nbytes, holders)) * TINY_BOX_SHARE / dims.world_size
    out: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(dims.world_size)}
    for key in sorted(
        holders, key=lambda k: (k[0], k[1].offsets)
    ):  # tiny boxes: their lowest holder
        if nbytes(key) <= tiny:
            out[min(holders[key])].append(key)
    big = sorted(
        (k for k in holders if nbytes(k) > tiny), key=lambda k: (-nbytes(k), k[0], k[1].offsets)
    )
    load = [0] * dims.world_size
    for key in big:
        writer = min(holders[key], key=lambda r: (load[r], r))
        load[writer] += nbytes(key)
        out[writer].append(key)
    for items in out.values():
        items.sort(key=lambda k: k[0])
    return out


@pytest.mark.parametrize(
    "model, dims",
    [
        (
            ModelConfig(
                num_layers=4,
                hidden_size=64,
                num_attention_heads=8,
                num_kv_heads=2,
                ffn_hidden_size=96,
                vocab_size=250,
                seq_length=8,
                tie_embeddings=True,
            ),
            ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=4),
        ),
        (
            ModelConfig(
                num_layers=3,
                hidden_size=32,
                num_attention_heads=4,
                num_kv_heads=1,
                ffn_hidden_size=64,
                vocab_size=257,
                seq_length=8,
            ),
            ParallelDims(pp=3, dp_replicate=3, dp_shard=3, tp=4),
        ),
        (MODEL, ParallelDims(dp_shard=7)),
        (MODEL, ParallelDims(pp=2, tp=2, dp_replicate=2)),
    ],
    ids=["tied_gqa_hsdp", "gqa_tp_gt_kv_uneven", "dp_shard_7", "pp_tp_dpr"],
)
def test_write_assignment_matches_rank_by_rank(model, dims) -> None:
    specs = checkpoint_specs(model, dims)
    assert write_assignment(specs, dims) == _assignment_by_ranks(specs, dims)


def test_positional_shard_records_of_the_first_v2_writers_still_parse() -> None:
    """Checkpoints written before shard records were named keep loading, to the same manifest."""
    root = memory_root()
    make_checkpoint(root, STEP)
    raw = root.child(step_dir(STEP)).read(MANIFEST_NAME)
    doc = json.loads(raw)
    names = [f[0] for f in doc["files"]]
    for fqn, t in doc["tensors"].items():
        t["shards"] = [
            [
                names.index(s["file"]),
                s["byte_offset"],
                DTYPE_NBYTES[t["dtype"]] * math.prod(s["lengths"]),
                s["crc"],
                s["offsets"],
                s["lengths"],
            ]
            + ([s["key"]] if s["key"] != fqn else [])
            for s in t["shards"]
        ]
    old = parse_manifest(encode_doc(doc), "old")
    assert old.tensors == parse_manifest(raw, "new").tensors
