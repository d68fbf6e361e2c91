"""PPO / GRPO entry point: a thin command line over :class:`verl.trainer.rl_trainer.RLTrainer`.

    torchrun --nproc_per_node=2 -m verl.trainer.main_ppo --config grpo_tiny_cpu key=value ...
    python -m verl.trainer.main_ppo --config ppo_tiny_cpu actor_rollout_ref.model.path=DIR ...
    python3 -m verl.trainer.main_ppo --config-path=FILE.yaml model.pretrained_model_name_or_path=DIR \\
        data.train_files=... data.val_files=... trainer.num_epochs=1 trainer.batch_size_per_device=8
    python -m verl.trainer.main_ppo --help                     # every option, and the aliases

Started without torchrun it runs as a world of one process. Before anything is built the
config is checked against the launched world size (layouts, batch sizes, registry names), and
``verl.trainer.ppo_checks`` checks the files, the roles the algorithm needs, the data sources'
scorers and the output locations: a problem exits with status 2 and a message naming the
setting at fault.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

PROG = "python -m verl.trainer.main_ppo"

if __name__ == "__mp_main__":
    # This module is the parent's __main__, imported by one of its multiprocessing children
    # (Megatron's checkpoint writer, DataLoader or reward workers): that child dies with the trainer.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check, train; returns the process exit status."""
    from verl.utils.logging import setup_logging

    setup_logging(logging.INFO)  # before parsing: the aliases are logged as they are read
    from verl.config import CONFIG_DIR, PPOConfig, parse_cli

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_cli(
        PPOConfig,
        argv,
        prog=PROG,
        default_config_file=str(CONFIG_DIR / "ppo_trainer.yaml"),
        world_size=world_size,
    )
    from verl.trainer.startup import prepare_run

    prepare_run(cfg.trainer)  # before the trainer's imports: they bring Megatron-core, which probes for W&B
    from verl.trainer.entry import run_trainer
    from verl.trainer.ppo_checks import check_ppo_inputs
    from verl.trainer.rl_trainer import RLTrainer

    return run_trainer(
        cfg, prog=PROG, check=check_ppo_inputs, make_trainer=RLTrainer, summary=lambda _, m: _summary(m)
    )


def _summary(metrics: dict[str, float]) -> str:
    keys = [k for k in sorted(metrics) if k.startswith("val-core/")] + ["critic/score/mean"]
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


if __name__ == "__main__":
    raise SystemExit(main())
