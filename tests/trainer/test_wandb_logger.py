"""``--wandb``: the run's scalars reach an offline Weights & Biases run (no network), read back
from its ``.wandb`` file (a LevelDB-style log of protobuf records, W&B's own format)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from shardsmith.trainer.observe.metrics import MetricsWriter


def read_history(path: Path) -> list[dict[str, Any]]:
    """The ``history`` records of an offline run file: a 7-byte header, then 32 KiB blocks of
    records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last), as LevelDB's log."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                out.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return out


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'shardsmith[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(str(tmp_path), tensorboard=False, wandb=True, config={"steps": 2})
    writer.write({"step": 1, "loss": 3.5, "lr": 1e-3, "grad_norm": 1.25, "skipped": False})
    writer.write({"step": 2, "loss": 3.25, "lr": 2e-3, "grad_norm": None, "skipped": False})
    writer.write(
        {"event": "save", "step": 2, "seconds": 0.5, "blocked_seconds": 0.125, "nbytes": 100}
    )
    writer.write({"event": "goodput", "time": 5.0, "goodput": 0.75, "lost": 0.25, "restarts": 1})
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    history = [{k: v for k, v in h.items() if not k.startswith("_")} for h in read_history(runs[0])]
    assert history == [
        {"train/loss": 3.5, "train/lr": 1e-3, "train/grad_norm": 1.25, "train/step": 1},
        {"train/loss": 3.25, "train/lr": 2e-3, "train/step": 2},
        {
            "checkpoint/save_seconds": 0.5,
            "checkpoint/save_blocked_seconds": 0.125,
            "checkpoint/save_nbytes": 100,
        },
        {"goodput/goodput": 0.75, "goodput/lost": 0.25, "goodput/restarts": 1},
    ]
