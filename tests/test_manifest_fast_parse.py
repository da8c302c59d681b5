"""The manifest parser's one-pass shard check (``manifest_v2._valid_shard``) accepts exactly
what the field-by-field checks accept, and ``cycle_gc_paused`` pauses and restores Python's
cyclic collector correctly (nested, across threads, on errors)."""

from __future__ import annotations

import gc
import random
import threading
from typing import Any

import pytest

from shardsmith.errors import ManifestError
from shardsmith.storage import manifest_v2
from shardsmith.storage.manifest_checks import (MAX_INT, _grid_disjoint, cycle_gc_paused, overlapping_pairs,
                                                reject_duplicate_keys)

_BAD_VALUES: list[Any] = [True, False, -1, 1.0, "1", None, [], {}, MAX_INT + 1, [1, True], [1, -2], [1.5],
                          [2**32], "", "../x", "/abs", "a//b", "s3://b/k", "x\\y", "a\x01b", ".", "manifest.json",
                          "./a", "a/../b", "c:d", "~x", [0, 1, 2, 3]]


def _good() -> dict[str, Any]:
    doc = {"file": "shards/rank-00003.safetensors", "key": "layers.0.w", "offsets": [512, 0],
           "lengths": [512, 1024], "byte_offset": 4096}
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
        field = random.choice(["file", "key", "offsets", "lengths", "byte_offset", "crc", "crc32c", "nbytes"])
        action = random.random()
        if action < 0.2:
            doc.pop(field, None)
        elif action < 0.3 and field in ("crc", "crc32c"):
            doc["crc"], doc["crc32c"] = 1, [1]                    # both: refused
        else:
            doc[field] = random.choice(_BAD_VALUES)
    return doc


def _slow(data: Any) -> Any:
    """The field-by-field path alone (the one-pass check switched off)."""
    saved = manifest_v2._valid_shard
    manifest_v2._valid_shard = lambda *_: None                   # type: ignore[assignment]
    try:
        return _outcome(data)
    finally:
        manifest_v2._valid_shard = saved


def _outcome(data: Any) -> Any:
    try:
        rec = manifest_v2._parse_shard(data, "layers.0.w", 4, None, "tensors['w'].shards[0]", "m.json")  # type: ignore[arg-type]
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
    assert accepted > 800 and refused > 800          # both sides of the check were exercised


def test_one_pass_check_returns_the_record_only_when_every_field_is_valid() -> None:
    doc = {"file": "a.safetensors", "key": "w", "offsets": [0], "lengths": [8], "byte_offset": 16, "crc": 3}
    rec = manifest_v2._valid_shard(doc, 2)
    assert rec is not None and (rec.nbytes, rec.crc_index, rec.crc32c, rec.file) == (16, 3, [], "a.safetensors")
    assert manifest_v2._valid_shard({**doc, "byte_offset": True}, 2) is None          # a bool is not an int
    assert manifest_v2._valid_shard({**doc, "file": "../a"}, 2) is None
    assert manifest_v2._valid_shard({**doc, "crc32c": [1]}, 2) is None                 # both CRC forms
    with pytest.raises(ManifestError, match=r"tensors\['w'\].shards\[0\].byte_offset"):
        manifest_v2._parse_shard({**doc, "byte_offset": -4}, "w", 2, None, "tensors['w'].shards[0]", "m.json")  # type: ignore[arg-type]


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
        assert not gc.isenabled()                     # the outer block still holds it
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with cycle_gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()                             # back on after an error
    gc.disable()
    try:
        with cycle_gc_paused():
            pass
        assert not gc.isenabled()                     # was off before: left off
    finally:
        gc.enable()


def test_cycle_gc_paused_overlapping_threads_turn_it_back_on_once_both_leave() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with cycle_gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with cycle_gc_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()                         # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


def _pairs_by_brute_force(boxes: list[tuple[list[int], list[int], int]]) -> list[tuple[int, int]]:
    return sorted((a[2], b[2]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                  if all(max(x, y) < min(x + xn, y + yn) for x, xn, y, yn in zip(a[0], a[1], b[0], b[1])))


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
            boxes.append(random.choice(boxes))                                   # the same box twice
        elif case % 4 == 2:
            o, n = random.choice(boxes)
            boxes.append(([x + random.randrange(0, 2) for x in o], list(n)))     # shifted: off the grid
        elif case % 4 == 3:
            boxes = [([random.randrange(0, 10) for _ in range(ndim)], [random.randrange(1, 5) for _ in range(ndim)])
                     for _ in range(random.randrange(2, 9))]
        indexed = [(o, n, i) for i, (o, n) in enumerate(boxes)]
        shortcut += _grid_disjoint(indexed, ndim)
        assert overlapping_pairs(indexed) == _pairs_by_brute_force(indexed), boxes
    assert shortcut >= 100                           # the plain grids took the shortcut
