"""bench/robust.py's round helpers (rotated, alternate, report, medians) and the benches' pure
ratio functions that use them."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

import robust  # noqa: E402


def test_rotated_starts_each_round_with_the_next_rival() -> None:
    names = ["a", "b", "c"]
    assert [robust.rotated(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                                            ["c", "a", "b"], ["a", "b", "c"]]
    assert robust.rotated(["x", "y"], 1) == ["y", "x"]
    assert robust.rotated([], 3) == []
    assert names == ["a", "b", "c"]                          # not modified in place


def test_alternate_interleaves_rivals_and_drops_warmup_rounds() -> None:
    calls: list[tuple[int, str]] = []

    def rival(name: str):
        def run(r: int) -> str:
            calls.append((r, name))
            return f"{name}{r}"
        return run
    logged: list[tuple[int, str, str]] = []
    out = robust.alternate({"a": rival("a"), "b": rival("b")}, rounds=2, warmup=1,
                           log=lambda r, n, res: logged.append((r, n, res)))
    # A B, then B A, then A B: alternating, each round rotated, the warm-up round run but dropped
    assert calls == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert out == {"a": ["a1", "a2"], "b": ["b1", "b2"]}
    assert len(logged) == 6 and logged[0] == (0, "a", "a0")
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        robust.alternate({"a": rival("a")}, rounds=0)


def test_report_carries_spread_noise_and_load_and_medians_round(capsys) -> None:
    speed = robust.paired([2.0, 3.0, 4.0], [1.0, 1.0, 1.0])            # 2, 3, 4: median 3
    noisy = robust.spread([0.9, 1.0, 1.1])
    out = robust.report("title", {"speed": (speed, ">=", 1.3), "noisy": (noisy, ">=", 1.0),
                                  "free": (noisy, None, None), "absent": (None, ">=", 1.0)})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "title"
    assert printed[1].endswith("goal >= 1.3: met") and "within noise" in printed[2]
    assert "goal" not in printed[3] and "not measured" in printed[4]
    assert set(out["spread"]) == {"speed", "noisy", "free"}                # measured keys only
    assert list(out["within_noise"]) == ["noisy"] and len(out["load_average"]) == 3
    assert robust.medians({"speed": speed, "absent": None}, digits=2) == {"speed": 3.0, "absent": None}
