"""bench/robust.py's round helpers (rotated, alternate, report, medians) and the benches' pure
ratio functions that use them."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"
    ),
)

import robust  # noqa: E402


def test_rotated_starts_each_round_with_the_next_rival() -> None:
    names = ["a", "b", "c"]
    assert [robust.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert robust.rotated(["x", "y"], 1) == ["y", "x"]
    assert robust.rotated([], 3) == []
    assert names == ["a", "b", "c"]  # not modified in place


def test_alternate_interleaves_rivals_and_drops_warmup_rounds() -> None:
    calls: list[tuple[int, str]] = []

    def rival(name: str):
        def run(r: int) -> str:
            calls.append((r, name))
            return f"{name}{r}"

        return run

    logged: list[tuple[int, str, str]] = []
    out = robust.alternate(
        {"a": rival("a"), "b": rival("b")},
        rounds=2,
        warmup=1,
        log=lambda r, n, res: logged.append((r, n, res)),
    )
    # A B, then B A, then A B: alternating, each round rotated, the warm-up round run but dropped
    assert calls == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert out == {"a": ["a1", "a2"], "b": ["b1", "b2"]}
    assert len(logged) == 6 and logged[0] == (0, "a", "a0")
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        robust.alternate({"a": rival("a")}, rounds=0)


def test_report_carries_spread_noise_and_load_and_medians_round(capsys) -> None:
    speed = robust.paired([2.0, 3.0, 4.0], [1.0, 1.0, 1.0])  # 2, 3, 4: median 3
    noisy = robust.spread([0.9, 1.0, 1.1])
    out = robust.report(
        "title",
        {
            "speed": (speed, ">=", 1.3),
            "noisy": (noisy, ">=", 1.0),
            "free": (noisy, None, None),
            "absent": (None, ">=", 1.0),
        },
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "title"
    assert printed[1].endswith("goal >= 1.3: met") and "within noise" in printed[2]
    assert "goal" not in printed[3] and "not measured" in printed[4]
    assert set(out["spread"]) == {"speed", "noisy", "free"}  # measured keys only
    assert list(out["within_noise"]) == ["noisy"] and len(out["load_average"]) == 3
    assert robust.medians({"speed": speed, "absent": None}, digits=2) == {
        "speed": 3.0,
        "absent": None,
    }


def test_train_overhead_ratio_is_the_median_of_per_round_ratios(capsys) -> None:
    import argparse

    import train_overhead

    def run(rate: float, within: float) -> dict:
        return {
            "steps_per_s": rate,
            "within_run_ratio": within,
            "saves": 5,
            "nbytes": 1 << 20,
            "blocked_s": 0.001,
            "saver_blocked_s": 0.0005,
            "save_s": 0.2,
            "blocked_pairs": [(0.002, 0.001), (0.003, 0.001)],  # trainer blocked, checkpointer's
        }

    # per-round ckpt / none: 0.9, 1.0, 0.95 -> median 0.95 (the ratio of the medians would be 2.0 / 2.0 = 1.0)
    results = {
        "none": [run(1.0, 1.0), run(2.0, 1.01), run(5.0, 0.99)],
        "ckpt": [run(0.9, 0.95), run(2.0, 0.96), run(4.75, 0.97)],
    }
    args = argparse.Namespace(
        nproc=2, layout="1.1.2.1", steps=65, warmup=5, interval=10, repeats=3, sync=False
    )
    out = train_overhead.summarize(args, results)
    assert out["throughput_ratio"] == pytest.approx(0.95)
    assert out["ratios"] == [0.9, 1.0, 0.95]
    assert out["within_run_ratio"] == pytest.approx(0.96) and out[
        "within_run_ratio_control"
    ] == pytest.approx(1.0)
    # IQR 0.925-0.975 straddles the goal 0.97; within_run_ratio's 0.955-0.965 is below it (missed)
    assert list(out["within_noise"]) == ["throughput_ratio"]
    assert (
        out["spread"]["throughput_ratio"]["min"] == pytest.approx(0.9)
        and len(out["load_average"]) == 3
    )
    # per save: trainer blocked over the checkpointer's own save(): 2.0 and 3.0 -> median 2.5
    assert out["blocked_vs_checkpointer"] == pytest.approx(2.5)
    printed = capsys.readouterr().out
    assert "within_run_ratio" in printed and "missed" in printed


def _recovery(mttr: float, lost: int, goodput: float, source: str = "local") -> dict:
    return {
        "mttr_s": mttr,
        "lost_steps": lost,
        "source": source,
        "goodput": goodput,
        "goodput_parts": {"productive": goodput},
        "goodput_sum": 1.0,
    }


def test_recovery_bench_mttr_ratio_pairs_rounds_and_lost_steps_is_the_worst(capsys) -> None:
    import recovery_bench

    base = [
        _recovery(10.0, 3, 0.30, "persistent"),
        _recovery(20.0, 3, 0.20, "persistent"),
        _recovery(8.0, 3, 0.40, "persistent"),
    ]
    rank = [_recovery(1.0, 1, 0.50), _recovery(6.0, 0, 0.10), _recovery(2.0, 1, 0.60)]
    node = [
        _recovery(1.5, 0, 0.5, "buddy"),
        _recovery(1.6, 2, 0.1, "buddy"),
        _recovery(1.7, 0, 0.6, "buddy"),
    ]
    over = {
        "overhead": 1.0,
        "overhead_pairs": [0.8, 1.0, 1.2],
        "overhead_stat": recovery_bench.robust.paired([0.8, 1.0, 1.2], [1.0, 1.0, 1.0]),
    }
    out = recovery_bench.summarize(base, rank, node, over, {})
    # per round new / baseline: 0.1, 0.3, 0.25 -> median 0.25 (medians 2.0 / 10.0 would give 0.2)
    assert out["mttr_ratio"] == pytest.approx(0.25)
    assert out["spread"]["mttr_ratio"]["rounds"] == [0.1, 0.3, 0.25]
    assert (out["mttr_s"], out["baseline_mttr_s"], out["node_mttr_s"]) == (2.0, 10.0, 1.6)
    assert out["lost_steps"] == 2 and out["node_lost_steps"] == 2  # the worst round, rank or node
    assert out["goodput"] == pytest.approx(0.5) and out["goodput_parts"] == {"productive": 0.5}
    assert out["source"] == "local" and out["baseline_source"] == "persistent"
    # mttr IQR 0.175-0.275 is under 0.3 (met); the overhead's 0.9-1.1 straddles 0.95 (within noise)
    assert list(out["within_noise"]) == ["overhead"] and "overhead_stat" not in out
    assert "goal <= 0.3: met" in capsys.readouterr().out


def test_copy_primitives_ratios_are_per_round_and_keyed_by_row_length() -> None:
    import copy_primitives

    names = [
        "sendfile",
        "copy_file_range",
        "map_crc_pwrite",
        "preadv_crc_pwrite",
        "map_crc",
        "row_gather",
        "row_pwritev",
    ]
    cpu = {n: [1.0, 2.0, 1.0] for n in names}
    cpu["map_crc_pwrite"] = [2.0, 2.0, 3.0]  # / sendfile: 2, 1, 3 -> 2; / preadv: 2, 1, 3
    cpu["row_gather"] = [0.5, 3.0, 1.1]  # / pwritev: 0.5, 1.5, 1.1 -> 1.1
    out = copy_primitives.ratios(cpu, 4096)
    assert "sendfile_vs_sendfile.rows4096" not in out
    stat, op, goal = out["map_crc_pwrite_vs_sendfile.rows4096"]
    assert stat["median"] == pytest.approx(2.0) and op is None and goal is None
    stat, op, goal = out["gather_vs_pwritev.rows4096"]
    assert stat["median"] == pytest.approx(1.1) and (op, goal) == ("<=", 1.0)
    assert out["map_crc_pwrite_vs_preadv_crc_pwrite.rows4096"][0]["median"] == pytest.approx(2.0)


def test_tokenize_cache_ratios_pair_each_round_with_its_baseline() -> None:
    import tokenize_cache

    runs = {
        "bytes": [{"s": 1.0}, {"s": 2.0}],
        "bpe": [{"cold": 10.0, "warm": 0.5}, {"cold": 40.0, "warm": 4.0}],
    }
    out = tokenize_cache.ratios(runs)
    assert out["bpe_first_start_vs_bytes"][0]["rounds"] == [10.0, 20.0]
    assert out["bpe_cached_vs_bytes"][0]["median"] == pytest.approx(1.25)  # 0.5 and 2.0
    assert out["bpe_cached_vs_bytes"][1:] == ("<=", 1.0)
    assert out["bpe_cached_speedup"][0]["median"] == pytest.approx(15.0)  # 20 and 10


def test_format_bench_time_ratios_are_medians_of_per_round_ratios() -> None:
    import argparse

    import format_bench

    from shardsmith.layout import ParallelDims

    size = {"objects": 4, "bytes_stored": 100, "bytes_read": 100, "bytes_needed": 100}
    results = {
        "safetensors": [
            {"save": 1.0, "load": 1.0},
            {"save": 3.0, "load": 2.0},
            {"save": 1.0, "load": 1.0},
        ],
        "zarr": [
            {"save": 2.0, "load": 1.0},
            {"save": 3.0, "load": 3.0},
            {"save": 0.5, "load": 1.0},
        ],
    }
    sizes = {"safetensors": size, "zarr": {**size, "objects": 40, "bytes_stored": 110}}
    out = format_bench.summarize(
        argparse.Namespace(runs=3),
        ParallelDims(tp=2),
        ParallelDims(dp_shard=2),
        {},
        1000,
        results,
        sizes,
    )
    ratio = out["formats"]["zarr"]["ratio_vs_safetensors"]
    assert ratio["save_s"] == pytest.approx(1.0)  # 2, 1, 0.5 (the ratio of medians: 2 / 1)
    assert ratio["reshard_load_s"] == pytest.approx(1.0) and ratio["objects"] == 10
    assert ratio["bytes_stored"] == pytest.approx(1.1)
    assert set(out["robust"]) == {"zarr.save_s", "zarr.reshard_load_s"}
    assert out["robust"]["zarr.save_s"][1:] == ("<=", 1.0)
