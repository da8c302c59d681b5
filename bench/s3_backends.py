"""Benchmark: s3fs (our ``Store``) vs obstore on a loopback moto S3 server, for shard-sized objects.

    OMP_NUM_THREADS=1 python bench/s3_backends.py [--mib 32,256] [--repeats 3]

The moto server runs in its own process (so the client's CPU is measured alone). For each
object size, alternating which goes first on every repeat, it measures wall seconds and the
client process's CPU seconds (user + system, all threads) of:

* **put**: ``Store.write`` (s3fs, our parallel multipart upload: ``storage/store/multipart.py``) vs
  ``obstore.put`` (Rust; multipart with the same part size and concurrency);
* **get**: ``Store.read`` of the whole object, reading through s3fs
  (``SHARDSMITH_S3_READER=s3fs``) vs through obstore (the default:
  storage/store/s3_reads.py), i.e. the product's read path both ways;
* **ranged get**: 8 ``Store.read_into`` calls of 1/8 of the object each into preallocated
  buffers, one after another, the same two ways;
* **parallel ranged get**: the same 8 calls from 8 threads at once, as a load reads
  (``storage/reading/execute.py``: one thread per read, up to the store's ``capabilities.read_workers``).

s3torchconnector is not measured: it ships no wheel for this platform (sdist only, a Rust/CRT
build). Prints a table and, last, one JSON line with ``<op>_<mib>mib_speedup_obstore_vs_s3fs``
(s3fs wall / obstore wall) and ``<op>_<mib>mib_cpu_obstore_vs_s3fs`` (obstore client CPU / s3fs's):
each the median of per-round ratios (bench/robust.py: the two clients alternate within each
round, after one warm-up round), with ``spread`` (IQR, min-max), ``load_average`` and
``within_noise``. There is no goal; each ratio is judged against parity (1.0), so
``within_noise`` lists the ratios where this run cannot tell which client is faster or cheaper.
``--rounds`` is ``--repeats``. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import time
import uuid
from typing import Any, Callable

import robust

KEY, SECRET, REGION = "bench", "bench", "us-east-1"


def _serve(port: int) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)


def start_server() -> tuple[mp.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    proc.start()
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    raise SystemExit("moto server did not start")


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def clients(endpoint: str, bucket: str) -> tuple[Any, Any, Any]:
    """(Store reading through s3fs, Store reading through obstore, a raw obstore S3Store)."""
    import fsspec
    from obstore.store import S3Store

    from shardsmith.storage.store.fs import Store
    from shardsmith.storage.store.s3_reads import READER_ENV

    opts = {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
    }
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).call_s3(
        "create_bucket", Bucket=bucket
    )
    os.environ[READER_ENV] = "s3fs"
    ours = Store(f"s3://{bucket}", opts)
    del os.environ[READER_ENV]
    fast = Store(f"s3://{bucket}", opts)
    assert ours.backend.fast_reads is None and fast.backend.fast_reads is not None
    obs = S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=KEY,
        secret_access_key=SECRET,
        region=REGION,
        client_options={"allow_http": True},
    )
    return ours, fast, obs


def ops(ours: Any, fast: Any, obs: Any, data: bytes) -> dict[str, dict[str, Callable[[], Any]]]:
    import obstore

    n = len(data)
    ranges = [(i * n // 8, (i + 1) * n // 8) for i in range(8)]
    bufs = [memoryview(bytearray(b - a)) for a, b in ranges]
    part, conc = ours.part_nbytes, ours.max_concurrency
    return {
        "put": {
            "s3fs": lambda: ours.write("obj-s3fs", data),
            "obstore": lambda: obstore.put(
                obs, "obj-obstore", data, chunk_size=part, max_concurrency=conc
            ),
        },
        "get": {"s3fs": lambda: ours.read("obj-s3fs"), "obstore": lambda: fast.read("obj-obstore")},
        "ranged_get": {
            "s3fs": lambda: [ours.read_into("obj-s3fs", a, [d]) for (a, _), d in zip(ranges, bufs)],
            "obstore": lambda: [
                fast.read_into("obj-obstore", a, [d]) for (a, _), d in zip(ranges, bufs)
            ],
        },
        "par_ranged": {
            "s3fs": lambda: _parallel(ours, "obj-s3fs", ranges, bufs),
            "obstore": lambda: _parallel(fast, "obj-obstore", ranges, bufs),
        },
    }


def _parallel(
    store: Any, key: str, ranges: list[tuple[int, int]], bufs: list[memoryview]
) -> list[int]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ranges)) as pool:
        return list(pool.map(lambda rd: store.read_into(key, rd[0][0], [rd[1]]), zip(ranges, bufs)))


def measure(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall s, client CPU s) of each client per round, alternating, after one warm-up round."""

    def timed(fn: Callable[[], Any]) -> Callable[[int], tuple[float, float]]:
        def run(_round: int) -> tuple[float, float]:
            c0, t0 = cpu(), time.perf_counter()
            fn()
            return time.perf_counter() - t0, cpu() - c0

        return run

    return robust.alternate({who: timed(fn) for who, fn in fns.items()}, rounds, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="32,256", help="object sizes, MiB")
    ap.add_argument(
        "--repeats",
        "--rounds",
        dest="repeats",
        type=int,
        default=3,
        help="rounds (after one warm-up round), both clients in each",
    )
    args = ap.parse_args()
    proc, endpoint = start_server()
    summary: dict[str, Any] = {"load_average_1m": 0.0, "sizes_mib": []}
    goals: dict[str, tuple[dict[str, Any] | None, str | None, float | None]] = {}
    try:
        ours, fast, obs = clients(endpoint, f"bench-{uuid.uuid4().hex[:8]}")
        print(f"{'op':<12}{'MiB':>6}{'s3fs s':>9}{'obstore s':>11}{'s3fs cpu':>10}{'obs cpu':>9}")
        for mib in (int(x) for x in args.mib.split(",")):
            data = os.urandom(mib << 20)
            for op, fns in ops(ours, fast, obs, data).items():
                runs = measure(fns, args.repeats)
                w = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
                c = {k: statistics.median(u for _, u in v) for k, v in runs.items()}
                print(
                    f"{op:<12}{mib:>6}{w['s3fs']:>9.3f}{w['obstore']:>11.3f}{c['s3fs']:>10.3f}{c['obstore']:>9.3f}"
                )
                goals[f"{op}_{mib}mib_speedup_obstore_vs_s3fs"] = (
                    robust.paired([t for t, _ in runs["s3fs"]], [t for t, _ in runs["obstore"]]),
                    ">=",
                    1.0,
                )
                goals[f"{op}_{mib}mib_cpu_obstore_vs_s3fs"] = (
                    robust.paired([u for _, u in runs["obstore"]], [u for _, u in runs["s3fs"]]),
                    "<=",
                    1.0,
                )
            summary["sizes_mib"].append(mib)
    finally:
        proc.terminate()
    extra = robust.report(
        "\npaired rounds (median of per-round ratios; judged against parity, not a goal):", goals
    )
    summary.update(robust.medians({k: stat for k, (stat, _, _) in goals.items()}, 3))
    summary["load_average_1m"] = round(os.getloadavg()[0], 1)
    print(json.dumps({**summary, **extra}))


if __name__ == "__main__":
    main()
