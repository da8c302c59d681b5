"""Benchmark: the copy primitives under a reshard, per byte, against the kernel's own copy.

    python bench/copy_primitives.py [--mib 512] [--rounds 7] [--row-bytes 11264,4096] [--dir /tmp/copy-primitives]

Thread CPU (``time.thread_time``) of single-threaded primitives on cached source files, each
writing a new target file; every primitive once per round, the order rotated each round
(bench/robust.py), each as a ratio to ``sendfile`` of the same bytes (what ``cp`` does): the
median of per-round ratios with its IQR and min-max. Two more ratios are the engine's choices
against their alternatives, judged against parity (no goal; ``within_noise`` when the IQR
straddles 1.0): ``map_crc_pwrite_vs_preadv_crc_pwrite`` and ``gather_vs_pwritev``. The last line is
one JSON object: ``<ratio>.rows<L>`` (medians; the zero-copy primitives are measured again
with each row length), ``spread``, ``within_noise``, ``load_average``. Not a test: nothing
here asserts.

* zero-copy (a target range is one source range): ``copy_file_range``; the engine's way
  (``reshard/stream.py: copy_slab_verified``: map the source, CRC-32C each 256 KiB chunk
  through the mapping, ``pwrite`` each 1 MiB block from it); ``preadv`` into a reused 1 MiB
  buffer + CRC + ``pwrite``; the CRC pass through a fresh mapping alone.
* row-parallel merge (two sources whose rows of ``L`` bytes interleave in the target, a tp2 ->
  tp1 merge of a row-parallel weight): ``gather`` (the engine's way: map each source's rows
  of a 4 MiB slab, verify, gather into the slab, CRC it, ``pwrite``); ``pwritev`` (``preadv``
  each source's rows into a buffer, verify there, ``pwritev`` the rows interleaved, target
  CRC row by row in Python).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import robust

from shardsmith.storage.checksum import crc32c, crc32c_update

CHUNK = 256 * 1024
BLOCK = 1 << 20
SLAB = 4 << 20


def _source(path: str, nbytes: int) -> int:
    if not os.path.exists(path) or os.path.getsize(path) != nbytes:
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    return os.open(path, os.O_RDONLY)


def _chunks(view: memoryview) -> None:
    for i in range(0, len(view), CHUNK):
        crc32c(view[i : i + CHUNK])


class Primitives:
    """The primitives over files under ``work``; each method writes ``work/target`` anew."""

    def __init__(self, work: str, nbytes: int, row: int) -> None:
        self.target, self.nbytes, self.row = os.path.join(work, "target"), nbytes, row
        self.zc = _source(os.path.join(work, "source"), nbytes)
        self.rows = nbytes // 2 // row
        self.halves = [
            _source(os.path.join(work, f"half{i}-{row}"), self.rows * row) for i in range(2)
        ]
        self.buf = np.empty(BLOCK, np.uint8)

    def _out(self) -> int:
        if os.path.exists(self.target):
            os.unlink(self.target)
        return os.open(self.target, os.O_WRONLY | os.O_CREAT, 0o644)

    def sendfile(self) -> None:
        out, off = self._out(), 0
        while off < self.nbytes:
            off += os.sendfile(out, self.zc, off, self.nbytes - off)
        os.close(out)

    def copy_file_range(self) -> None:
        out, off = self._out(), 0
        while off < self.nbytes:
            off += os.copy_file_range(self.zc, out, self.nbytes - off, off, off)
        os.close(out)

    def map_crc_pwrite(self) -> None:
        out, span = self._out(), 32 << 20
        for s in range(0, self.nbytes, span):
            m = mmap.mmap(self.zc, min(span, self.nbytes - s), prot=mmap.PROT_READ, offset=s)
            view = memoryview(m)
            for b in range(0, len(view), BLOCK):
                _chunks(view[b : b + BLOCK])
                os.pwrite(out, view[b : b + BLOCK], s + b)
            view.release()
            m.close()
        os.close(out)

    def preadv_crc_pwrite(self) -> None:
        out, view = self._out(), memoryview(self.buf)
        for b in range(0, self.nbytes, BLOCK):
            n = os.preadv(self.zc, [view], b)
            _chunks(view[:n])
            os.pwrite(out, view[:n], b)
        os.close(out)

    def map_crc(self) -> None:
        m = mmap.mmap(self.zc, self.nbytes, prot=mmap.PROT_READ)
        view = memoryview(m)
        _chunks(view)
        view.release()
        m.close()

    def row_gather(self) -> None:
        out, per, row = self._out(), SLAB // (2 * self.row), self.row
        slab, pos = np.empty(per * 2 * row, np.uint8), 0
        for r0 in range(0, self.rows, per):
            n = min(per, self.rows - r0)
            t = slab[: n * 2 * row].reshape(n, 2 * row)
            for i, fd in enumerate(self.halves):
                off = r0 * row
                lo = off - off % mmap.PAGESIZE
                m = mmap.mmap(fd, off + n * row - lo, prot=mmap.PROT_READ, offset=lo)
                src = np.frombuffer(m, np.uint8)[off - lo :]
                _chunks(memoryview(src))
                t[:, i * row : (i + 1) * row] = src.reshape(n, row)
                del src
                m.close()
            _chunks(memoryview(t).cast("B"))
            os.pwrite(out, t, pos)
            pos += t.nbytes
        os.close(out)

    def row_pwritev(self) -> None:
        out, per, row = self._out(), SLAB // (2 * self.row), self.row
        bufs, pos = [np.empty(per * row, np.uint8) for _ in self.halves], 0
        for r0 in range(0, self.rows, per):
            n = min(per, self.rows - r0)
            views = [memoryview(b)[: n * row] for b in bufs]
            for view, fd in zip(views, self.halves):
                os.preadv(fd, [view], r0 * row)
                _chunks(view)
            iov, crc = [], 0
            for r in range(n):
                for view in views:
                    iov.append(view[r * row : (r + 1) * row])
                    crc = crc32c_update(iov[-1], crc)
            for k in range(0, len(iov), 1024):
                pos += os.pwritev(out, iov[k : k + 1024], pos)
        os.close(out)


def ratios(
    cpu: dict[str, list[float]], row: int
) -> dict[str, tuple[dict[str, Any], str | None, float | None]]:
    """Per-round ratios of one row length's rounds (``cpu``: primitive -> thread CPU per round,
    round order): each primitive / ``sendfile`` (no goal), and the engine's two choices / their
    alternatives (judged against parity: ``<=`` 1.0). Keys ``<ratio>.rows<row>``."""
    out: dict[str, tuple[dict[str, Any], str | None, float | None]] = {
        f"{name}_vs_sendfile.rows{row}": (robust.paired(v, cpu["sendfile"]), None, None)
        for name, v in cpu.items()
        if name != "sendfile"
    }
    out[f"map_crc_pwrite_vs_preadv_crc_pwrite.rows{row}"] = (
        robust.paired(cpu["map_crc_pwrite"], cpu["preadv_crc_pwrite"]),
        "<=",
        1.0,
    )
    out[f"gather_vs_pwritev.rows{row}"] = (
        robust.paired(cpu["row_gather"], cpu["row_pwritev"]),
        "<=",
        1.0,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per primitive, MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--row-bytes", default="11264,4096", help="row lengths of the row-parallel merge"
    )
    ap.add_argument("--dir", default="/tmp/copy-primitives")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    goals: dict[str, tuple[dict[str, Any], str | None, float | None]] = {}
    for row in (int(x) for x in args.row_bytes.split(",")):
        p = Primitives(args.dir, args.mib << 20, row)
        runs: dict[str, Callable[[], None]] = {
            "sendfile": p.sendfile,
            "copy_file_range": p.copy_file_range,
            "map_crc_pwrite": p.map_crc_pwrite,
            "preadv_crc_pwrite": p.preadv_crc_pwrite,
            "map_crc": p.map_crc,
            "row_gather": p.row_gather,
            "row_pwritev": p.row_pwritev,
        }

        def thread_cpu(fn: Callable[[], None]) -> Callable[[int], float]:
            def run(_round: int) -> float:
                t0 = time.thread_time()
                fn()
                return time.thread_time() - t0

            return run

        cpu = robust.alternate({name: thread_cpu(fn) for name, fn in runs.items()}, args.rounds)
        base = statistics.median(cpu["sendfile"])
        print(
            f"{args.mib} MiB, rows of {row} B, medians of {args.rounds} rounds, load {os.getloadavg()[0]:.1f}"
        )
        print(f"  {'primitive':<24} {'CPU-s':>7}  x sendfile (median of per-round ratios)")
        for name, values in cpu.items():
            ratio = robust.paired(values, cpu["sendfile"])["median"]
            print(
                f"  {name:<24} {statistics.median(values):7.3f}  {ratio:5.2f}x   (ratio of medians "
                f"{statistics.median(values) / base:5.2f}x)"
            )
        goals.update(ratios(cpu, row))
    extra = robust.report(
        "\npaired rounds (median of per-round ratios; the choices judged against parity, "
        "not a goal):",
        goals,
    )
    print(
        json.dumps(
            {
                **robust.medians({k: v[0] for k, v in goals.items()}, 3),
                "mib": args.mib,
                "rounds": args.rounds,
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
