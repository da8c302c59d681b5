"""Accelerators the dry run and the planner know, and what a GPU process holds besides tensors.

Pure (no torch). ``memory_nbytes`` is what ``nvidia-smi --query-gpu=memory.total`` reports
(MiB), the memory a process can ask for before the CUDA context; ``peak_bf16_flops`` is the
vendor's dense (no structured sparsity) BF16 tensor-core peak; ``nvlink_bytes_per_s`` the
per-GPU NVLink bandwidth in one direction; ``network_bytes_per_s`` the per-GPU scale-out link
of the reference systems (one 400 Gb/s NIC per GPU on DGX A100/H100/H200/B200 with
ConnectX-7/-6, 200 Gb/s on DGX A100's ConnectX-6).

Sources: NVIDIA A100 datasheet (312 TFLOPS BF16 dense, 600 GB/s NVLink total = 300 GB/s a
direction); NVIDIA H100 datasheet, SXM5 column (989 TFLOPS BF16 dense, 900 GB/s NVLink =
450 GB/s a direction); NVIDIA H200 datasheet (141 GB, same compute as H100 SXM); NVIDIA DGX
B200 datasheet (72 PFLOPS FP8 training / 8 GPUs = 9 PF FP8 sparse; BF16 dense 2.25 PF per
GPU, 1.8 TB/s NVLink 5 = 900 GB/s a direction, 1,440 GB for 8 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsmith.errors import ConfigError
from shardsmith.layout import ParallelDims

MiB, GiB = 1 << 20, 1 << 30
#: GPUs per node of the reference systems above (DGX A100/H100/H200/B200): ``plan``'s default
#: and the node the dry run's step time assumes.
GPUS_PER_NODE = 8

#: CUDA context, cuBLAS/cuDNN workspaces and loaded kernels of one PyTorch process: 0.5-1 GiB
#: on Ampere/Hopper (PyTorch "CUDA semantics" notes; nvidia-smi of an idle ``torch.cuda.init()``
#: process shows ~500 MiB, cuBLAS adds its workspace); 1 GiB assumed.
CUDA_CONTEXT_NBYTES = 1 * GiB
#: NCCL buffers per communicator a rank belongs to: NCCL_BUFFSIZE (4 MiB default) per channel
#: and peer, up to 32 channels on NVLink (NCCL docs, "Environment variables"); 256 MiB assumed
#: per process group of size > 1 (tp, dp, pp, ep).
NCCL_COMM_NBYTES = 256 * MiB
#: PyTorch's caching allocator reserves more than it hands out (block rounding, fragmentation
#: between the FSDP all-gather buffers and activations): 10 % of the tracked peak assumed
#: (``torch.cuda.memory_reserved`` over ``max_memory_allocated`` of 1.05-1.15 in torchtitan
#: and Megatron memory reports). ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lowers it.
ALLOCATOR_MARGIN = 0.10


@dataclass(frozen=True)
class Gpu:
    """One accelerator kind (module doc for the sources)."""

    name: str
    memory_nbytes: int
    peak_bf16_flops: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("a100-80gb", 81920 * MiB, 312e12, 300e9, 25e9),
        Gpu("h100", 81559 * MiB, 989e12, 450e9, 50e9),
        Gpu("h200", 143771 * MiB, 989e12, 450e9, 50e9),
        Gpu("b200", 183359 * MiB, 2250e12, 900e9, 50e9),
    )
}
ALIASES = {
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "b200-sxm": "b200",
}


def gpu(name: str) -> Gpu:
    """The :class:`Gpu` called ``name`` (case-insensitive; e.g. ``h100``, ``H100-SXM``).

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ConfigError(
            f"--gpu {name!r}: unknown accelerator; known: {', '.join(GPUS)} "
            "(or give --gpu-memory SIZE)"
        )
    return GPUS[key]


def process_overhead_nbytes(num_groups: int) -> int:
    """Bytes a GPU process holds outside PyTorch's allocator: the CUDA context plus NCCL
    buffers of ``num_groups`` communicators (module constants)."""
    return CUDA_CONTEXT_NBYTES + num_groups * NCCL_COMM_NBYTES


def process_groups(dims: ParallelDims) -> int:
    """NCCL communicators a rank belongs to: one per mesh axis of degree > 1 (tp, pp,
    dp_shard, dp_replicate, cp), the flattened ``dp_shard_cp`` group FSDP shards over when
    cp > 1 (``trainer/context_parallel/mesh.py fsdp_mesh``), plus the HSDP pair's flattened
    data-parallel group. Expert parallelism reuses the dp_shard ranks' group."""
    axes = [dims.tp, dims.pp, dims.dp_shard, dims.dp_replicate, dims.cp]
    flattened_cp = 1 if dims.cp > 1 else 0
    hsdp = 1 if dims.dp_shard * dims.cp > 1 and dims.dp_replicate > 1 else 0
    return sum(1 for d in axes if d > 1) + flattened_cp + hsdp
