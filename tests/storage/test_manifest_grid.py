"""Manifest version 3's shard grids: a rank reads the records of the cells its box meets, the
same records a whole parse sees; version-2 documents still load; hostile grids are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_factory import MODEL, assert_bitwise_equal, full_tensors, load_full, save_offline

from shardsmith.errors import ManifestError
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box, bounding_box
from shardsmith.layout.sharding import checkpoint_specs, rank_boxes
from shardsmith.storage.commit import step_dir
from shardsmith.storage.manifest import grid as manifest_grid
from shardsmith.storage.manifest.parse import parse_manifest
from shardsmith.storage.manifest.read import ManifestReader
from shardsmith.storage.manifest.records import MANIFEST_NAME
from shardsmith.storage.manifest.v2 import PREFIXES, dumps_manifest
from shardsmith.storage.store.fs import Store

DIMS = ParallelDims(tp=4, dp_shard=4)  # 2-d weights: 16 shards, a 4 x 4 or 16 x 1 grid
STEP = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, dict, bytes]:
    root = Store(str(tmp_path_factory.mktemp("grid")))
    full = full_tensors(MODEL, with_optimizer=True)
    save_offline(root, STEP, DIMS, full)
    step_store = root.child(step_dir(STEP))
    return step_store, full, step_store.read(MANIFEST_NAME)


def test_gridded_document_is_version_2_json_plus_grids(saved) -> None:
    _, _, raw = saved
    doc = json.loads(raw)
    assert doc["version"] == 3 and raw.startswith(PREFIXES[3])
    gridded = {f for f, span in doc["index"].items() if len(span) == 4}
    assert gridded and set(doc["grids"]) == gridded
    w = "layers.0.attention.wq.weight"  # colwise: TP and FSDP both cut dim 0
    assert w in gridded and doc["grids"][w]["split"] == [MODEL.hidden_size // 16, MODEL.hidden_size]
    body = raw[doc["head_nbytes"] :]
    for fqn, span in doc["index"].items():  # every record still named in "tensors"
        assert json.loads(b"{" + body[span[0] : span[1]] + b"}") == {fqn: doc["tensors"][fqn]}
        if len(span) == 4:
            assert json.loads(b"{" + body[span[2] : span[3]] + b"}") == {fqn: doc["grids"][fqn]}
    whole = parse_manifest(raw, "m.json")
    assert all(len(whole.tensors[f].shards) == 16 for f in gridded)


@pytest.mark.parametrize(
    "layout", [DIMS, ParallelDims(tp=2, dp_shard=8), ParallelDims(tp=1, dp_shard=1)]
)
def test_partial_read_holds_exactly_the_cells_a_box_meets(saved, layout: ParallelDims) -> None:
    step_store, full, raw = saved
    whole = parse_manifest(raw, "m.json")
    specs = checkpoint_specs(MODEL, layout, with_optimizer=True)
    for rank in {0, layout.world_size - 1}:
        boxes = rank_boxes(specs, layout, rank)
        reader = ManifestReader(step_store)
        part = reader.manifest(boxes)
        for fqn, box in boxes.items():  # tensors without a grid: whole entries
            gridded = len(reader.head.index[fqn]) == 4
            want = [
                s
                for s in whole.tensors[fqn].shards
                if not gridded or box.intersect(s.box) is not None
            ]
            assert sorted(part.tensors[fqn].shards, key=lambda s: s.offsets) == want, (fqn, rank)


def test_load_through_grids_is_bitwise_and_version2_still_loads(saved, tmp_path: Path) -> None:
    step_store, full, raw = saved
    assert_bitwise_equal(load_full(step_store), full, "version 3")
    v2 = Store(str(tmp_path / "v2"))
    saved_min = manifest_grid.GRID_MIN_SHARDS
    manifest_grid.GRID_MIN_SHARDS = 10**9  # no grids: the version-2 layout
    try:
        doc = dumps_manifest(parse_manifest(raw, "m.json"))
    finally:
        manifest_grid.GRID_MIN_SHARDS = saved_min
    assert doc.endswith(b'},"grids":{}}')
    doc = PREFIXES[2] + doc[len(PREFIXES[3]) : -len(b'},"grids":{}}')] + b"}}"
    for name in step_store.walk():
        v2.write(name, doc if name == MANIFEST_NAME else step_store.read(name))
    reader = ManifestReader(v2)
    assert reader.head.version == 2
    boxes = rank_boxes(checkpoint_specs(MODEL, DIMS, with_optimizer=True), DIMS, 0)
    part = reader.manifest(boxes)  # boxes given, but no grids: whole entries
    assert all(
        len(part.tensors[f].shards) == len(parse_manifest(raw, "m").tensors[f].shards)
        for f in boxes
    )
    assert_bitwise_equal(load_full(v2), full, "version 2")


def _mutate_grid(raw: bytes, fqn: str, change) -> bytes:
    """``raw`` with the grid entry of ``fqn`` replaced by ``change(grid)`` (same length or not:
    only the grid section moves, so later grid positions are shifted in the index)."""
    doc = json.loads(raw)
    head_nbytes = doc["head_nbytes"]
    span = doc["index"][fqn]
    old = raw[head_nbytes + span[2] : head_nbytes + span[3]]
    new = (
        json.dumps(fqn) + ":" + json.dumps(change(dict(doc["grids"][fqn])), separators=(",", ":"))
    ).encode()
    assert len(new) == len(old), "keep the length: the index is left as it is"
    return raw[: head_nbytes + span[2]] + new + raw[head_nbytes + span[3] :]


W = "layers.0.attention.wq.weight"


@pytest.mark.parametrize(
    "name, change, fragment",
    [
        ("at_mid_record", lambda g: {**g, "at": [g["at"][0] + 1] + g["at"][1:]}, ""),
        (
            "split_not_a_split",
            lambda g: {**g, "split": [g["split"][0] + 1, g["split"][1]]},
            "grid block holds",
        ),
        ("cells_transposed", lambda g: {**g, "split": g["split"][::-1]}, "not its grid cell"),
    ],
)
def test_hostile_grid_refused_whole_and_partial(
    saved, tmp_path: Path, name, change, fragment
) -> None:
    step_store, _, raw = saved
    try:
        bad = _mutate_grid(raw, W, change)
    except AssertionError:
        pytest.skip("mutation changes the entry's length")
    with pytest.raises(ManifestError) as whole:
        parse_manifest(bad, "m.json")
    store = Store(str(tmp_path / "bad"))
    store.write(MANIFEST_NAME, bad)
    with pytest.raises(ManifestError) as partial:
        ManifestReader(store).manifest({W: Box((0, 0), (MODEL.hidden_size, MODEL.hidden_size))})
    assert fragment in str(whole.value) and fragment in str(partial.value), (
        whole.value,
        partial.value,
    )


def test_grid_bounds_and_cells() -> None:
    boxes = [Box((0, 0), (2, 3)), Box((0, 3), (2, 3)), Box((2, 0), (1, 3)), Box((2, 3), (1, 3))]
    assert bounding_box(boxes) == Box((0, 0), (3, 6))
    grid = manifest_grid.Grid([3, 6], "F32", [[0, 2, 3], [0, 3, 6]], [0, 10])
    assert manifest_grid.cells_for(grid, Box((1, 2), (2, 2))) == [0, 1, 2, 3]
    assert manifest_grid.cells_for(grid, Box((2, 3), (1, 3))) == [3]
    assert manifest_grid.cells_for(grid, Box((0, 0), (0, 3))) == []
    assert grid.cell_box(2) == ([2, 0], [1, 3])
    assert manifest_grid._split_json([0, 4, 8, 10]) == 4 and manifest_grid._split_json(
        [0, 4, 6, 10]
    ) == [0, 4, 6, 10]
