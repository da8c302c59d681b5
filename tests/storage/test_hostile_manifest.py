"""Hostile input: every malformed or malicious manifest is refused before any data is
touched, with ``ManifestError`` naming the field and the file; data files that disagree
with their manifest are refused with ``IntegrityError``; nothing is ever unpickled."""

from __future__ import annotations

import ast
import copy
import json
import pickle
import re
from typing import Any, Callable

import pytest
import torch
from ckpt_factory import FILE0, FILE1, build_manifest, make_checkpoint, memory_root
from conftest import REPO_ROOT

from shardsmith.errors import IntegrityError, ManifestError
from shardsmith.layout.box import Box
from shardsmith.storage.commit import commit, read_manifest, step_dir
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.formats.tensor_files import encode_and_record
from shardsmith.storage.manifest.parse import parse_manifest
from shardsmith.storage.manifest.records import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint

STEP = 4
PACKAGE_DIR = REPO_ROOT


@pytest.fixture(scope="module")
def valid() -> tuple[Store, dict[str, Any]]:
    """(step store, manifest JSON) of a valid committed step, written as a version-1 manifest
    (the cases below mutate its JSON; version 2's own cases are in test_manifest_v2.py)."""
    root = memory_root()
    manifest, _ = build_manifest(root, STEP, sidecars=False)
    manifest.version = 1
    commit(root, manifest)
    step_store = root.child(step_dir(STEP))
    return step_store, json.loads(step_store.read(MANIFEST_NAME))


def _shard(doc: dict, fqn: str, i: int) -> dict:
    return doc["tensors"][fqn]["shards"][i]


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Mutation setting a dotted path (``tensors.w.shards.0.offsets``) to ``value``."""

    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _rename_file(new: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        doc["files"][new] = doc["files"].pop(FILE0)
        for t in doc["tensors"].values():
            for s in t["shards"]:
                if s["file"] == FILE0:
                    s["file"] = new

    return mutate


def _delete(path: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _pop_shard(doc: dict) -> None:
    doc["tensors"]["w"]["shards"].pop()


def _duplicate_shard(doc: dict) -> None:
    doc["tensors"]["w"]["shards"].append(copy.deepcopy(_shard(doc, "w", 0)))


def _same_bytes(doc: dict) -> None:
    """Two tensors claiming the same bytes of one file (h's shard over w's)."""
    w, h = _shard(doc, "w", 0), _shard(doc, "h", 0)
    h["byte_offset"] = w["byte_offset"]


def _same_key(doc: dict) -> None:
    _shard(doc, "h", 0)["key"] = "w"


def _shift_box(doc: dict) -> None:
    """Second half of w starts one row early: rows 2 overlap, row 5 uncovered."""
    _shard(doc, "w", 1)["offsets"] = [2, 0]


def _json_bytes(text: str) -> Callable[[dict], bytes]:
    return lambda doc: text.encode()


def _truncated_json(doc: dict) -> bytes:
    return json.dumps(doc).encode()[:-40]


def _duplicate_json_key(doc: dict) -> bytes:
    text = json.dumps(doc)
    return text.replace('"step": 4', '"step": 4, "step": 99', 1).encode()


def _huge_digits(doc: dict) -> bytes:
    return json.dumps(doc).replace('"step": 4', '"step": ' + "9" * 5000, 1).encode()


#: (id, mutation, exact ``where`` of the error, fragment of the message)
CASES: list[tuple[str, Callable, str, str]] = [
    # paths outside the checkpoint
    (
        "dotdot",
        _rename_file("../rank-00000.safetensors"),
        "files['../rank-00000.safetensors']",
        "points outside",
    ),
    (
        "dotdot_inner",
        _rename_file("shards/../../x.safetensors"),
        "files['shards/../../x.safetensors']",
        "points outside",
    ),
    ("absolute", _rename_file("/etc/passwd"), "files['/etc/passwd']", "points outside"),
    (
        "other_bucket",
        _rename_file("s3://other-bucket/x"),
        "files['s3://other-bucket/x']",
        "points outside",
    ),
    (
        "backslash",
        _rename_file("shards\\..\\..\\x"),
        "files['shards\\\\..\\\\..\\\\x']",
        "points outside",
    ),
    ("drive", _rename_file("C:/Windows/x"), "files['C:/Windows/x']", "points outside"),
    ("home", _rename_file("~/x"), "files['~/x']", "points outside"),
    ("dot_slash", _rename_file("./shards/x"), "files['./shards/x']", "points outside"),
    ("the_manifest", _rename_file(MANIFEST_NAME), "files['manifest.json']", "points outside"),
    ("empty_path", _rename_file(""), "files['']", "expected a relative file path"),
    (
        "shard_outside",
        _set("tensors.w.shards.0.file", "../../other/x"),
        "tensors['w'].shards[0].file",
        "points outside",
    ),
    (
        "shard_unlisted",
        _set("tensors.w.shards.0.file", "shards/rank-00009.safetensors"),
        "tensors['w'].shards[0].file",
        "is not listed in files",
    ),
    (
        "shard_file_type",
        _set("tensors.w.shards.0.file", 7),
        "tensors['w'].shards[0].file",
        "expected a relative file path",
    ),
    # boxes and coverage
    (
        "box_outside",
        _set("tensors.w.shards.1.offsets", [4, 0]),
        "tensors['w'].shards[1]",
        "outside shape [6, 4]",
    ),
    (
        "box_rank",
        _set("tensors.w.shards.1.lengths", [3]),
        "tensors['w'].shards[1]",
        "does not match shape",
    ),
    ("overlap", _shift_box, "tensors['w'].shards", "shards 0 and 1 overlap"),
    ("duplicate_shard", _duplicate_shard, "tensors['w'].shards", "shards 0 and 2 overlap"),
    ("missing_coverage", _pop_shard, "tensors['w'].shards", "(missing coverage)"),
    (
        "negative_offset",
        _set("tensors.w.shards.0.offsets", [-1, 0]),
        "tensors['w'].shards[0].offsets[0]",
        "-1 is outside",
    ),
    (
        "scalar_two_shards",
        lambda d: d["tensors"]["s"]["shards"].append(copy.deepcopy(_shard(d, "s", 0))),
        "tensors['s'].shards",
        "shards 0 and 1 overlap",
    ),
    # dtype / shape / byte counts
    (
        "unknown_dtype",
        _set("tensors.w.dtype", "F128"),
        "tensors['w'].dtype",
        "unknown dtype 'F128'",
    ),
    ("dtype_type", _set("tensors.w.dtype", ["F32"]), "tensors['w'].dtype", "unknown dtype"),
    (
        "dtype_mismatch",
        _set("tensors.w.dtype", "F16"),
        "tensors['w'].shards[0].nbytes",
        "48 but the box holds 12 F16 elements (24 bytes)",
    ),
    (
        "shape_mismatch",
        _set("tensors.w.shape", [6, 5]),
        "tensors['w'].shards",
        "shards hold 24 elements but the shape [6, 5] has 30",
    ),
    (
        "nbytes_mismatch",
        _set("tensors.b.shards.0.nbytes", 24),
        "tensors['b'].shards[0].nbytes",
        "24 but the box holds 5 F32 elements",
    ),
    (
        "past_file_end",
        _set("tensors.w.shards.0.byte_offset", 260),
        "tensors['w'].shards[0].byte_offset",
        f"lie outside {FILE0}",
    ),
    (
        "crc_count",
        lambda d: _shard(d, "w", 0)["crc32c"].pop(),
        "tensors['w'].shards[0].crc32c",
        "2 checksums for 3 chunks",
    ),
    (
        "shared_bytes",
        _same_bytes,
        "tensors['w'].shards[0].byte_offset",
        f"bytes of {FILE0} overlap those of tensors['h'].shards[0]",
    ),
    ("shared_key", _same_key, "tensors['w'].shards[0].key", f"key 'w' of {FILE0} is also used"),
    (
        "empty_key",
        _set("tensors.w.shards.0.key", ""),
        "tensors['w'].shards[0].key",
        "non-empty string",
    ),
    (
        "file_nbytes_negative",
        lambda d: d["files"][FILE1].__setitem__("nbytes", -5),
        f"files['{FILE1}'].nbytes",
        "-5 is outside",
    ),
    (
        "empty_fqn",
        lambda d: d["tensors"].__setitem__("", d["tensors"].pop("b")),
        "tensors['']",
        "empty tensor name",
    ),
    # versions and formats
    ("version_4", _set("version", 4), "version", "unknown format version 4"),
    ("version_2_without_head", _set("version", 2), "version", "must begin with its head"),
    ("version_3_without_head", _set("version", 3), "version", "must begin with its head"),
    ("version_str", _set("version", "1"), "version", "unknown format version '1'"),
    ("version_bool", _set("version", True), "version", "unknown format version True"),
    ("format", _set("format", "torch.save"), "format", "expected 'shardsmith.checkpoint'"),
    (
        "tensor_format",
        _set("tensor_format", "pickle"),
        "tensor_format",
        "unknown tensor format 'pickle'",
    ),
    (
        "checksum_algorithm",
        _set("checksum.algorithm", "md5"),
        "checksum.algorithm",
        "expected 'crc32c'",
    ),
    ("chunk_zero", _set("checksum.chunk_nbytes", 0), "checksum.chunk_nbytes", "0 is outside [1,"),
    ("missing_tensors", _delete("tensors"), "tensors", "missing"),
    (
        "missing_shard_field",
        _delete("tensors.w.shards"),
        "tensors['w']",
        "missing fields ['shards']",
    ),
    ("missing_layout_tp", _delete("layout.tp"), "layout.tp", "missing"),
    ("layout_zero", _set("layout.pp", 0), "layout.pp", "0 is outside [1,"),
    # JSON itself
    ("bad_json", _truncated_json, "document", "not valid JSON"),
    ("not_utf8", lambda d: b"\xff\xfe{", "document", "not valid JSON"),
    ("top_level_list", _json_bytes("[1, 2]"), "document", "expected dict, got list"),
    ("duplicate_key", _duplicate_json_key, "document", "duplicate key 'step'"),
    (
        "nan",
        lambda d: json.dumps(d).replace('"step": 4', '"step": NaN', 1).encode(),
        "document",
        "NaN is not JSON",
    ),
    ("deep_nesting", _json_bytes("[" * 100_000 + "]" * 100_000), "document", "not valid JSON"),
    ("huge_digits", _huge_digits, "document", "not valid JSON"),
    # wrong types
    ("step_bool", _set("step", True), "step", "expected an integer, got bool"),
    ("step_negative", _set("step", -4), "step", "-4 is outside"),
    (
        "offset_bool",
        _set("tensors.w.shards.0.offsets", [True, 0]),
        "tensors['w'].shards[0].offsets[0]",
        "expected an integer, got bool",
    ),
    (
        "nbytes_float",
        _set("tensors.b.shards.0.nbytes", 20.0),
        "tensors['b'].shards[0].nbytes",
        "expected an integer, got float",
    ),
    (
        "byte_offset_str",
        _set("tensors.b.shards.0.byte_offset", "12"),
        "tensors['b'].shards[0].byte_offset",
        "expected an integer, got str",
    ),
    (
        "byte_offset_negative",
        _set("tensors.b.shards.0.byte_offset", -8),
        "tensors['b'].shards[0].byte_offset",
        "-8 is outside",
    ),
    (
        "shards_not_list",
        _set("tensors.w.shards", {"0": {}}),
        "tensors['w'].shards",
        "expected list, got dict",
    ),
    ("tensor_not_dict", _set("tensors.w", [6, 4]), "tensors['w']", "expected dict, got list"),
    ("files_not_dict", _set("files", []), "files", "expected dict, got list"),
    # huge numbers
    ("huge_shape", _set("tensors.w.shape", [2**40, 2**40]), "tensors['w'].shape", "larger than"),
    (
        "huge_offset",
        _set("tensors.b.shards.0.byte_offset", 2**64),
        "tensors['b'].shards[0].byte_offset",
        "is outside [0, 9223372036854775807]",
    ),
    (
        "huge_crc",
        _set("tensors.b.shards.0.crc32c", [2**32]),
        "tensors['b'].shards[0].crc32c[0]",
        "is outside [0, 4294967295]",
    ),
    (
        "huge_file",
        lambda d: d["files"][FILE1].__setitem__("nbytes", 10**30),
        f"files['{FILE1}'].nbytes",
        "is outside",
    ),
]


@pytest.mark.parametrize(
    "mutate, where, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_manifest_refused(valid, mutate, where, fragment) -> None:
    step_store, doc = valid
    doc = copy.deepcopy(doc)
    out = mutate(doc)
    raw = out if isinstance(out, bytes) else json.dumps(doc).encode()
    url = step_store.url_of(MANIFEST_NAME)
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw, url)
    message = str(info.value)
    assert message.startswith(f"{url}: "), message
    assert f"{where}: " in message, message
    assert fragment in message, message
    assert "do not load it" in message


def test_hostile_manifest_via_read_manifest_and_verify(valid) -> None:
    """The same refusal through the reader and ``verify`` (the file is named)."""
    step_store, doc = valid
    root = Store(step_store.url.rsplit("/", 1)[0])
    bad = root.child(step_dir(STEP + 1))
    for name in (FILE0, FILE1):
        bad.write(name, step_store.read(name))
    doc = copy.deepcopy(doc)
    doc["step"] = STEP + 1
    doc["files"]["../../secrets"] = doc["files"].pop(FILE1)
    bad.write(MANIFEST_NAME, json.dumps(doc).encode())
    with pytest.raises(
        ManifestError, match=re.escape(f"{bad.url}/manifest.json: files['../../secrets']")
    ):
        read_manifest(bad)
    report = verify_checkpoint(bad)
    assert report.bad_files == [MANIFEST_NAME]
    assert "files['../../secrets']" in report.problems[0].what


def test_all_consistency_problems_listed_at_once(valid) -> None:
    step_store, doc = valid
    doc = copy.deepcopy(doc)
    _pop_shard(doc)
    _shard(doc, "b", 0)["nbytes"] = 24
    with pytest.raises(
        ManifestError,
        match=r"3 problems: .*tensors\['b'\]\.shards\[0\]\.nbytes.*"
        r"tensors\['w'\]\.shards: .*missing coverage.*overlap those of tensors\['b'\]",
    ):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def test_valid_manifest_round_trips(valid) -> None:
    step_store, doc = valid
    manifest = parse_manifest(json.dumps(doc).encode(), "m.json")
    assert json.loads(dumps_manifest(manifest)) == doc


# ---- data files that disagree with their manifest -------------------------------------------


def _pair_checkpoint(root: Store) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Step 1 with one file holding two same-size tensors ``a`` and ``c``."""
    full = {"a": torch.arange(8, dtype=torch.float32), "c": -torch.arange(8, dtype=torch.float32)}
    encoded, records = encode_and_record(
        {k: (t, Box((0,), (8,))) for k, t in full.items()}, FILE0, 16
    )
    root.child(step_dir(1)).write(FILE0, encoded.data)
    manifest = Manifest(
        step=1,
        layout={"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1},
        model={},
        config={},
        state={},
        tensors={k: TensorRecord([8], "F32", [records[k]]) for k in full},
        files={FILE0: encoded.record},
        chunk_nbytes=16,
    )
    return manifest, full


def test_swapped_byte_ranges_refused_by_header_check() -> None:
    """A manifest whose (checksum-consistent) byte ranges point at another tensor's data
    would load the wrong values silently; the header check refuses it."""
    root = memory_root()
    manifest, full = _pair_checkpoint(root)
    a, c = manifest.tensors["a"].shards[0], manifest.tensors["c"].shards[0]
    (a.byte_offset, a.crc32c), (c.byte_offset, c.crc32c) = (
        (c.byte_offset, c.crc32c),
        (a.byte_offset, a.crc32c),
    )
    commit(root, manifest)
    step_store = root.child(step_dir(1))
    loaded = read_manifest(step_store)
    with pytest.raises(
        IntegrityError,
        match=f"{FILE0}: safetensors header disagrees with the manifest: "
        "header says 'a' lies at data_offsets",
    ):
        read_box(step_store, loaded, "a", Box((0,), (8,)))
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE0]
    assert all("data_offsets" in p.what for p in report.problems)


def test_header_dtype_and_shape_disagree() -> None:
    """The file says I32 [2, 4] where the manifest says F32 [8], same bytes, consistent
    sizes and checksums: refused by load and by verify."""
    root = memory_root()
    manifest, full = _pair_checkpoint(root)
    other = {"a": full["a"].view(torch.int32).view(2, 4), "c": full["c"]}
    encoded, _ = encode_and_record(
        {k: (t, Box((0,) * t.dim(), tuple(t.shape))) for k, t in other.items()}, FILE0, 16
    )
    root.child(step_dir(1)).write(FILE0, encoded.data)
    manifest.files[FILE0] = FileRecord(encoded.record.nbytes, encoded.record.crc32c)
    commit(root, manifest)
    step_store = root.child(step_dir(1))
    with pytest.raises(
        IntegrityError,
        match=f"{FILE0}: safetensors header disagrees .*'a' is 'I32', "
        r"the manifest F32.*'a' has shape \[2, 4\]",
    ):
        read_box(step_store, read_manifest(step_store), "c", Box((0,), (8,)))
    report = verify_checkpoint(step_store)
    assert report.bad_files == [FILE0]
    assert {p.what.split(" ")[3] for p in report.problems} >= {"is", "has"}


def test_header_lists_extra_entry() -> None:
    """The file holds an entry the manifest does not know of (sizes, checksums consistent)."""
    root = memory_root()
    manifest, full = _pair_checkpoint(root)
    pieces = {k: (t, Box((0,), (8,))) for k, t in full.items()}
    encoded, records = encode_and_record(
        {**pieces, "zz": (torch.zeros(1), Box((0,), (1,)))}, FILE0, 16
    )
    root.child(step_dir(1)).write(FILE0, encoded.data)
    manifest.files[FILE0] = encoded.record
    for k in full:
        manifest.tensors[k].shards = [records[k]]
    commit(root, manifest)
    step_store = root.child(step_dir(1))
    with pytest.raises(
        IntegrityError, match=r"header lists entries the manifest does not: \['zz'\]"
    ):
        read_box(step_store, read_manifest(step_store), "a", Box((0,), (8,)))
    assert verify_checkpoint(step_store).bad_files == [FILE0]


# ---- nothing is unpickled -------------------------------------------------------------------


def test_loading_never_unpickles(monkeypatch) -> None:
    """Every read path runs with pickle and torch.load booby-trapped."""

    def trap(*args, **kwargs):
        raise AssertionError("a checkpoint read tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, trap)
    monkeypatch.setattr(torch, "load", trap)
    from click.testing import CliRunner

    from shardsmith.cli.main import cli
    from shardsmith.storage.gc import describe_steps, gc
    from shardsmith.trainer.checkpoint.save_load import load_into

    root = memory_root()
    full = make_checkpoint(root, 1)
    make_checkpoint(root, 2, seed=1)
    step_store = root.child(step_dir(1))
    manifest = read_manifest(step_store)
    dest = {fqn: torch.zeros_like(t) for fqn, t in full.items()}
    load_into(
        step_store,
        manifest,
        dest,
        {f: Box((0,) * t.dim(), tuple(t.shape)) for f, t in full.items()},
        {f: tuple(t.shape) for f, t in full.items()},
    )
    assert all(torch.equal(dest[f], full[f]) for f in full)
    assert verify_checkpoint(step_store).ok
    assert [s.status for s in describe_steps(root)] == ["committed", "committed"]
    assert gc(root, keep_last=1, dry_run=True) == [1]
    for args in (["verify", root.url], ["inspect", step_store.url], ["ls", root.url]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)


def _unsafe_calls(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            bad += [
                n
                for n in names
                if n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "shelve", "marshal")
            ]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            dotted = f"{node.value.id}.{node.attr}"
            if dotted in (
                "torch.load",
                "np.load",
                "numpy.load",
                "pickle.loads",
                "pickle.load",
            ) or node.attr in (
                "all_gather_object",
                "broadcast_object_list",
                "gather_object",
                "scatter_object_list",
                "recv_object_list",
                "send_object_list",
            ):
                bad.append(dotted)
    return bad


def test_package_source_has_no_unpickling() -> None:
    """No module of the package imports pickle-family libraries, calls ``torch.load`` or
    uses torch.distributed's pickling ``*_object`` collectives, except the one restricted
    unpickler of DCP's metadata (DESIGN.md, "Foreign formats")."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR)
        if rel.parts[0] in ("tests", "bench", ".venv", "build") or rel.parts[0].startswith("."):
            continue
        bad = _unsafe_calls(ast.parse(path.read_text(), str(path)))
        if bad and (str(rel), bad) != ("reshard/foreign/unpickler.py", ["pickle"]):
            found[str(rel)] = bad
    assert not found, f"unpickling code in the package: {found}"
    assert _unsafe_calls(ast.parse("import pickle\nx = torch.load(f)\n")) == [
        "pickle",
        "torch.load",
    ]
