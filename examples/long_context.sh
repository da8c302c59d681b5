#!/usr/bin/env bash
# Long context on this machine: a tiny Llama at 4,096 tokens per sequence, split over 4 ranks
# by context parallelism (each holds 2 of 8 load-balanced chunks), then over cp 2 x tp 2,
# saved, and resumed with no context parallelism at all (cp 1 x dp_shard 4): checkpoints do
# not depend on cp, so the resume is an ordinary layout change. Run from anywhere with the
# project installed; ROOT (default: a fresh temp dir) receives the runs.
set -euo pipefail
ROOT=${ROOT:-$(mktemp -d)}
M="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-kv-heads 2 --seq-length 4096
   --rope-scaling-factor 8 --rope-original-seq-length 512 --micro-batch-size 1 --global-batch-size 4"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2086
shardsmith train --nproc-per-node 4 --cp 4 $M --steps 2 --save-interval 2 --ckpt "$ROOT/cp4"
# shellcheck disable=SC2086
shardsmith train --nproc-per-node 4 --cp 2 --tp 2 $M --steps 4 --save-interval 2 --ckpt "$ROOT/cp2tp2"
# shellcheck disable=SC2086
shardsmith train --nproc-per-node 4 --dp-shard 4 $M --steps 4 --ckpt "$ROOT/cp1" --resume "$ROOT/cp2tp2/step-000000002"
shardsmith ls "$ROOT/cp2tp2"
echo "runs under $ROOT"
