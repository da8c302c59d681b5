"""How often FSDP2 exchanges a stage's parameters and gradients: the
``--fsdp-reshard-after-forward`` policy (torchtitan's ``fsdp_reshard_after_forward``).

Pure. ``always``: parameters are resharded after every forward, so every microbatch
all-gathers them twice (forward, backward) and reduce-scatters its gradients (the least
memory: one block's unsharded parameters and gradients at a time). ``never``: parameters
stay gathered from a step's first forward to its last backward and the gradients accumulate
unsharded in fp32, so a step all-gathers once and reduce-scatters once (PyTorch's
``PipelineStage`` with ``perform_reduce_grad``, Megatron's distributed optimizer and Llama 3's
"do not reshard after forward"); the price is the stage's parameters and gradients held
unsharded for the step. ``default``: ``never`` under pipelining, ``always`` without it, as
torchtitan does. In both policies the HSDP replica all-reduce runs once per step.
"""

from __future__ import annotations

#: The ``--fsdp-reshard-after-forward`` choices.
FSDP_RESHARD_POLICIES: tuple[str, ...] = ("default", "always", "never")


def reshards_after_forward(policy: str, pp: int) -> bool:
    """Whether FSDP2 reshards parameters after each forward under ``policy`` with ``pp``
    pipeline stages (``default``: not under pipelining, i.e. ``pp == 1``).

    Raises:
        ValueError: ``policy`` is not one of :data:`FSDP_RESHARD_POLICIES`.
    """
    if policy not in FSDP_RESHARD_POLICIES:
        raise ValueError(
            f"fsdp_reshard_after_forward={policy!r}: choose one of {', '.join(FSDP_RESHARD_POLICIES)}"
        )
    if policy == "default":
        return pp == 1
    return policy == "always"
