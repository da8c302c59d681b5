"""Megatron-Core optimizer state in ``torch_dist`` checkpoints <-> shardsmith's AdamW state.

Megatron-Core 0.19 (``DistributedOptimizer.sharded_state_dict``, ``metadata=
{"distrib_optim_sharding_type": ...}``; checked by saving with megatron-core itself) stores
the Adam state of a GPT in one of two layouts:

* **model space** (``fully_reshardable``; the non-distributed optimizers look the same): one
  tensor per parameter and kind, ``optimizer.state.{exp_avg,exp_avg_sq,param}.<model key>``,
  shaped exactly like the parameter (stacked layers, fused QKV, fused SwiGLU ``fc1``, padded
  vocabulary), ``param`` being the fp32 main copy. The Adam step is not a tensor: it is each
  param group's ``"step"`` in the checkpoint's common state
  (``common_state -> optimizer -> optimizer -> param_groups``). **Converted**, moments with
  the same QKV split / RoPE row order / vocabulary cut as the weights.
* **bucket space** (``dp_reshardable``, Megatron-LM's default without
  ``--dist-ckpt-optim-fully-reshardable``): per-bucket flat buffers
  ``optimizer.distributed.dp_group_idx_*.gbuf_idx_*.dtype_*.bucket_idx_*.{exp_avg,...}`` laid out
  as the saving run's DDP buckets (parameter order, alignment padding), which the checkpoint
  does not describe. **Not converted**: the import writes the weights only, says so, and the
  result refuses ``train --resume`` (start from it with ``--init-from``). Re-save the Megatron
  checkpoint with ``--dist-ckpt-optim-fully-reshardable`` to carry the state over.
  (``fully_sharded_model_space``, flattened ranges, is refused by megatron-core 0.19's own save.)

Export writes the model-space layout (``fully_reshardable``) plus the common state a
``DistributedOptimizer.load_state_dict`` needs: two param groups (weight decay on, and off:
Megatron's default split of 1-D parameters), each with the step and this run's AdamW
hyperparameters, and ``content_metadata = {"distrib_optim_sharding_type": "fully_reshardable"}``.
Megatron pairs saved groups with its own by ``max_lr``, ``min_lr``, ``wd_mult``, ``lr_mult``
and a few flags, so load into a run with the same ``--lr`` / ``--min-lr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardsmith.errors import ConfigError
from shardsmith.layout import optim_fqn

STATE = "optimizer.state."
#: Our prefix -> Megatron's state kind.
KINDS = {optim_fqn(k, ""): k for k in ("exp_avg", "exp_avg_sq")}
BUCKET_SPACE = "optimizer.distributed."
SHARDING_TYPE = "fully_reshardable"


@dataclass
class MegatronOptim:
    """What of a Megatron optimizer state an import carries over."""

    step: int
    main_params: bool  # fp32 ``optimizer.state.param.*`` present


def find_param_groups(common: Any) -> list[dict[str, Any]] | None:
    """The optimizer's ``param_groups`` somewhere in the common state (depth-first), or None."""
    if isinstance(common, dict):
        groups = common.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            return groups
        values = list(common.values())
    elif isinstance(common, (list, tuple)):
        values = list(common)
    else:
        return None
    for value in values:
        found = find_param_groups(value)
        if found is not None:
            return found
    return None


def optimizer_layout(
    keys: set[str], model_keys: list[str], common: Any, source: str
) -> tuple[MegatronOptim | None, list[str]]:
    """Which optimizer state of a checkpoint can be imported, and notes on what cannot.

    Args:
        keys: every tensor key of the checkpoint.
        model_keys: the Megatron keys of the model's parameters (stacked or per layer).
        common: the decoded common state (None when unreadable).

    Returns:
        (state to import or None, notes for the report).

    Raises:
        ConfigError: model-space moments are present for some parameters only, or the param
            groups disagree on the step (names what is wrong).
    """
    notes: list[str] = []
    if any(k.startswith(BUCKET_SPACE) for k in keys):
        notes.append(
            "optimizer.distributed.* (Megatron distributed-optimizer state in the "
            "dp_reshardable bucket layout, which depends on the saving run's DDP buckets; "
            "not converted: re-save with Megatron-LM --dist-ckpt-optim-fully-reshardable "
            "to import it, or start from these weights with `train --init-from`)"
        )
    wanted = [f"{STATE}{kind}.{k}" for k in model_keys for kind in KINDS.values()]
    present = [k for k in wanted if k in keys]
    if not present:
        return None, notes
    if len(present) != len(wanted):
        missing = sorted(set(wanted) - set(present))
        raise ConfigError(
            f"{source}: Adam state is partial ({len(missing)} of {len(wanted)} moment "
            f"tensors missing, e.g. {missing[:2]}); nothing was imported"
        )
    groups = find_param_groups(common)
    steps: set[float] = {
        float(g["step"]) for g in groups or [] if isinstance(g.get("step"), (int, float))
    }
    if len(steps) != 1:
        why = (
            "the checkpoint's common state is unreadable or has no optimizer param_groups"
            if not steps
            else f"its param groups are at different steps {sorted(steps)}"
        )
        notes.append(
            f"optimizer.state.* (Adam moments not converted: {why}, and Adam cannot resume "
            "without its step; start from these weights with `train --init-from`)"
        )
        return None, notes
    main = all(f"{STATE}param.{k}" in keys for k in model_keys)
    return MegatronOptim(step=int(next(iter(steps))), main_params=main), notes


def megatron_param_groups(config: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """Megatron's two default param groups (weight decay, then none) for a shardsmith config."""
    optim = config.get("optim", {})
    lr = float(optim.get("lr", 3e-3))
    group = {
        "is_expert_parallel": False,
        "default_config": True,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": lr,
        "min_lr": lr * float(optim.get("min_lr_ratio", 0.1)),
        "lr": lr,
        "betas": (float(optim.get("beta1", 0.9)), float(optim.get("beta2", 0.95))),
        "eps": float(optim.get("eps", 1e-8)),
        "weight_decay": float(optim.get("weight_decay", 0.1)),
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
        "step": float(step),
    }
    return [{**group, "wd_mult": 1.0}, {**group, "wd_mult": 0.0}]


def optimizer_common(config: dict[str, Any], step: int) -> dict[str, Any]:
    """The ``optimizer`` entry and ``content_metadata`` of an exported common state."""
    return {
        "optimizer": {
            "optimizer": {"param_groups": megatron_param_groups(config, step)},
            "param_state_sharding_type": SHARDING_TYPE,
        },
        "content_metadata": {"distrib_optim_sharding_type": SHARDING_TYPE},
    }


def common_steps(
    manifest_tensors: dict[str, Any], read_step: Any, fqns: list[str], source: str
) -> int:
    """The one Adam step of a shardsmith checkpoint's ``optim.step.*`` tensors.

    Raises:
        ConfigError: the parameters are at different steps (Megatron keeps one per group).
    """
    steps = {
        float(read_step(optim_fqn("step", fqn)))
        for fqn in fqns
        if optim_fqn("step", fqn) in manifest_tensors
    }
    if len(steps) != 1:
        raise ConfigError(
            f"{source}: parameters are at Adam steps {sorted(steps)[:4]}; Megatron keeps "
            "one step per param group. Export without optimizer state is not offered "
            "silently: fix the checkpoint or export its weights with --no-optimizer"
        )
    return int(steps.pop())


def step_tensor(step: int) -> torch.Tensor:
    """Our ``optim.step.<fqn>`` value for Megatron's group step."""
    return torch.tensor(float(step), dtype=torch.float32)
