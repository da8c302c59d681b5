"""A refused reshard leaves nothing at its target: a source byte that fails its checksum
stops the reshard, and the directories it made for the target (root, step, shards/) are gone."""

from __future__ import annotations

from ckpt_factory import MODEL, full_tensors, save_offline
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.store.fs import Store


def test_a_refused_reshard_leaves_no_directories(tmp_path) -> None:
    root = Store(str(tmp_path / "src"))
    save_offline(root, 4, ParallelDims(dp_shard=2), full_tensors(MODEL, 4), MODEL)
    shard = read_manifest(root.child(step_dir(4))).tensors["tok_embeddings.weight"].shards[0]
    path = tmp_path / "src" / step_dir(4) / shard.file
    data = bytearray(path.read_bytes())
    data[shard.byte_offset] ^= 0xFF
    path.write_bytes(bytes(data))
    (tmp_path / "mine").mkdir()  # the user's own directory stays
    for target in ("out", "new/deeper/out", "mine"):
        result = CliRunner().invoke(
            cli, ["reshard", root.url, str(tmp_path / target), "--tp", "1", "--quiet"]
        )
        assert result.exit_code == 1 and "checksum mismatch" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "src"]
    assert list((tmp_path / "mine").iterdir()) == []
