#!/usr/bin/env bash
""":"
# GRPO on Qwen2-7B, one node of 8 GPUs (configs/grpo_7b.yaml explains every choice).
# This file is valid bash and valid Python; all of these start the same run:
#
#   torchrun --nproc_per_node 8 \
#       launch/grpo_7b.sh key=value ...
#   bash launch/grpo_7b.sh key=value ...
#   srun --nodes 1 --ntasks-per-node 1 bash launch/grpo_7b.sh key=value ...      # Slurm
#
#   bash launch/grpo_7b.sh --dry-run [--gpu-memory-gb 80] [--gpu H100] [key=value ...]
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



def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from verl.trainer.launcher import run_recipe

    return run_recipe("grpo_7b", sys.argv[1:], dry_run_model_config="qwen2_7b")


if __name__ == "__mp_main__":
    # torchrun runs this file as __main__, so its multiprocessing children (Megatron's checkpoint
    # writer, reward workers) import it again under this name: they must not start another run,
    # and they die with the trainer.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from verl.utils.process import exit_with_parent

    exit_with_parent()
elif __name__ == "__main__":
    raise SystemExit(main())
