"""Random number generator state per rank role: seeded, saved, restored or re-derived.

A rank's *role* is its ``(pp, tp)`` coordinates. As in Megatron-LM (``_set_random_seed``:
the seed is offset by the pipeline rank; the tensor-parallel RNG tracker by the TP rank;
data-parallel ranks share a seed), ranks that differ only in their data-parallel
coordinates run the same generator, so one state per role is saved in the manifest
(``state["rng"]``, base64 of the raw bytes; older checkpoints hold lists of byte values).
A rank whose state differs from its role's is saved under its own rank number too, so
nothing is dropped.

On load in the same layout every rank gets back exactly its state. In a layout with the
same pp, tp and stage split (only DP changed) each rank gets its role's state. Otherwise
(new roles, or per-rank states that no longer map onto ranks) every rank's generator is
re-derived from ``(seed, global step, role)``, deterministically, and the resume event
says ``"rng": "rederived"``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from shardsmith.layout import ParallelDims


def rng_role(coords: dict[str, int]) -> str:
    """The role key of mesh coordinates, e.g. ``"pp1.tp0"``."""
    return f"pp{coords['pp']}.tp{coords['tp']}"


def role_seed(seed: int, step: int, coords: dict[str, int]) -> int:
    """A seed in ``[0, 2**63)`` from (run seed, global step, role): SHA-256, so it is the
    same on every machine and Python version."""
    digest = hashlib.sha256(f"shardsmith-rng/{seed}/{step}/{rng_role(coords)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_rng(seed: int, step: int, coords: dict[str, int]) -> None:
    """Seed this process's CPU and CUDA generators for its role at ``step``."""
    torch.manual_seed(role_seed(seed, step, coords))


def capture_rng() -> dict[str, str]:
    """This process's generator states, each the base64 of its raw bytes (``cpu``; ``cuda``
    for the current device when CUDA is available): ~7 KB of JSON per state instead of the
    ~20 KB of an integer list (the form checkpoints before this one hold; still read)."""
    state = {"cpu": _encode(torch.get_rng_state())}
    if _on_gpu():
        state["cuda"] = _encode(torch.cuda.get_rng_state())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng`; also takes the older integer-list form (a ``cuda``
    entry is ignored on CPU-only hosts).

    Raises:
        ValueError: ``state`` has no ``cpu`` entry, or one that is neither form.
    """
    if "cpu" not in state:
        raise ValueError(f"rng state has keys {sorted(state)}; expected 'cpu' (and 'cuda')")
    torch.set_rng_state(_decode(state["cpu"]))
    if "cuda" in state and _on_gpu():
        torch.cuda.set_rng_state(_decode(state["cuda"]))


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(value: str | list[int]) -> torch.Tensor:
    if isinstance(value, str):
        return torch.frombuffer(
            bytearray(base64.b64decode(value, validate=True)), dtype=torch.uint8
        )
    if isinstance(value, list):
        return torch.tensor(value, dtype=torch.uint8)
    raise ValueError(
        f"rng state entry is a {type(value).__name__}; expected base64 text or a byte list"
    )


def pack_rng_states(gathered: list[dict[str, Any]], parallel: ParallelDims) -> dict[str, Any]:
    """The manifest's ``rng`` entry from every rank's ``{"rank", "role", "state"}``
    (gathered to rank 0 with a save's records, in rank order): one state per role, plus ranks
    that differ from it."""
    roles: dict[str, Any] = {}
    ranks: dict[str, Any] = {}
    for g in gathered:
        if g["role"] not in roles:
            roles[g["role"]] = g["state"]
        elif g["state"] != roles[g["role"]]:
            ranks[str(g["rank"])] = g["state"]
    return {"layout": parallel.to_json(), "roles": roles, "ranks": ranks}


def select_rng_state(
    saved: dict[str, Any] | None, parallel: ParallelDims, rank: int, coords: dict[str, int]
) -> dict[str, list[int]] | None:
    """This rank's saved state in layout ``parallel``, or None when it must be re-derived
    (see the module docstring). The decision is the same on every rank."""
    if not saved or "roles" not in saved:
        return None
    layout = saved.get("layout", {})
    current = parallel.to_json()
    same_roles = all(layout.get(k) == current[k] for k in ("pp", "tp", "pipeline_split"))
    if not same_roles:
        return None
    if layout == current:
        return saved.get("ranks", {}).get(str(rank)) or saved["roles"].get(rng_role(coords))
    if saved.get("ranks"):
        return None  # per-rank states have no rank to go to
    return saved["roles"].get(rng_role(coords))


def rank_rng_entry(rank: int, coords: dict[str, int]) -> dict[str, Any]:
    """This rank's ``{"rank", "role", "state"}`` for :func:`pack_rng_states` (local: no
    collective; a save sends it with its shard records, see ``write_and_commit``)."""
    return {"rank": rank, "role": rng_role(coords), "state": capture_rng()}


def apply_rng(
    saved: dict[str, Any] | None,
    parallel: ParallelDims,
    rank: int,
    coords: dict[str, int],
    seed: int,
    step: int,
) -> str:
    """Restore this rank's saved state, or re-derive it from ``(seed, step, role)``.

    Returns:
        ``"restored"`` or ``"rederived"`` (the same on every rank).
    """
    state = select_rng_state(saved, parallel, rank, coords)
    if state is None:
        seed_rng(seed, step, coords)
        return "rederived"
    restore_rng(state)
    return "restored"


def _on_gpu() -> bool:
    """True when this process trains on a GPU (not merely sees one: the CPU fallback of
    :func:`~shardsmith.trainer.parallel.device_type` touches no CUDA state)."""
    from shardsmith.trainer.parallel import device_type

    return device_type() == "cuda"
