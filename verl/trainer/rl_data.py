"""The RL trainer's data: the tokenizer, the training and validation sets and their loaders, and
the step's batches (prompts with a ``uid`` per prompt, or DPO's preference pairs as rows)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from verl.config import PPOConfig
from verl.data.preference_dataset import PAIR_SIDES, PreferencePairDataset
from verl.data.rl_dataset import build_dataloader, create_rl_dataset
from verl.data.tokenizer import load_tokenizer
from verl.data.vlm import ImagePromptEncoder, is_vlm_dir
from verl.protocol import Batch
from verl.trainer.ppo_checks import check_dataset_scorers
from verl.trainer.run_checks import as_file_list

__all__ = ["RLData", "to_batch"]


def to_batch(data: dict[str, Any]) -> Batch:
    """A loader's dict (tensors and lists) as a ``Batch``."""
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    return Batch.from_dict(tensors, {k: v for k, v in data.items() if k not in tensors})


class RLData:
    """The tokenizer, datasets and loaders of ``cfg.data``; :meth:`prompt_batch` and
    :meth:`preference_batch` give each step's batch, epoch after epoch (``trainer.total_epochs``).
    The loader's position is checkpointed (:meth:`state_dict`)."""

    def __init__(self, cfg: PPOConfig) -> None:
        arr = cfg.actor_rollout_ref
        self.cfg = cfg
        self.tokenizer = load_tokenizer(
            os.path.expanduser(cfg.data.tokenizer or arr.model.tokenizer_path or arr.model.path),
            trust_remote_code=arr.model.trust_remote_code,
        )
        model_dir = os.path.expanduser(arr.model.path or "")
        # A vision-language model's prompts carry images: its processor reads them (verl.data.vlm).
        self.processor = (
            ImagePromptEncoder.from_pretrained(model_dir, tokenizer=self.tokenizer) if is_vlm_dir(model_dir) else None
        )
        if cfg.data.pairs:  # DPO's preference pairs (check_ppo_inputs refused validation files)
            self.train_dataset: Any = PreferencePairDataset(
                as_file_list(cfg.data.train_files),
                self.tokenizer,
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.data.max_response_length,
                prompt_key=cfg.data.prompt_key,
                apply_chat_template=cfg.data.apply_chat_template,
            )
        else:
            self.train_dataset = create_rl_dataset(cfg.data, self.tokenizer, as_file_list(cfg.data.train_files),
                                                   processor=self.processor)
        self.val_dataset = (
            create_rl_dataset(cfg.data, self.tokenizer, as_file_list(cfg.data.val_files), processor=self.processor)
            if cfg.data.val_files else None
        )
        if cfg.data.custom_cls.path:  # check_ppo_inputs left the data sources to the user's class
            check_dataset_scorers(cfg, {"train_files": self.train_dataset, "val_files": self.val_dataset})
        self.loader = build_dataloader(self.train_dataset, cfg.data, train=True)
        self.val_loader = build_dataloader(self.val_dataset, cfg.data, train=False) if self.val_dataset else None
        self.steps_per_epoch = len(self.loader)
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.steps_per_epoch
        self._iterator: Iterator[dict[str, Any]] | None = None

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._iterator = None

    def _next(self) -> dict[str, Any] | None:
        """The next training batch, moving to the next epoch as needed; None when
        ``trainer.total_epochs`` epochs are used up."""
        while self.loader.epoch < self.cfg.trainer.total_epochs:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:  # the loader has moved to the next epoch
                self._iterator = None
        return None

    def prompt_batch(self, step: int, draw: int = 0) -> Batch | None:
        """The next batch of prompts with a ``uid`` per prompt (``step/draw/i``); None when the
        epochs are used up."""
        if self.cfg.data.pairs:
            raise ValueError("data.pairs=true: the loader yields preference pairs; take them with preference_batch()")
        data = self._next()
        if data is None:
            return None
        prompts = to_batch(data)
        prompts["uid"] = [f"{step}/{draw}/{i}" for i in range(len(prompts))]
        return prompts

    def preference_batch(self, step: int) -> Batch | None:
        """The next B preference pairs (``data.pairs``) as 2B rollout-layout rows: pair i's chosen
        response at row 2i, its rejected one at 2i + 1 (``pair_side`` [2B]: 0, 1), each with
        ``input_ids``, ``attention_mask``, ``position_ids`` [2B, P+R], ``responses`` and
        ``response_mask`` [2B, R], and the pair's ``uid``; None when the epochs are used up."""
        if not self.cfg.data.pairs:
            raise ValueError("preference_batch needs preference pairs: set data.pairs=true (prompt, chosen, rejected files)")
        data = self._next()
        if data is None:
            return None
        b = len(data["uid"])
        # [B, 2, ...] -> [2B, ...]: chosen and rejected of one pair side by side.
        rows = {
            name: torch.stack([data[f"{side}_{name}"] for side in PAIR_SIDES], dim=1).flatten(0, 1)
            for name in ("input_ids", "attention_mask", "position_ids", "response_mask")
        }
        rows["response_mask"] = rows["response_mask"].to(torch.float32)
        rows["responses"] = rows["input_ids"][:, -self.cfg.data.max_response_length :]
        rows["pair_side"] = torch.arange(2).repeat(b)
        return Batch.from_dict(rows, {"uid": [f"{step}/{u}" for u in data["uid"] for _ in PAIR_SIDES]})
