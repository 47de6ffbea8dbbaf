#!/usr/bin/env bash
# Activation checkpointing on one GPU (issue 32): dense-1.3B, 8 x 2048 tokens, bf16. The PyTorch
# peer's eager, per-block torch.utils.checkpoint and checkpoint + save_on_cpu runs
# (../shared/bench/peer_torch_gpt.py --checkpoint), then Strata without checkpointing, with every
# block checkpointed (on the device and with cpu_checkpointing) and with selective checkpointing:
# the same config (configs/bench_dense_bf16.json) with only the activation_checkpointing block
# added. Each line gives tok/s and mem_GiB (the caching allocator's peak).
#   bench/run_actckpt.sh PEER_SCRIPT [BUILD_DIR]      (BUILD_DIR default: build)
set -uo pipefail
cd "$(dirname "$0")/.."
peer="$1"
bin="${2:-build}/bin"
python3 "$peer" --checkpoint
"$bin/strata-bench" gpt --config configs/bench_dense_bf16.json --model dense-1.3B
"$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt.json --model dense-1.3B \
  --activation-checkpointing every
"$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt_cpu.json --model dense-1.3B \
  --activation-checkpointing every
"$bin/strata-bench" gpt --config configs/bench_dense_bf16_ckpt.json --model dense-1.3B \
  --activation-checkpointing selective
