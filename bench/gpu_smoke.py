"""GPU readiness smoke test (issue 17, part 6): the main job on every local GPU with NCCL.

Trains a preset with tp x dp_shard over all visible GPUs in bf16, saving asynchronously from
pinned host staging buffers, reshards the last checkpoint offline to another layout, resumes
there, and prints one JSON line: MFU, tokens/s and the save stall (time training was blocked
per save), next to the losses before and after the move. With an even number of GPUs it then
resumes once more as HSDP (``--dp-replicate 2``, two simulated nodes), so the replicas split
the checkpoint's reads and broadcast over NCCL, and reports that resume's bytes read.

    python bench/gpu_smoke.py [--model debug] [--steps 20] [--dir gpu-smoke]

On a machine without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0. Everything runs
through the ``shardsmith`` command line (torchrun's API underneath), so this is what a user's
job does; figures come from the runs' ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any


def _run(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "shardsmith", *args]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _records(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in records if "loss" in r and "event" not in r]
    saves = [r for r in records if r.get("event") == "save"]
    timed = steps[1:] or steps  # the first step includes warm-up
    blocked = sum(s.get("blocked_seconds", 0.0) for s in saves)
    return {
        "first_loss": steps[0]["loss"] if steps else None,
        "last_loss": steps[-1]["loss"] if steps else None,
        "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / max(len(timed), 1),
        "mfu": max((r.get("mfu") or 0.0 for r in timed), default=0.0),
        "save_stall_s": blocked / max(len(saves), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="debug", help="--model preset to train (default: debug)")
    ap.add_argument("--steps", type=int, default=20, help="steps before the move (as many after)")
    ap.add_argument("--dir", default="gpu-smoke", help="work directory (replaced)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    gpus = torch.cuda.device_count()
    tp = 2 if gpus % 2 == 0 else 1
    shutil.rmtree(args.dir, ignore_errors=True)
    a, b = os.path.join(args.dir, "a"), os.path.join(args.dir, "b")
    # micro-batch 2 on up to `gpus` data-parallel ranks: a global batch of 4 per GPU divides for any count
    common = [
        "--model",
        args.model,
        "--mixed-precision",
        "bf16",
        "--async-save",
        "--lr-decay-steps",
        str(2 * args.steps),
        "--save-interval",
        str(max(args.steps // 2, 1)),
        "--global-batch-size",
        str(4 * gpus),
        "--micro-batch-size",
        "2",
    ]
    _run(
        [
            "train",
            "--nproc-per-node",
            str(gpus),
            "--tp",
            str(tp),
            "--dp-shard",
            str(gpus // tp),
            "--steps",
            str(args.steps),
            "--ckpt",
            a,
            *common,
        ]
    )
    step = f"step-{args.steps:09d}"
    _run(
        [
            "reshard",
            os.path.join(a, step),
            os.path.join(b, step),
            "--tp",
            "1",
            "--dp-shard",
            str(gpus),
        ]
    )
    _run(
        [
            "train",
            "--nproc-per-node",
            str(gpus),
            "--tp",
            "1",
            "--dp-shard",
            str(gpus),
            "--steps",
            str(2 * args.steps),
            "--ckpt",
            b,
            "--resume",
            "auto",
            *common,
        ]
    )
    hsdp = None
    if gpus % 2 == 0:  # replicas on two simulated nodes: shared reads over NCCL
        c = os.path.join(args.dir, "c")
        _run(
            [
                "train",
                "--nproc-per-node",
                str(gpus),
                "--dp-replicate",
                "2",
                "--dp-shard",
                str(gpus // 2),
                "--steps",
                str(2 * args.steps + 1),
                "--ckpt",
                c,
                "--resume",
                os.path.join(b, f"step-{2 * args.steps:09d}"),
                "--simulate-nodes",
                "2",
                *common,
            ]
        )
        hsdp = next(r for r in _records(c) if r.get("event") == "resume")
    before, after = _summary(_records(a)), _summary(_records(b))
    print(
        json.dumps(
            {
                "gpus": gpus,
                "device": torch.cuda.get_device_name(),
                "model": args.model,
                "layout_before": f"tp{tp}·dps{gpus // tp}",
                "layout_after": f"dps{gpus}",
                **{k: before[k] for k in ("tokens_per_s", "mfu", "save_stall_s")},
                "loss_before_move": before["last_loss"],
                "loss_after_move": after["first_loss"],
                "tokens_per_s_after": after["tokens_per_s"],
                "hsdp_resume": None
                if hsdp is None
                else {
                    k: hsdp.get(k)
                    for k in ("nbytes_read", "nbytes_needed", "replicas_sharing_reads", "seconds")
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
