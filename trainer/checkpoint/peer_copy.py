"""Files between ranks over the process group: the local tier's buddy copies.

A set of named files travels as one ``uint8`` tensor: an 8-byte little-endian header length,
a JSON header ``{"names": [...], "sizes": [...]}``, then the bytes in that order. No pickle
(unlike ``send_object_list``), so a peer cannot make this rank run code. On GPU jobs it runs
on a gloo group (host memory), off the accelerator's streams.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from shardsmith.errors import CheckpointError


def pack_files(files: dict[str, bytes]) -> bytes:
    """One buffer holding ``files`` (name -> bytes), in name order."""
    names = sorted(files)
    head = json.dumps({"names": names, "sizes": [len(files[n]) for n in names]}).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *(files[n] for n in names)])


def unpack_files(blob: bytes, source: str) -> dict[str, bytes]:
    """Inverse of :func:`pack_files`.

    Raises:
        CheckpointError: the buffer is malformed (names ``source``).
    """
    try:
        hlen = int.from_bytes(blob[:8], "little")
        head = json.loads(blob[8 : 8 + hlen])
        names, sizes = head["names"], head["sizes"]
        if len(names) != len(sizes) or 8 + hlen + sum(sizes) != len(blob):
            raise ValueError("sizes do not add up")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"files received from {source} are malformed: {exc}") from exc
    out, pos = {}, 8 + hlen
    for name, size in zip(names, sizes):
        out[str(name)] = blob[pos : pos + int(size)]
        pos += int(size)
    return out


def exchange_files(
    sends: dict[int, dict[str, bytes]], recvs: list[int], group: dist.ProcessGroup | None = None
) -> dict[int, dict[str, bytes]]:
    """Send files to some ranks and receive files from others, at once (no deadlock when
    two ranks send to each other). Point-to-point: only the ranks named call it, each with
    the matching ``sends`` and ``recvs`` (ranks of ``group``: global ranks for the default
    group). ``group`` may also be a gloo group made outside ``init_process_group`` (a
    ``ProcessGroupGloo`` of its own, as a shrink's exchange with survivors outside the new
    layout: :mod:`~shardsmith.trainer.checkpoint.peer_serve`).

    Returns:
        source rank -> the files it sent.
    """
    blobs = {dst: pack_files(files) for dst, files in sends.items()}
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in recvs}
    works = [
        dist.isend(torch.tensor([len(b)], dtype=torch.int64), group=group, group_dst=dst)
        for dst, b in blobs.items()
    ]
    works += [dist.irecv(t, group=group, group_src=src) for src, t in sizes_in.items()]
    for w in works:
        if w is not None:
            w.wait()
    bufs_in = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes_in.items()}
    out_tensors = {
        dst: torch.frombuffer(bytearray(b), dtype=torch.uint8) for dst, b in blobs.items()
    }
    works = [dist.isend(t, group=group, group_dst=dst) for dst, t in out_tensors.items()]
    works += [dist.irecv(t, group=group, group_src=src) for src, t in bufs_in.items()]
    for w in works:
        if w is not None:
            w.wait()
    return {src: unpack_files(t.numpy().tobytes(), f"rank {src}") for src, t in bufs_in.items()}
