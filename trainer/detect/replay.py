"""Silent data corruption: re-run a step and compare every rank's gradients.

On every ``check_replay_every``-th step, after the step's forward and backward and before
the gradients are reduced over data parallelism (:func:`finalize_grads`), each rank keeps
its gradients aside, restores the RNG state the step started from, runs forward and backward
again on the same inputs, and compares the two gradients of every parameter it holds
(its local shard). A fault that does not repeat (a flipped bit in a register, an SRAM or an
HBM word, a miscomputing core) makes them differ on the rank where it happened; the
original gradients are kept for the update. The mismatches of all ranks are all-gathered
(one JSON all-gather, on replay steps only), and rank 0 writes one ``sdc`` event naming each
mismatching rank and tensor. Then ``on_sdc``: ``stop`` raises :class:`SilentDataCorruption`
on every rank, ``skip-step`` drops the step's update, ``continue`` only reports.

Comparison: bitwise on CPU (the kernels are deterministic); with ``replay_tolerance`` > 0
(on CUDA by default 1e-5, see :class:`~shardsmith.trainer.detect.DetectConfig`) a tensor
mismatches when ``max |a - b| > tolerance * max |a|``. Under FSDP (``dp_shard`` > 1) the
reduce-scatter runs inside backward, so a corrupt contribution reaches every member's shard:
the event then names every rank of that group, and the fault is on one of them.

Cost at 1,024 ranks: nothing on other steps; on a replay step one more forward and backward
(with their TP/FSDP/PP collectives), one extra set of gradients in memory while comparing,
and one small all-gather: ``1 / check_replay_every`` of the compute on average.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from shardsmith.errors import SilentDataCorruption
from shardsmith.trainer.comm import gather_json
from shardsmith.trainer.detect import DetectConfig

__all__ = ["SilentDataCorruption", "replay_mismatches", "judge_replay", "rng_state", "tolerance"]


def rng_state() -> dict[str, Any]:
    """This process's torch RNG state (CPU, and every CUDA device when present)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tolerance(cfg: DetectConfig, device: torch.device) -> float:
    """The relative tolerance of the comparison: ``cfg.replay_tolerance``, or when negative 0
    on CPU and 1e-5 elsewhere."""
    if cfg.replay_tolerance >= 0:
        return cfg.replay_tolerance
    return 0.0 if device.type == "cpu" else 1e-5


def compare(original: torch.Tensor, replay: torch.Tensor, rtol: float) -> dict[str, Any] | None:
    """None when ``replay`` matches ``original`` (bitwise when ``rtol`` is 0), else
    ``{"elements": differing count, "max_abs_diff": float}``. Both are local tensors of one
    shape and dtype."""
    a, b = original.detach().reshape(-1), replay.detach().reshape(-1)
    if rtol == 0:
        per_element = (a.view(torch.uint8) != b.view(torch.uint8)).view(a.numel(), -1).any(dim=1)
        count = int(per_element.sum()) if a.numel() else 0
    else:
        limit = rtol * float(a.double().abs().max()) if a.numel() else 0.0
        count = int(((a.double() - b.double()).abs() > limit).sum())
    if count == 0:
        return None
    return {"elements": count, "max_abs_diff": float((a.double() - b.double()).abs().max())}


def replay_mismatches(
    model: torch.nn.Module,
    rerun: Callable[[], Any],
    rng: dict[str, Any],
    rtol: float,
    after_replay: Callable[[torch.nn.Module], None] | None = None,
) -> list[dict[str, Any]]:
    """Re-run the step (``rerun``: forward and backward on the same inputs) from RNG state
    ``rng`` and compare this rank's gradients with the ones it had; the original gradients
    are put back. Collective when ``rerun`` is (every rank of the step calls it).

    Args:
        after_replay: called with the model after the re-run (the tests' bit flip).

    Returns:
        ``[{"tensor": fqn, "elements", "max_abs_diff"}, ...]`` for this rank, model order.
    """
    original = {name: p.grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    after = rng_state()
    set_rng_state(rng)
    try:
        rerun()
        if after_replay is not None:
            after_replay(model)
        found = []
        for name, p in model.named_parameters():
            g0, g1 = original[name], p.grad
            if g0 is None or g1 is None:
                continue
            diff = compare(_local(g0), _local(g1), rtol)
            if diff is not None:
                found.append({"tensor": name, **diff})
    finally:
        for name, p in model.named_parameters():
            p.grad = original[name]
        set_rng_state(after)
    return found


def judge_replay(
    step: int,
    mine: list[dict[str, Any]],
    cfg: DetectConfig,
    event: Callable[[dict[str, Any]], None],
) -> str:
    """Gather every rank's mismatches (collective), report them, apply ``cfg.on_sdc``.

    Returns:
        ``"match"`` (no rank's gradients differ), ``"mismatch"`` (they do, under ``continue``)
        or ``"skip"`` (they do, under ``skip-step``: drop the update).

    Raises:
        SilentDataCorruption: a mismatch under ``stop`` (on every rank).
    """
    everyone = gather_json(mine[:16])  # at most 16 tensors a rank: bounded message
    found = [{"rank": rank, **m} for rank, items in enumerate(everyone) for m in items]
    if not found:
        return "match"
    ranks = sorted({m["rank"] for m in found})
    event(
        {
            "event": "sdc",
            "step": step,
            "ranks": ranks,
            "rank": found[0]["rank"],
            "tensor": found[0]["tensor"],
            "mismatches": found,
            "policy": cfg.on_sdc,
        }
    )
    if cfg.on_sdc == "stop":
        first = found[0]
        raise SilentDataCorruption(
            f"step {step}: replaying forward and backward from the same inputs gave different gradients on "
            f"rank(s) {ranks} (first: rank {first['rank']}, {first['tensor']}, {first['elements']} element(s), "
            f"max |diff| {first['max_abs_diff']:.3g}); suspect that rank's device: drain its node and restart "
            "(--on-sdc continue only reports)"
        )
    return "skip" if cfg.on_sdc == "skip-step" else "mismatch"
