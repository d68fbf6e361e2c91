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
import sys
from collections.abc import Sequence

PROG = "python -m verl.trainer.main_ppo"

if __name__ == "__mp_main__":
    # This module is the parent's __main__, imported by one of its multiprocessing children
    # (Megatron's checkpoint writer, DataLoader or reward workers): that child dies with the trainer.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def _fail(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # every rank exits; one of them says why
        sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check, train; returns the process exit status."""
    from verl.utils.logging import log_rank0, setup_logging

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
    from verl.trainer.ppo_checks import check_ppo_inputs

    try:
        check_ppo_inputs(cfg)
    except ValueError as exc:
        _fail(str(exc))
    if cfg.trainer.device == "cpu":
        # Megatron chooses CUDA whenever it is visible; hide it before anything initialises it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from verl.parallel.bootstrap import destroy_distributed, init_distributed

    try:
        init_distributed(device=cfg.trainer.device)
    except ValueError as exc:
        _fail(f"trainer.device={cfg.trainer.device}: {exc}")
    try:
        from verl.trainer.rl_trainer import RLTrainer

        try:
            trainer = RLTrainer(cfg)
        except ValueError as exc:  # a setting that only the data or the model reveals (run length, shapes)
            _fail(str(exc))  # the finally below tears the world down
        with trainer:
            metrics = trainer.fit()
        log_rank0(
            logging.getLogger("verl.trainer.main_ppo"),
            logging.INFO,
            "done: step %d, %s",
            trainer.global_step,
            _summary(metrics),
        )
    finally:
        destroy_distributed()
    return 0


def _summary(metrics: dict[str, float]) -> str:
    keys = [k for k in sorted(metrics) if k.startswith("val-core/")] + ["critic/score/mean"]
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


if __name__ == "__main__":
    raise SystemExit(main())
