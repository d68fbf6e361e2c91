"""Supervised fine-tuning entry point.

    python -m verl.trainer.main_sft model.path=DIR data.train_files=train.parquet data.val_files=test.parquet
    torchrun --nproc_per_node=2 -m verl.trainer.main_sft trainer.n_gpus_per_node=2 \
        megatron.tensor_model_parallel_size=2 ...
    python -m verl.trainer.main_sft --config sft_tiny_cpu model.path=DIR ...   # a file under configs/
    python -m verl.trainer.main_sft --help                                     # every option

Started without torchrun it runs as a world of one process. The config is checked against
the launched world size before anything is built; a bad key, value or layout, a missing
model directory or data file, an output location that cannot be written or would overwrite
something exits with status 2 and a message naming the field, before any model is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

PROG = "python -m verl.trainer.main_sft"

if __name__ == "__mp_main__":
    # This module is the parent's __main__, imported by one of its multiprocessing children
    # (a DataLoader worker under a spawn context): that child dies with the trainer.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate, train; returns the process exit status."""
    from verl.utils.process import die_with_launcher

    die_with_launcher()  # a kill -9 of torchrun takes this rank along
    from verl.config import CONFIG_DIR, SFTConfig, parse_cli
    from verl.utils.logging import setup_logging
    from verl.utils.paths import check_dir

    setup_logging(logging.INFO)  # before parsing: the aliases are logged as they are read
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_cli(
        SFTConfig,
        argv,
        prog=PROG,
        default_config_file=str(CONFIG_DIR / "sft_trainer.yaml"),
        world_size=world_size,
    )
    from verl.trainer.startup import prepare_run

    prepare_run(cfg.trainer)  # before the trainer's imports: they bring Megatron-core, which probes for W&B
    from verl.trainer.entry import run_trainer
    from verl.trainer.sft_trainer import SFTTrainer, check_sft_outputs, check_sft_paths

    def check(cfg: SFTConfig) -> None:
        if cfg.model.tokenizer_path:
            check_dir(cfg.model.tokenizer_path, "model.tokenizer_path",
                      fix="give the tokenizer directory, or leave it unset to use model.path's")
        check_sft_paths(cfg)
        check_sft_outputs(cfg)

    return run_trainer(
        cfg,
        prog=PROG,
        check=check,
        make_trainer=SFTTrainer,
        summary=lambda trainer, metrics: ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())),
    )


if __name__ == "__main__":
    raise SystemExit(main())
