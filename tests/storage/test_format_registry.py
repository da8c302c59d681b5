"""The tensor-format seam: reads dispatch through the registry keyed by the manifest's
``tensor_format``, and what other modules may know of a format comes from its traits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardsmith.storage.formats.registry as registry
from shardsmith.errors import ConfigError
from shardsmith.layout.box import Box
from shardsmith.storage.manifest.records import (
    FORMAT_TRAITS,
    TENSOR_FORMATS,
    FormatTraits,
    Manifest,
    TensorRecord,
)
from shardsmith.storage.store.fs import Store


def test_every_format_a_manifest_may_name_has_an_implementation_and_traits() -> None:
    assert set(registry.FORMATS) == set(FORMAT_TRAITS) == set(TENSOR_FORMATS)
    assert [registry.tensor_format(n).name for n in TENSOR_FORMATS] == list(TENSOR_FORMATS)
    with pytest.raises(ConfigError, match="choose one of"):
        registry.tensor_format("hdf5")


def test_a_new_format_is_one_registry_entry_and_its_traits(monkeypatch) -> None:
    """A format registered in FORMATS (and FORMAT_TRAITS) is what read_boxes reads a manifest
    naming it with: no other module decides."""
    calls: list[tuple[str, Box]] = []

    class Toy:
        name = "toy"

        def read_boxes(
            self, store: Store, manifest: Manifest, requests: Any, stats: Any, source: str
        ) -> list[torch.Tensor]:
            calls.extend((fqn, box) for fqn, box, _ in requests)
            return [torch.full(box.lengths, 7.0) for _, box, _ in requests]

    monkeypatch.setitem(registry.FORMATS, "toy", lambda codec: Toy())
    monkeypatch.setitem(FORMAT_TRAITS, "toy", FormatTraits(raw_shards=False, file_headers=False))
    manifest = Manifest(
        step=1,
        layout={},
        model={},
        config={},
        state={},
        files={},
        tensor_format="toy",
        tensors={"w": TensorRecord(shape=[4, 2], dtype="F32", shards=[])},
    )
    box = Box((1, 0), (2, 2))
    out = registry.read_box(Store("memory://toy-format"), manifest, "w", box)
    assert calls == [("w", box)] and torch.equal(out, torch.full((2, 2), 7.0))
    assert manifest.traits.raw_shards is False
