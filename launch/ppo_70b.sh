#!/usr/bin/env bash
""":"
# PPO with a critic on Llama-3-70B, 8 nodes x 8 GPUs (configs/ppo_70b.yaml explains every choice).
# This file is valid bash and valid Python; all of these start the same run:
#
#   torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:PORT \
#       launch/ppo_70b.sh key=value ...           # on every node
#   NNODES=8 NODE_RANK=i MASTER_ADDR=HOST bash launch/ppo_70b.sh key=value ...   # on every node
#   srun --nodes 8 --ntasks-per-node 1 bash launch/ppo_70b.sh key=value ...      # Slurm
#
#   bash launch/ppo_70b.sh --dry-run [--gpu-memory-gb 80] [--gpu H100] [key=value ...]
#       prints each GPU's memory plan for the whole cluster on one CPU machine, exits 1 when a GPU
#       does not fit (and lists layouts that do)
#
# key=value arguments go to python -m verl.trainer.main_ppo (last wins); NCCL settings and the
# cluster variables are described in launch/common.sh.
set -euo pipefail
VERL_DEFAULT_NPROC=8
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
verl_launch "${BASH_SOURCE[0]}" "$@"
exit 1
":"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl.trainer.launcher import launcher_entry, run_recipe  # noqa: E402 - after the path


def main() -> int:
    return run_recipe("ppo_70b", sys.argv[1:], dry_run_model_config="llama3_70b")


launcher_entry(__name__, main)
