#!/usr/bin/env bash
# Build the peers' interpreters for the benches (never a dependency of shardsmith or its tests).
#
#   . .venv/bin/activate && bash bench/peers/setup.sh [mcore] [bcp] [titan]   (default: all three)
#
# Each peer gets its own venv in the repo root (gitignored): .venv-mcore (Megatron-Core 0.19.2),
# .venv-bcp (ByteCheckpoint 0.0.2), .venv-titan (torchtitan 0.3.0). They reuse the torch of the
# interpreter that runs this script (a .pth line adds its site-packages after the venv's own), so
# no CUDA build of torch is fetched. Facts: shared/notes/peers-on-cpu.md, megatron-core-on-cpu.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=$(python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
PYV=$(python -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
mkvenv() {  # DIR: a venv that sees $BASE's torch
    python3 -m venv "$1"
    echo "import site; site.addsitedir('$BASE')" > "$1/lib/$PYV/site-packages/zz_torch.pth"
    "$1/bin/pip" install -q --upgrade pip >/dev/null
}
mcore() {  # 0.17+ declare Python >= 3.12 but run on 3.11; triton is imported unconditionally
    mkvenv .venv-mcore
    tmp=$(mktemp -d)
    .venv-mcore/bin/pip download -q --no-deps --ignore-requires-python -d "$tmp" megatron-core==0.19.2
    .venv-mcore/bin/pip install -q --no-deps --ignore-requires-python "$tmp"/megatron_core-*.whl
    .venv-mcore/bin/pip install -q triton psutil packaging
    rm -rf "$tmp"
}
bcp() {  # declares torch<=2.5 (pip would fetch a CUDA torch 2.5): --no-deps, then its own deps
    mkvenv .venv-bcp
    .venv-bcp/bin/pip install -q --no-deps bytecheckpoint==0.0.2
    .venv-bcp/bin/pip install -q "mmh3>=4.1,<=4.2" universal-pathlib cachetools safetensors numpy \
        typing-extensions grpcio==1.69.0 protobuf==3.20.3
    .venv-bcp/bin/pip install -q --no-deps -e .   # its ranks build the bench's model with shardsmith's code
}
titan() {  # trains on CPU with the shim in bench/peers/titan_ranks.py; triton is imported unconditionally
    mkvenv .venv-titan
    .venv-titan/bin/pip install -q --no-deps torchtitan==0.3.0
    .venv-titan/bin/pip install -q triton tyro tomli tokenizers datasets psutil einops tensorboard
    .venv-titan/bin/pip install -q --no-deps spmd_types==0.2.3 torchdata torch_checkpointing
}
for peer in "${@:-mcore bcp titan}"; do for p in $peer; do "$p"; echo "$p ready"; done; done
