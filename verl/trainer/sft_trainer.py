"""Supervised fine-tuning on the Megatron model: ``SFTTrainer(cfg).fit()``.

Every rank of the torchrun world runs the same loop (SPMD). One step:

1. the data loader yields the global batch (``data.train_batch_size`` rows, identical on
   every rank: same seed, same position); each data-parallel rank takes its contiguous
   slice of ``train_batch_size / dp`` rows;
2. the loss is the masked token mean of ``-log p(response token)`` over the *global* batch
   (``verl.algos.agg_loss`` with ``GlobalBatchInfo`` counted over DP), so micro-batch and
   DP sizes do not change the gradient;
3. ``MegatronEngine.train_step``: forward/backward in micro-batches of
   ``data.micro_batch_size_per_gpu``, gradient clipping, optimizer and LR-scheduler step.

A vision-language model directory (``verl.data.vlm.is_vlm_dir``: a Qwen2.5-VL) trains the same way:
the data set reads each row's images (``data.image_key``) with the model's image processor, the
batch's ``mm_*`` columns go with the rows through the DP slice and the micro-batches to the Megatron
VLM's forward (``verl.models.megatron_vlm``), and the loss is on the response tokens only.

Validation loss every ``trainer.test_freq`` steps (and at the end), checkpoints every
``trainer.save_freq`` steps (and at the end) through :class:`CheckpointManager`, in the
layout the RL trainer uses (``global_step_N/actor`` = ``MegatronEngine.save``), and a
Hugging Face export of the final model (``trainer.save_hf``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from verl.algos import GlobalBatchInfo, agg_loss
from verl.config import SFTConfig, to_dict
from verl.data.sampler import StatefulDataLoader
from verl.data.sft_dataset import SFTDataset
from verl.data.tokenizer import load_tokenizer
from verl.data.vlm import ImagePromptEncoder, is_vlm_dir
from verl.engine import LossShare, MegatronEngine, lr_schedule_steps
from verl.parallel import megatron_state
from verl.trainer.run_checks import as_file_list, check_run_outputs, missing_inputs, release_run_outputs, show_files
from verl.trainer.run_checks import hf_export_dir as run_hf_export_dir
from verl.trainer.startup import run_outputs
from verl.trainer.tracking import Tracking, progress_bar
from verl.utils.checkpoint import ACTOR_SUBDIR, CheckpointManager
from verl.utils.logging import log_rank0

logger = logging.getLogger(__name__)

__all__ = ["SFTTrainer", "check_sft_outputs", "check_sft_paths", "hf_export_dir", "sft_loss_sums"]



def check_sft_paths(cfg: SFTConfig) -> None:
    """Fail early (ValueError naming the field) when the model or data files are not there."""
    problems = missing_inputs(
        models={"model.path": cfg.model.path},
        data={"data.train_files": cfg.data.train_files, "data.val_files": cfg.data.val_files},
    )
    if problems:
        raise ValueError("; ".join(problems))


def hf_export_dir(cfg: SFTConfig) -> str:
    """Where ``trainer.save_hf`` writes the final model (``<default_local_dir>/huggingface`` by default)."""
    return run_hf_export_dir(cfg.trainer)


def check_sft_outputs(cfg: SFTConfig) -> None:
    """Fail early (``OutputPathError`` naming the setting) when an output location cannot be used
    (``verl.trainer.run_checks.check_run_outputs``)."""
    check_run_outputs(
        cfg.trainer,
        inputs={
            "model.path": cfg.model.path,
            "model.tokenizer_path": cfg.model.tokenizer_path,
            "data files": as_file_list(cfg.data.train_files) + as_file_list(cfg.data.val_files),
        },
    )


def sft_loss_sums(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of -log p over target tokens, number of target tokens) of logprobs/loss_mask [B, T]."""
    mask = loss_mask.to(logprobs.dtype)
    return -(logprobs * mask).sum(), mask.sum()


class SFTTrainer:
    """The SFT loop on an initialised torch.distributed world (see module docstring).

    Builds Megatron's parallel state from ``cfg.megatron`` itself; call :meth:`close`
    (or use it as a context manager) to tear it down.
    """

    def __init__(self, cfg: SFTConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "SFTTrainer needs torch.distributed initialised (python -m verl.trainer.main_sft does it)"
            )
        cfg.validate(world_size=dist.get_world_size())
        check_sft_paths(cfg)
        check_sft_outputs(cfg)
        self.cfg = cfg
        # Loggers first: one that cannot start fails before any model is built.
        self.tracking = Tracking(
            backends=cfg.trainer.logger,
            project_name=cfg.trainer.project_name,
            experiment_name=cfg.trainer.experiment_name,
            log_dir=cfg.trainer.log_dir,
            config=to_dict(cfg),
            outputs=run_outputs(cfg.trainer),
        )
        try:
            self._build()
        except BaseException:
            self.tracking.close(list_outputs=False)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        m = cfg.megatron
        self.pg = megatron_state.initialize_model_parallel(
            tensor_model_parallel_size=m.tensor_model_parallel_size,
            pipeline_model_parallel_size=m.pipeline_model_parallel_size,
            context_parallel_size=m.context_parallel_size,
            virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
            seed=m.seed,
        )
        self.dp_size = self.pg.dp.size()
        self.dp_rank = self.pg.dp.rank()
        tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
        self.tokenizer = load_tokenizer(
            os.path.expanduser(tokenizer_path), trust_remote_code=cfg.model.trust_remote_code
        )
        self.processor = None
        """A vision-language model's image processor (``verl.data.vlm.ImagePromptEncoder``), None for text."""
        if is_vlm_dir(os.path.expanduser(cfg.model.path)):
            self.processor = ImagePromptEncoder.from_pretrained(
                os.path.expanduser(cfg.model.path), tokenizer=self.tokenizer,
                trust_remote_code=cfg.model.trust_remote_code,
            )
        self.train_dataset = self._dataset(cfg.data.train_files)
        self.val_dataset = self._dataset(cfg.data.val_files) if cfg.data.val_files else None
        self.loader = StatefulDataLoader(
            self.train_dataset,
            batch_size=cfg.data.train_batch_size,
            shuffle=True,
            seed=cfg.trainer.seed,
            drop_last=True,
        )
        self.steps_per_epoch = len(self.loader)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * self.steps_per_epoch
        schedule_steps = (
            cfg.optim.total_training_steps if cfg.optim.total_training_steps > 0 else self.total_steps
        )
        lr_schedule_steps(cfg.optim, schedule_steps)  # a bad warm-up fails here, before the model is built
        self.engine = MegatronEngine(
            model=cfg.model,
            megatron=cfg.megatron,
            pg=self.pg,
            optim=cfg.optim,
            total_training_steps=schedule_steps,
            max_sequence_length=max(cfg.data.max_length, 1),
        )
        self.checkpoints = CheckpointManager(
            cfg.trainer.default_local_dir, max_to_keep=cfg.trainer.max_ckpt_to_keep
        )
        self.global_step = 0
        self._last_saved_step: int | None = None
        self._resumed = False
        val = (f"validation {show_files(cfg.data.val_files)} ({len(self.val_dataset)} rows)"
               if self.val_dataset is not None else "no validation")
        log_rank0(
            logger,
            logging.INFO,
            "SFT: model %s; training %s (%d rows, %d steps per epoch of %d rows); %s; %d steps in all, dp=%d",
            os.path.abspath(os.path.expanduser(cfg.model.path)),
            show_files(cfg.data.train_files),
            len(self.train_dataset),
            self.steps_per_epoch,
            cfg.data.train_batch_size,
            val,
            self.total_steps,
            self.dp_size,
        )

    def _dataset(self, files: str | list[str]) -> SFTDataset:
        d = self.cfg.data
        return SFTDataset(
            [os.path.expanduser(f) for f in ([files] if isinstance(files, str) else files)],
            self.tokenizer,
            max_length=d.max_length,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            messages_key=d.multiturn.messages_key if d.multiturn.enable else None,
            truncation=d.truncation,
            processor=self.processor,
            image_key=d.image_key,
        )

    # ------------------------------------------------------------------------------------------

    def _local_rows(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_rank = self.cfg.data.train_batch_size // self.dp_size
        sl = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        return {k: v[sl] for k, v in batch.items()}

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on a global batch; returns its metrics."""
        local = self._local_rows(batch)
        loss_mask = local["loss_mask"].float()  # [b, T]
        info = GlobalBatchInfo.from_masks([loss_mask], group=self.pg.dp)

        def loss_fn(outputs: Mapping[str, torch.Tensor], micro: Mapping[str, torch.Tensor]):
            mask = micro["loss_mask"].to(outputs["logprobs"].dtype)
            return LossShare(agg_loss(-outputs["logprobs"], mask, "token-mean", global_batch_info=info))

        start = time.perf_counter()
        result = self.engine.train_step(
            local, micro_batch_size=self.cfg.data.micro_batch_size_per_gpu, loss_fn=loss_fn
        )
        elapsed = time.perf_counter() - start
        return {
            "train/loss": result.loss,
            "train/grad_norm": result.grad_norm,
            "train/lr": result.lr,
            "train/num_tokens": info.batch_num_tokens,
            "train/update_skipped": float(not result.update_successful),
            "perf/step_time_s": elapsed,
            "perf/tokens_per_s": info.batch_num_tokens / max(elapsed, 1e-9),
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean loss on the validation set (every rank gets the same number)."""
        if self.val_dataset is None:
            return {}
        n = len(self.val_dataset)
        mine = list(range(self.dp_rank, n, self.dp_size))  # strided: DP ranks split the rows
        mbs = self.cfg.data.micro_batch_size_per_gpu
        chunk = mbs * 8
        sums = torch.zeros(2, dtype=torch.float64)
        for start in range(0, len(mine), chunk):
            items = [self.val_dataset[i] for i in mine[start : start + chunk]]
            batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
            out = self.engine.forward(batch, micro_batch_size=mbs)
            nll, tokens = sft_loss_sums(out.outputs["logprobs"].cpu(), batch["loss_mask"])
            sums += torch.tensor([float(nll), float(tokens)], dtype=torch.float64)
        if self.dp_size > 1:
            sums = sums.to(self.engine.device)
            dist.all_reduce(sums, group=self.pg.dp)
            sums = sums.cpu()
        nll, tokens = sums.tolist()
        loss = nll / max(tokens, 1.0)
        return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0))}

    def save_checkpoint(self) -> str:
        """Checkpoint the engine and the data position at the current step (collective)."""
        state = {"dataloader": self.loader.state_dict(), "total_steps": self.total_steps}
        path = self.checkpoints.save(
            self.global_step, lambda tmp: self.engine.save(os.path.join(tmp, ACTOR_SUBDIR)), state
        )
        self._last_saved_step = self.global_step
        return path

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` selects (if any); returns the step to continue from.

        Runs once: later calls (``fit`` calls it) return the step without loading again.
        """
        if self._resumed:
            return self.global_step
        self._resumed = True
        t = self.cfg.trainer
        found = self.checkpoints.resolve_resume(t.resume_mode, t.resume_from_path)
        if found is not None:
            state = self.checkpoints.read_trainer_state(found.path)
            self.engine.load(os.path.join(found.path, ACTOR_SUBDIR))
            self.loader.load_state_dict(state["dataloader"])
            self.global_step = int(state["global_step"])
            self._last_saved_step = self.global_step
            log_rank0(logger, logging.INFO, "resumed from %s (step %d)", found.path, self.global_step)
        # Steps after the checkpoint are re-done: their old records go from the metrics files.
        self.tracking.rewind(self.global_step)
        return self.global_step

    def fit(self, *, stop_after: int | None = None) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming first); returns the last train and validation metrics.

        ``stop_after`` ends the loop after that global step without the end-of-run actions
        (validation, save, export), as if the run were interrupted there.
        """
        from verl.parallel.bootstrap import end_startup

        t = self.cfg.trainer
        self.resume()
        end_startup()  # from here collectives wait trainer.collective_timeout_s (verl.parallel.bootstrap)
        bar = progress_bar(total=self.total_steps, initial=self.global_step, desc="sft", enabled=t.progress_bar)
        last: dict[str, float] = {}
        val: dict[str, float] = {}
        interrupted = False
        try:
            while self.global_step < self.total_steps:
                for batch in self.loader:
                    self.global_step += 1
                    metrics = self.train_step(batch)
                    metrics["train/epoch"] = self.loader.epoch + self.loader.offset / max(
                        len(self.train_dataset), 1
                    )
                    if t.test_freq > 0 and self.global_step % t.test_freq == 0:
                        val = self.validate()
                        metrics.update(val)
                    self.tracking.log(metrics, self.global_step)
                    last = metrics
                    bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                    bar.update(1)
                    if t.save_freq > 0 and self.global_step % t.save_freq == 0:
                        self.save_checkpoint()
                    if stop_after is not None and self.global_step >= stop_after:
                        interrupted = True
                        break
                    if self.global_step >= self.total_steps:
                        break
                if interrupted:
                    break
        finally:
            bar.close()
        if interrupted:
            return {**last, **val}
        if t.test_freq > 0 and (self.global_step % t.test_freq != 0 or not val):
            val = self.validate()
            self.tracking.log(val, self.global_step)
        if t.save_freq > 0 and self._last_saved_step != self.global_step:
            self.save_checkpoint()
        if t.save_hf:
            self.engine.export_hf(hf_export_dir(self.cfg))
        return {**last, **val}

    def close(self) -> None:
        """Close the loggers (listing the run's outputs), tear down Megatron's parallel state and
        release the run's output folders (their locks)."""
        self.tracking.close()
        megatron_state.destroy_model_parallel()
        release_run_outputs(self.cfg.trainer)

    def __enter__(self) -> "SFTTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
