"""The manifest parser's one-pass shard check (``manifest_v2._valid_shard``) accepts exactly
what the field-by-field checks accept, and ``cycle_gc_paused`` pauses and restores Python's
cyclic collector correctly (nested, across threads, on errors)."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
from typing import Any, Iterator

import pytest

from shardsmith.errors import ManifestError
from shardsmith.storage.cycle_gc import cycle_gc_paused
from shardsmith.storage.manifest import v2 as manifest_v2
from shardsmith.storage.manifest.checks import (
    MAX_INT,
    Problems,
    _grid_disjoint,
    _relpath_ok_cached,
    check_files_disjoint,
    check_sidecars,
    overlapping_pairs,
    reject_duplicate_keys,
    relpath_ok,
)
from shardsmith.storage.manifest.records import ShardRecord, TensorRecord

_BAD_VALUES: list[Any] = [
    True,
    False,
    -1,
    1.0,
    "1",
    None,
    [],
    {},
    MAX_INT + 1,
    [1, True],
    [1, -2],
    [1.5],
    [2**32],
    "",
    "../x",
    "/abs",
    "a//b",
    "s3://b/k",
    "x\\y",
    "a\x01b",
    ".",
    "manifest.json",
    "./a",
    "a/../b",
    "c:d",
    "~x",
    [0, 1, 2, 3],
]


def _good() -> dict[str, Any]:
    doc = {
        "file": "shards/rank-00003.safetensors",
        "key": "layers.0.w",
        "offsets": [512, 0],
        "lengths": [512, 1024],
        "byte_offset": 4096,
    }
    if random.random() < 0.5:
        doc["crc"] = random.randrange(0, 1000)
    else:
        doc["crc32c"] = [random.randrange(0, 2**32) for _ in range(random.randrange(0, 4))]
    if random.random() < 0.3:
        doc["nbytes"] = random.choice([512 * 1024 * 4, 7, 0])
    return doc


def _mutate(doc: dict[str, Any]) -> dict[str, Any]:
    doc = dict(doc)
    for _ in range(random.randrange(1, 3)):
        field = random.choice(
            ["file", "key", "offsets", "lengths", "byte_offset", "crc", "crc32c", "nbytes"]
        )
        action = random.random()
        if action < 0.2:
            doc.pop(field, None)
        elif action < 0.3 and field in ("crc", "crc32c"):
            doc["crc"], doc["crc32c"] = 1, [1]  # both: refused
        else:
            doc[field] = random.choice(_BAD_VALUES)
    return doc


def _slow(data: Any) -> Any:
    """The field-by-field path alone (the one-pass check switched off)."""
    saved = manifest_v2._valid_shard
    manifest_v2._valid_shard = lambda *_: None  # type: ignore[assignment]
    try:
        return _outcome(data)
    finally:
        manifest_v2._valid_shard = saved


def _outcome(data: Any) -> Any:
    try:
        rec = manifest_v2._parse_shard(
            data, "layers.0.w", 4, None, "tensors['w'].shards[0]", "m.json"
        )  # type: ignore[arg-type]
    except ManifestError as exc:
        return ("error", str(exc))
    return ("ok", rec)


def test_one_pass_check_agrees_with_the_field_checks_on_valid_and_hostile_records() -> None:
    random.seed(7)
    accepted = refused = 0
    for i in range(3000):
        doc = _good() if i % 3 == 0 else _mutate(_good())
        fast, slow = _outcome(doc), _slow(doc)
        assert fast == slow, doc
        accepted += fast[0] == "ok"
        refused += fast[0] == "error"
    assert accepted > 800 and refused > 800  # both sides of the check were exercised


def test_one_pass_check_returns_the_record_only_when_every_field_is_valid() -> None:
    doc = {
        "file": "a.safetensors",
        "key": "w",
        "offsets": [0],
        "lengths": [8],
        "byte_offset": 16,
        "crc": 3,
    }
    rec = manifest_v2._valid_shard(doc, 2)
    assert rec is not None and (rec.nbytes, rec.crc_index, rec.crc32c, rec.file) == (
        16,
        3,
        [],
        "a.safetensors",
    )
    assert manifest_v2._valid_shard({**doc, "byte_offset": True}, 2) is None  # a bool is not an int
    assert manifest_v2._valid_shard({**doc, "file": "../a"}, 2) is None
    assert manifest_v2._valid_shard({**doc, "crc32c": [1]}, 2) is None  # both CRC forms
    with pytest.raises(ManifestError, match=r"tensors\['w'\].shards\[0\].byte_offset"):
        manifest_v2._parse_shard(
            {**doc, "byte_offset": -4}, "w", 2, None, "tensors['w'].shards[0]", "m.json"
        )  # type: ignore[arg-type]


def test_duplicate_json_keys_are_still_refused_after_the_dict_fast_path() -> None:
    assert reject_duplicate_keys([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        reject_duplicate_keys([("a", 1), ("b", 2), ("a", 3)])


def test_cycle_gc_paused_nests_and_restores_the_collector() -> None:
    assert gc.isenabled()
    with cycle_gc_paused():
        assert not gc.isenabled()
        with cycle_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still holds it
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with cycle_gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()  # back on after an error
    gc.disable()
    try:
        with cycle_gc_paused():
            pass
        assert not gc.isenabled()  # was off before: left off
    finally:
        gc.enable()


@contextlib.contextmanager
def _paused_by_another_thread() -> Iterator[None]:
    """While the block runs, another thread is inside ``cycle_gc_paused``; it leaves after."""
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with cycle_gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        t.join(10)


def test_cycle_gc_paused_overlapping_threads_turn_it_back_on_once_both_leave() -> None:
    with _paused_by_another_thread():
        with cycle_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread is still inside
    assert gc.isenabled()


def _pairs_by_brute_force(boxes: list[tuple[list[int], list[int], int]]) -> list[tuple[int, int]]:
    return sorted(
        (a[2], b[2])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if all(max(x, y) < min(x + xn, y + yn) for x, xn, y, yn in zip(a[0], a[1], b[0], b[1]))
    )


def test_grid_shortcut_finds_exactly_the_overlapping_pairs() -> None:
    """Grids (the shortcut says disjoint), grids with a duplicated or shifted box, and random
    boxes: overlapping_pairs equals a brute-force comparison of all pairs."""
    random.seed(11)
    shortcut = 0
    for case in range(400):
        ndim = random.randrange(1, 4)
        cuts = [sorted(random.sample(range(1, 12), random.randrange(0, 3))) for _ in range(ndim)]
        extents = [[(a, b - a) for a, b in zip([0] + c, c + [12])] for c in cuts]
        boxes: list[tuple[list[int], list[int]]] = [([], [])]
        for dim in extents:
            boxes = [(o + [a], n + [b]) for o, n in boxes for a, b in dim]
        if case % 4 == 1:
            boxes.append(random.choice(boxes))  # the same box twice
        elif case % 4 == 2:
            o, n = random.choice(boxes)
            boxes.append(
                ([x + random.randrange(0, 2) for x in o], list(n))
            )  # shifted: off the grid
        elif case % 4 == 3:
            boxes = [
                (
                    [random.randrange(0, 10) for _ in range(ndim)],
                    [random.randrange(1, 5) for _ in range(ndim)],
                )
                for _ in range(random.randrange(2, 9))
            ]
        indexed = [(o, n, i) for i, (o, n) in enumerate(boxes)]
        shortcut += _grid_disjoint(indexed, ndim)
        assert overlapping_pairs(indexed) == _pairs_by_brute_force(indexed), boxes
    assert shortcut >= 100  # the plain grids took the shortcut


def _eleven_shards() -> TensorRecord:
    f = "shards/rank-00000.safetensors"
    return TensorRecord(
        shape=[11],
        dtype="F32",
        shards=[
            ShardRecord(
                offsets=[i],
                lengths=[1],
                file=f,
                key=f"w.{i}",
                byte_offset=4 * i,
                nbytes=4,
                crc32c=[],
                crc_index=i,
            )
            for i in range(11)
        ],
    )


def test_overlap_messages_name_tied_shards_in_location_order() -> None:
    """Two shards tied on their range are named as before the lazy locations (sorted by the
    location text, where 'shards[10]' comes before 'shards[2]')."""
    rec = _eleven_shards()
    rec.shards[10].crc_index = 2
    problems = Problems("m.json")
    check_sidecars({"w": rec}, {}, 4, problems, whole=False)
    assert problems.items == [
        "tensors['w'].shards[2].crc32c: checksums in shards/rank-00000.safetensors.crc32c "
        "overlap those of tensors['w'].shards[10]"
    ]
    rec = _eleven_shards()
    rec.shards[10].byte_offset = 8
    problems = Problems("m.json")
    check_files_disjoint({"w": rec}, problems)
    assert problems.items == [
        "tensors['w'].shards[2].byte_offset: bytes of shards/rank-00000.safetensors overlap "
        "those of tensors['w'].shards[10]"
    ]


def test_long_paths_are_checked_but_not_cached() -> None:
    _relpath_ok_cached.cache_clear()
    assert relpath_ok("shards/rank-00000.safetensors") and not relpath_ok("../" + "a" * 300)
    assert relpath_ok("a/" * 200 + "b")
    assert _relpath_ok_cached.cache_info().currsize == 1  # only the short one is kept


def test_a_child_forked_during_a_pause_runs_with_the_collector_on() -> None:
    with _paused_by_another_thread():
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # child: the pausing thread does not exist here
            ok = gc.isenabled()
            with cycle_gc_paused():
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
