"""bench/scale_sim.py says which manifest version it simulates: the one the builder writes."""

from __future__ import annotations

import ast
from pathlib import Path

from shardsmith.storage.manifest.records import FORMAT_VERSION

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale_sim.py"


def test_scale_sim_docstring_names_the_written_manifest_version() -> None:
    doc = ast.get_docstring(ast.parse(BENCH.read_text())) or ""
    assert f"version-{FORMAT_VERSION} manifest" in " ".join(doc.split())
    assert "shard grids" in doc
