"""``RewardModel``: scores for whole responses, rule-based by ``data_source`` and/or from a reward model.

- Rule-based: ``verl.rewards.RewardManager`` picks each sample's scorer by its ``data_source``
  (the record's ``data.reward_fn_key`` field) or calls ``custom_reward_function``; the whole
  batch is split over the world's ranks, each scores its share, and the scores are gathered back.
- Model-based (``reward_model.enable``): a Megatron engine with a reward head scores each
  sequence at its last real token (``verl.models.forward.last_token_values``). The reward model
  reads the policy's token ids, so it must use the policy's tokenizer. A vision-language reward
  model (a scalar head or a judge on a VLM, ``verl.models.vlm_reward``) also reads each row's
  images from the batch's ``multi_modal_inputs`` (``verl.roles.vlm_reward``).

With both, a sample's score is the sum; with a reward model, samples whose ``data_source`` has no
rule-based scorer get the model's score alone. Without one, every ``data_source`` needs a scorer
(the trainer checks the data files before it builds any model). Scores sit on each response's
last valid token of ``token_level_scores`` [B, R].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl.models.forward import last_token_values
from verl.protocol import Batch
from verl.rewards import get_scorer
from verl.roles.dispatch import collect, share_columns, shard
from verl.roles.engine_role import RoleEngine

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.rewards import RewardManager
    from verl.roles.vlm_reward import VLMRewardEngine

__all__ = ["DATA_SOURCE_COLUMN", "RewardModel", "RewardResult", "has_rule_scorer"]

DATA_SOURCE_COLUMN = "data_source"
"""The batch column naming each sample's scorer: ``verl.data``'s RL dataset stores the record's
``data.reward_fn_key`` field under this name."""


def has_rule_scorer(data_source: str) -> bool:
    """Whether a built-in (or registered) rule-based scorer serves ``data_source``."""
    try:
        get_scorer(data_source)
    except ValueError:
        return False
    return True


@dataclass(kw_only=True)
class RewardResult:
    """Scores of a batch of B responses of R tokens (identical on every rank)."""

    token_level_scores: torch.Tensor
    """[B, R] float32: each response's score on its last valid token."""
    scores: torch.Tensor
    """[B] float32: each response's score."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sample fields returned by dict-valued scorers (``acc``, ``pred``, ...), each of length B."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward/num_failed`` (responses a scorer could not score), ``reward/model_score_mean``."""


class RewardModel:
    """Rule-based and/or model-based scoring (see the module docstring).

    Args:
        manager: the rule-based ``RewardManager`` (``reward_manager_from_config``), or None for
            reward-model scores only.
        custom_scorer: whether ``manager`` calls a user function for every sample (then every
            sample goes through it, whatever its ``data_source``).
        model_role: the reward model's frozen engine (:meth:`build_model_role`), or None.
        micro_batch_size: sequences per reward-model forward (``reward_model.micro_batch_size_per_gpu``).
        model_source: where the reward model runs on ranks of its own (``trainer.placement``): its
            first global rank, which hands the model's scores to every rank (``model_role`` is the
            engine on the model's ranks and None elsewhere). None: the model, if any, is on every rank.
    """

    def __init__(
        self,
        manager: "RewardManager | None",
        *,
        custom_scorer: bool,
        model_role: "RoleEngine | VLMRewardEngine | None" = None,
        micro_batch_size: int = 4,
        model_source: int | None = None,
    ) -> None:
        if manager is None and model_role is None and model_source is None:
            raise ValueError("RewardModel needs a rule-based manager, a reward model, or both")
        self.manager = manager
        self.custom_scorer = custom_scorer
        self.model_role = model_role
        self.micro_batch_size = micro_batch_size
        self.model_source = model_source

    @property
    def has_model(self) -> bool:
        """Whether a reward model scores (on this rank, or on ranks of its own)."""
        return self.model_role is not None or self.model_source is not None

    def model_only(self) -> "RewardModel":
        """The same reward model without the rule-based scorers (``RewardModelScorer``'s scores)."""
        if not self.has_model:
            raise ValueError("RewardModel.model_only: this scorer has no reward model")
        return RewardModel(
            None, custom_scorer=False, model_role=self.model_role, micro_batch_size=self.micro_batch_size,
            model_source=self.model_source,
        )

    @classmethod
    def build_model_role(
        cls, *, model, megatron, pg: "ProcessGroupCollection", max_sequence_length: int, balance: bool,
        strategy: str = "megatron", fsdp=None,
    ) -> "RoleEngine | VLMRewardEngine":
        """The reward model's frozen engine with its reward head (``strategy=fsdp2``: its
        ``*ForSequenceClassification`` on the FSDP2 engine, ``fsdp`` its ``fsdp_config``); a
        vision-language reward model's directory (``verl.models.vlm_reward``): a
        :class:`~verl.roles.vlm_reward.VLMRewardEngine`, whatever the strategy."""
        from verl.models.vlm_reward import is_vlm_reward_dir

        if is_vlm_reward_dir(model.path):
            from verl.roles.vlm_reward import VLMRewardEngine

            return VLMRewardEngine(
                model.path, pg=pg, tensor_parallel=megatron.tensor_model_parallel_size,
                trust_remote_code=model.trust_remote_code,
            )
        return RoleEngine(
            model=model,
            megatron=megatron,
            pg=pg,
            head="reward",
            name="reward_model",
            max_sequence_length=max_sequence_length,
            balance=balance,
            strategy=strategy,
            fsdp=fsdp,
        )

    def _rule_rows(self, batch: Batch) -> np.ndarray:
        """Rows that go through the rule-based manager."""
        if self.manager is None:
            return np.zeros(0, dtype=np.int64)
        if self.custom_scorer or not self.has_model:
            return np.arange(len(batch), dtype=np.int64)
        sources = batch.non_tensors[DATA_SOURCE_COLUMN]
        return np.flatnonzero([has_rule_scorer(str(s)) for s in sources]).astype(np.int64)

    def _rule_scores(self, batch: Batch) -> tuple[torch.Tensor, list[dict[str, Any]], int]:
        """(scores [B], per-sample extra dicts, failures) of the rule-based manager, split over the world."""
        keys = ["responses", "response_mask"] + [
            k for k in (DATA_SOURCE_COLUMN, "reward_model", "ground_truth", "extra_info") if k in batch
        ]
        piece = shard(batch.select(keys), dist.group.WORLD)
        rows = piece.rows
        if self.manager.reward_fn_key not in rows:
            # The dataset files each record's data.reward_fn_key field under "data_source".
            rows = rows.select(keys)
            rows[self.manager.reward_fn_key] = rows[DATA_SOURCE_COLUMN]
        out = self.manager(rows)
        extras = [
            {k: v[i] for k, v in out.extra_info.items() if v[i] is not None} for i in range(len(piece.rows))
        ]
        failed = torch.zeros(len(piece.rows), dtype=torch.float32)
        if out.num_failed:
            failed[0] = float(out.num_failed)  # the count travels with the rows; summed after the gather
        local = Batch.from_dict({"scores": out.scores.float().cpu(), "failed": failed}, {"extra": extras})
        whole = collect(local, dist.group.WORLD, piece)
        return whole["scores"], list(whole.non_tensors["extra"]), int(whole["failed"].sum())

    def score(self, batch: Batch) -> RewardResult:
        """Scores of every response of a rollout batch (``responses``, ``response_mask`` [B, R],
        ``input_ids``/``attention_mask`` [B, P+R] and the data columns)."""
        mask = batch["response_mask"].bool()  # [B, R]
        b = len(batch)
        scores = torch.zeros(b, dtype=torch.float32)
        extra_rows: list[dict[str, Any]] = [{} for _ in range(b)]
        metrics: dict[str, float] = {}
        rows = self._rule_rows(batch)
        if len(rows):
            sub = batch if len(rows) == b else batch[rows]
            rule, extras, failed = self._rule_scores(sub)
            scores[torch.as_tensor(rows)] += rule
            for i, e in zip(rows.tolist(), extras):
                extra_rows[i] = dict(e)
            metrics["reward/num_failed"] = float(failed)
        if self.has_model:
            model_scores = None
            if self.model_role is not None:
                out = self.model_role.forward(
                    batch,
                    output="values",
                    micro_batch_size=self.micro_batch_size,
                    response_length=batch["responses"].shape[1],
                    full=True,
                )
                model_scores = last_token_values(out["values"], batch["attention_mask"]).float()  # [B]
            if self.model_source is not None:  # computed on the model's ranks, handed to every rank
                shared = share_columns(
                    {"model_scores": model_scores} if model_scores is not None else None, self.model_source
                )
                model_scores = shared["model_scores"]
            scores += model_scores
            metrics["reward/model_score_mean"] = float(model_scores.mean())
        token_level = torch.zeros(mask.shape, dtype=torch.float32)
        positions = torch.arange(mask.shape[1]).expand(mask.shape)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values  # [B]
        placed = torch.nonzero(last >= 0).flatten()
        token_level[placed, last[placed]] = scores[placed]
        keys = list(dict.fromkeys(k for e in extra_rows for k in e))
        extra = {k: [e.get(k) for e in extra_rows] for k in keys}
        return RewardResult(token_level_scores=token_level, scores=scores, extra=extra, metrics=metrics)
