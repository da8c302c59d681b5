"""Exports print their own summary and nothing of torch's: ``export-dcp`` and
``export-megatron`` run ``dcp.save`` in one process on purpose, and torch's UserWarning
that no process group is initialized read to users as a fault (found in a fresh-clone run
of README's "Bring your own checkpoint" commands)."""

from __future__ import annotations

import warnings
from pathlib import Path

from ckpt_factory import MODEL, full_tensors, save_offline

from shardsmith.layout import ParallelDims
from shardsmith.reshard.foreign.dcp import export_dcp
from shardsmith.reshard.foreign.megatron_export import export_megatron
from shardsmith.storage.commit import commit
from shardsmith.storage.store.fs import Store


def test_exports_emit_no_warning(tmp_path: Path) -> None:
    root = Store(str(tmp_path / "ck"))
    commit(
        root, save_offline(root, 3, ParallelDims(tp=2), full_tensors(MODEL, with_optimizer=True))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp_report = export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
        meg_report = export_megatron(str(tmp_path / "ck"), str(tmp_path / "meg"), tp=2)
    assert dcp_report.step == 3 and dcp_report.with_optimizer
    assert meg_report.step == 3 and (tmp_path / "meg" / "metadata.json").exists()
    assert [str(w.message) for w in caught] == []
