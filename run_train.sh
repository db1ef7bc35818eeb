#!/usr/bin/env bash
# Launch a training job the way TorchTitan's run_train.sh does: one torchrun on this node,
# the config from CONFIG_FILE, every further argument passed on as a --section.key override.
#
#   ./run_train.sh                                          # the main job: 2 ranks, llama3_debug_auto
#   NGPU=4 CONFIG_FILE=configs/llama3_debug.toml ./run_train.sh --training.steps 20
#   NGPU=8 LOG_RANK=0,1 CONFIG_FILE=configs/llama3_8b_h100.toml ./run_train.sh
#
# NGPU         ranks on this node (default 2: this project's CPU/gloo debug jobs; on a GPU node the
#              number of GPUs, one rank each)
# CONFIG_FILE  a config path or a bare name under configs/ (default configs/llama3_debug_auto.toml)
# LOG_RANK     local ranks whose output the console shows (default 0; torchrun --local-ranks-filter);
#              every rank's output is also written to torchrun's log folder (--tee 3, LOG_DIR if set)
# DRY_RUN=1    print the torchrun command instead of running it
set -euo pipefail

NGPU=${NGPU:-2}
CONFIG_FILE=${CONFIG_FILE:-configs/llama3_debug_auto.toml}
LOG_RANK=${LOG_RANK:-0}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cmd=(torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0"
     --local-ranks-filter "${LOG_RANK}" --role rank --tee 3)
if [ -n "${LOG_DIR:-}" ]; then
    cmd+=(--log-dir "${LOG_DIR}")
fi
cmd+=("${HERE}/train.py" --config "${CONFIG_FILE}" "$@")

if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
