"""The ``--fsdp-reshard-after-forward`` policy words (torchtitan's ``default``: not under PP)."""

import pytest

from shardsmith.layout import reshards_after_forward


def test_default_reshards_only_without_pipelining() -> None:
    assert reshards_after_forward("default", 1) is True
    assert reshards_after_forward("default", 2) is False
    assert reshards_after_forward("always", 4) is True
    assert reshards_after_forward("never", 1) is False
    with pytest.raises(ValueError, match="choose one of default, always, never"):
        reshards_after_forward("sometimes", 2)
