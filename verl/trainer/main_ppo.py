"""PPO / GRPO entry point: a thin command line over :class:`verl.trainer.ppo_trainer.PPOTrainer`.

    torchrun --nproc_per_node=2 -m verl.trainer.main_ppo --config grpo_tiny_cpu key=value ...
    python -m verl.trainer.main_ppo --config ppo_tiny_cpu actor_rollout_ref.model.path=DIR ...
    python3 -m verl.trainer.main_ppo --config-path=FILE.yaml model.pretrained_model_name_or_path=DIR \\
        data.train_files=... data.val_files=... trainer.num_epochs=1 trainer.batch_size_per_device=8
    python -m verl.trainer.main_ppo --help                     # every option, and the aliases
    python -m verl.trainer.main_ppo --config ppo_70b --dry-run [--gpu-memory-gb 80] [--gpu H100] \
        [--model-config llama3_70b]                             # per-GPU memory plan, no GPU needed

Started without torchrun it runs as a world of one process. Before anything is built the
config is checked against the launched world size (layouts, batch sizes, registry names), and
``verl.trainer.ppo_checks`` checks the files, the roles the algorithm needs, the data sources'
scorers and the output locations: a problem exits with status 2 and a message naming the
setting at fault.

``--dry-run`` trains nothing: on one CPU process it builds the config's full-size placement
(``trainer.nnodes x n_gpus_per_node`` ranks, simulated) on meta tensors and prints each GPU's
memory plan (``verl.planning``); it exits 0 when every GPU fits ``--gpu-memory-gb``, else 1 after
printing layouts that fit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl.config import PPOConfig

PROG = "python -m verl.trainer.main_ppo"

if __name__ == "__mp_main__":
    # This module is the parent's __main__, imported by one of its multiprocessing children
    # (the reward pool's spawned workers, a DataLoader under a spawn context): that child dies with the trainer.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def main(argv: Sequence[str] | None = None, *, on_config: Callable[[PPOConfig], None] | None = None) -> int:
    """Parse, check, train; returns the process exit status.

    ``on_config`` is called with the parsed config of a training run (not of a dry run) before it
    starts: the launchers read the run's own output folders from it for their closing summary.
    """
    from verl.utils.process import die_with_launcher

    die_with_launcher()  # a kill -9 of torchrun takes this rank along
    from verl.utils.logging import setup_logging

    setup_logging(logging.INFO)  # before parsing: the aliases are logged as they are read
    import sys

    from verl.config import CONFIG_DIR, PPOConfig, parse_cli
    from verl.planning.cli import DRY_RUN_FLAGS, pop_dry_run_flags, run_dry_run
    from verl.utils.cli import fail, user_errors

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # the config's options follow, from parse_cli
        sys.stdout.write("dry run (plans the cluster, trains nothing):\n" + "".join(
            f"  {flag:<16} {text}\n" for flag, text in DRY_RUN_FLAGS.items()) + "\n")
    try:
        dry_run, argv = pop_dry_run_flags(argv)
    except ValueError as exc:
        fail(PROG, str(exc))
    # A dry run plans the declared cluster (trainer.nnodes x n_gpus_per_node), not this process.
    world_size = None if dry_run else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_cli(
        PPOConfig,
        argv,
        prog=PROG,
        default_config_file=str(CONFIG_DIR / "ppo_trainer.yaml"),
        world_size=world_size,
    )
    if dry_run is not None:
        with user_errors(PROG):
            return run_dry_run(cfg, dry_run)
    if on_config is not None:
        on_config(cfg)
    from verl.trainer.startup import prepare_run

    prepare_run(cfg.trainer)  # before the trainer's imports: they bring Megatron-core, which probes for W&B
    from verl.trainer.entry import run_trainer
    from verl.trainer.ppo_checks import preflight
    from verl.trainer.ppo_trainer import PPOTrainer

    return run_trainer(
        cfg,
        prog=PROG,
        check=lambda c: preflight(c, world_size, whole_run=True),  # once: the trainer finds this config checked
        make_trainer=PPOTrainer,
        summary=lambda _, m: _summary(m),
    )


def _summary(metrics: dict[str, float]) -> str:
    keys = [k for k in sorted(metrics) if k.startswith("val-core/")] + ["critic/score/mean"]
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


if __name__ == "__main__":
    raise SystemExit(main())
