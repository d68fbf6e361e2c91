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
    # (Megatron's checkpoint writer, DataLoader workers): that child dies with the trainer.
    from verl.utils.process import exit_with_parent

    exit_with_parent()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate, train; returns the process exit status."""
    from verl.config import CONFIG_DIR, SFTConfig, parse_cli
    from verl.trainer.startup import prepare_run
    from verl.utils.cli import fail, user_errors
    from verl.utils.logging import log_rank0
    from verl.utils.paths import check_dir

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_cli(
        SFTConfig,
        argv,
        prog=PROG,
        default_config_file=str(CONFIG_DIR / "sft_trainer.yaml"),
        world_size=world_size,
    )
    prepare_run(cfg.trainer)
    from verl.trainer.sft_trainer import SFTTrainer, check_sft_outputs, check_sft_paths

    with user_errors(PROG):
        if cfg.model.tokenizer_path:
            check_dir(cfg.model.tokenizer_path, "model.tokenizer_path",
                      fix="give the tokenizer directory, or leave it unset to use model.path's")
        check_sft_paths(cfg)
        check_sft_outputs(cfg)
    if cfg.trainer.device == "cpu":
        # Megatron chooses CUDA whenever it is visible; hide it before anything initialises it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from verl.parallel.bootstrap import destroy_distributed, init_distributed

    try:
        init_distributed(device=cfg.trainer.device)
    except ValueError as exc:
        fail(PROG, f"trainer.device={cfg.trainer.device}: {exc}")
    try:
        # A setting that only the data or the model reveals (run length, shapes, a bad row);
        # the finally below tears the world down.
        with user_errors(PROG):
            trainer = SFTTrainer(cfg)
            with trainer:  # closing it lists the run's outputs: the last lines a user reads
                metrics = trainer.fit()
                log_rank0(
                    logging.getLogger("verl.trainer.main_sft"),
                    logging.INFO,
                    "done: step %d, %s",
                    trainer.global_step,
                    ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())),
                )
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
