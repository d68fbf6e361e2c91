"""The built-in operators: each wraps step pieces of :class:`verl.trainer.ppo_trainer.PPOTrainer`;
``verl.trainer.step.build_step`` composes the config's step from them.

| operator | trainer pieces | adds |
| --- | --- | --- |
| :class:`RolloutOperator` | ``prompt_batch``, ``generate`` | ``responses``, ``response_mask``, ... |
| :class:`RewardOperator` | the trainer's ``RewardModel`` role (``compute_reward``), or one on the given scorer | ``token_level_scores`` |
| :class:`MultiRewardScorer` | several reward operators, weighted sum | ``token_level_scores`` |
| :class:`FilterOperator` | (batch indexing) | nothing: drops samples |
| :class:`WeightedFilterOperator` | the actor loss's per-sample weight (``verl.roles.actor.SAMPLE_WEIGHT``) | ``sample_weight`` |
| :class:`GroupFilterOperator` | DAPO's ``verl.algos.filter_groups`` on ``StepPieces.filter_metric`` | nothing: drops groups |
| :class:`DynamicSamplingOperator` | ``prompt_batch``, ``generate``, the reward, ``filter_groups``, redrawn until the batch is full | ``responses``, ..., ``token_level_scores`` |
| :class:`PreferenceOperator` | ``preference_batch`` (``data.pairs``) | ``responses``, ``response_mask``, ``pair_side``, ... |
| :class:`DPOUpdateOperator` | ``update_preference``: reference log-probs, ``Actor.update_preference`` | ``ref_log_prob`` |
| :class:`ConditionalUpdateOperator` | ``update_step`` on the samples a predicate picks, ``update_preference`` on best-vs-worst pairs of the others | ``advantages``, ... |
| :class:`PPOUpdateOperator` | ``update_step``: old/ref log-probs, values, advantages, critic and actor updates | ``advantages``, ... |
| :class:`DistillationOperator` | ``compute_teacher_log_prob``: on-policy distillation's frozen teacher | ``teacher_log_prob`` |
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from verl.trainer.step.base import Operator

if TYPE_CHECKING:
    from verl.protocol import Batch
    from verl.trainer.step.pieces import StepPieces

logger = logging.getLogger(__name__)

__all__ = [
    "ConditionalUpdateOperator",
    "DPOUpdateOperator",
    "DistillationOperator",
    "DynamicSamplingOperator",
    "FilterOperator",
    "PreferenceOperator",
    "GroupFilterOperator",
    "WeightedFilterOperator",
    "MultiRewardScorer",
    "PPOUpdateOperator",
    "RewardModelScorer",
    "RewardOperator",
    "RolloutOperator",
]

ROLLOUT_FIELDS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "uid",
    "data_source",
)


class RolloutOperator(Operator):
    """The step's prompts from the trainer's data loader, ``n`` samples each (``StepPieces.generate``:
    the actor's weights pushed into the engine first). Makes the step's batch; None when the
    data is used up.

    Args (None: the config's value):
        model: the policy (``actor_rollout_ref.model.path``): a Hugging Face checkpoint directory
            or a ``...ForCausalLM`` object of a supported family (``verl.trainer.model_objects``:
            written as a checkpoint for the Megatron actor and the rollout engine), or any other
            ``nn.Module`` with ``forward()`` and ``generate()`` (the plain PyTorch engine trains the
            object itself and generates with its ``generate()``); None: the
            stream's ``model=``. A :class:`PPOUpdateOperator` given ``actor=`` must name the same model.
        tokenizer: the tokenizer of a ``model`` object (an object or a directory); for a
            directory, a tokenizer directory other than the model's (``actor_rollout_ref.model.tokenizer_path``).
        n: samples per prompt (``actor_rollout_ref.rollout.n``).
        temperature: sampling temperature (``actor_rollout_ref.rollout.temperature``).
        top_p: nucleus sampling (``actor_rollout_ref.rollout.top_p``).
        max_new_tokens: response length limit (``data.max_response_length``).
        dynamic_batch_size: split each step's generation into engine calls sized from the memory
            the engine reports (``kv_token_budget``: vLLM's KV cache capacity; for the transformers
            engine the free device memory over its KV bytes per token): as many sequences per call
            as fit, within ``[min_batch_size, max_batch_size]``, whole prompts each
            (``StepPieces.generate(call_sizes=...)``); logs ``rollout/batch_size``,
            ``rollout/num_calls`` and ``rollout/kv_token_budget``. Greedy samples are unchanged;
            sampled ones differ from one call's (each call has its own seeded stream).
        min_batch_size / max_batch_size: the sequences (prompt x sample rows) per call; only with
            ``dynamic_batch_size``.
        tools: tools the model may call (``verl.rollout.agent.Tool`` objects or plain annotated
            functions): rollouts go through the agent loop (``actor_rollout_ref.rollout.multi_turn``;
            docs/agents.md), besides any tools of ``multi_turn.tool_config_path``.
        max_turns: model turns per conversation at most (``multi_turn.max_assistant_turns``); turns
            the agent loop on like ``tools``.
    """

    outputs = ROLLOUT_FIELDS

    def __init__(
        self,
        *,
        model: Any = None,
        tokenizer: Any = None,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        dynamic_batch_size: bool = False,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        tools: Sequence[Any] | None = None,
        max_turns: int | None = None,
    ) -> None:
        super().__init__()
        self.tools: list[Any] = []
        if tools is not None:
            from verl.rollout.agent import as_tools

            self.tools = as_tools(list(tools))  # names and schemas checked now, before any model
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"RolloutOperator(max_turns={max_turns!r}): model turns per conversation, an int >= 1")
        if not dynamic_batch_size and (min_batch_size is not None or max_batch_size is not None):
            raise ValueError(
                "RolloutOperator(min_batch_size=/max_batch_size=) size the calls of dynamic_batch_size=True; "
                "add dynamic_batch_size=True or drop them"
            )
        self.call_sizes: tuple[int, int] | None = None
        if dynamic_batch_size:
            low = 1 if min_batch_size is None else min_batch_size
            high = 2**31 - 1 if max_batch_size is None else max_batch_size
            for name, value in (("min_batch_size", low), ("max_batch_size", high)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"RolloutOperator({name}={value!r}): a number of sequences, an int >= 1")
            if low > high:
                raise ValueError(f"RolloutOperator(min_batch_size={low}, max_batch_size={high}): min is above max")
            self.call_sizes = (low, high)
        self.model = model
        self.settings = {
            **_policy_settings(model, tokenizer, "RolloutOperator(model=...)"),
            "actor_rollout_ref.rollout.n": n,
            "actor_rollout_ref.rollout.temperature": temperature,
            "actor_rollout_ref.rollout.top_p": top_p,
            "data.max_response_length": max_new_tokens,
            "actor_rollout_ref.rollout.multi_turn.enable": True if tools is not None or max_turns is not None else None,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": max_turns,
        }

    def config_overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if v is not None}

    def bind(self, trainer: "StepPieces") -> None:
        super().bind(trainer)
        if self.tools and trainer.rollout is not None:  # None on ranks that do not generate
            trainer.rollout.add_tools(self.tools)

    def process(self, batch: "Batch | None") -> "tuple[Batch | None, dict[str, float]]":
        if batch is not None:
            raise ValueError("RolloutOperator makes the step's batch: it must be the stream's first operator")
        trainer = self.trainer
        with trainer.phase("data"):
            prompts = trainer.prompt_batch(0)
        if prompts is None:
            return None, {}
        with trainer.phase("gen"):
            return trainer.generate(prompts, seed=trainer.sampling_seed(0), call_sizes=self.call_sizes)


def _policy_settings(model: Any, tokenizer: Any, what: str) -> dict[str, Any]:
    """The actor's model keys for an operator's ``model=``/``actor=`` (nothing for None)."""
    if model is None:
        if tokenizer is not None:
            raise ValueError(f"{what}: tokenizer= goes with model=; the stream's model brings its own tokenizer")
        return {}
    from verl.trainer.model_objects import is_model_object, model_directory

    path = model_directory(model, what=what, tokenizer=tokenizer, head="lm")
    settings: dict[str, Any] = {"actor_rollout_ref.model.path": path}
    if tokenizer is not None and not is_model_object(model):
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(f"{what}: with a model directory, tokenizer= is a tokenizer directory, got {type(tokenizer).__name__}")
        settings["actor_rollout_ref.model.tokenizer_path"] = os.path.abspath(os.fspath(tokenizer))
    return settings


def _scorer_name(scorer: Any) -> str:
    if scorer is None:
        return "config"
    if isinstance(scorer, str):
        return scorer
    return getattr(scorer, "__name__", type(scorer).__name__)


class RewardOperator(Operator):
    """Scores every response into ``token_level_scores`` [B, R] (the score on the last token).

    Args:
        scorer: None: the config's rule-based scorers by each sample's ``data_source``
            (the trainer's reward role, as ``StepPieces.compute_reward``); a registered scorer name (``"verl/arithmetic"``,
            ``"openai/gsm8k"``: ``verl.rewards.known_data_sources()``) applied to every sample; or
            a Python function ``f(data_source, solution_str, ground_truth, extra_info) -> float``
            (the ``custom_reward_function`` contract; a dict with a ``"score"`` key also works).
        name: the name in metrics (``reward/<name>/mean``); the scorer's name by default.
        summary: add ``reward/<name>/mean`` and ``reward_mean`` (the step's mean sequence score
            before any filter: the Python API's summary keys); the config's own step
            (``verl.trainer.step.build_step``) reports ``critic/score/*`` only.
    """

    inputs = ("responses", "response_mask", "data_source")
    outputs = ("token_level_scores",)

    def __init__(
        self, scorer: str | Callable[..., Any] | None = None, *, name: str | None = None, summary: bool = True
    ) -> None:
        super().__init__()
        self.summary = summary
        if scorer is not None and not isinstance(scorer, str) and not callable(scorer):
            raise TypeError(
                f"RewardOperator(scorer=...) takes None, a scorer name or a function, got {type(scorer).__name__}"
            )
        if isinstance(scorer, str):
            from verl.rewards import get_scorer

            get_scorer(scorer)  # an unknown name fails now, listing the known ones
        self.scorer = scorer
        self.name = name or _scorer_name(scorer)
        self._role = None

    def bind(self, trainer: "StepPieces") -> None:
        super().bind(trainer)
        if self.scorer is None:
            return
        from verl.rewards import RewardManager
        from verl.rewards.manager import RULE_SCORING
        from verl.roles import RewardModel

        if isinstance(self.scorer, str):
            source = self.scorer
            # The config's built-in scorers: ours, or the reference verl's exact ones (reward_model.rule_scoring).
            builtin = RULE_SCORING[trainer.cfg.reward_model.rule_scoring]

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return builtin(source, solution_str, ground_truth, extra_info)

        else:
            compute_score = self.scorer
        self._role = RewardModel(RewardManager(trainer.tokenizer, compute_score=compute_score), custom_scorer=True)

    def score(self, batch: "Batch") -> tuple[torch.Tensor, dict[str, float]]:
        """(``token_level_scores`` [B, R], metrics) of ``batch``; the batch is not changed."""
        scores, metrics, _ = self._score(batch)
        return scores, metrics

    def _score(self, batch: "Batch") -> tuple[torch.Tensor, dict[str, float], dict[str, list[Any]]]:
        # The trainer's RewardModel role (the config's scorers) or this operator's own.
        role = self._role if self._role is not None else self.trainer.reward
        result = role.score(batch)
        scores, metrics = result.token_level_scores, dict(result.metrics)
        if self.summary:
            metrics[f"reward/{self.name}/mean"] = float(scores.sum(-1).mean())
        return scores, metrics, result.extra

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        with self.trainer.phase("reward"):
            scores, metrics, extra = self._score(batch)
        batch, more = self.trainer.place_scores(batch, scores)  # (an agent rollout's interaction rewards added)
        scores = batch["token_level_scores"]
        metrics.update(more)
        for key, values in extra.items():  # the scorers' per-sample fields (acc, pred), as compute_reward adds them
            if key not in batch:
                batch[key] = values
        if self.summary:
            metrics["reward_mean"] = float(scores.sum(-1).mean())
        return batch, metrics


class RewardModelScorer(RewardOperator):
    """:class:`RewardOperator` under the tutorials' name, which also scores with a trained reward model.

    Args:
        rm_model: a rule-based scorer name or a Python function (as ``RewardOperator(scorer=)``);
            or a reward model: a Hugging Face checkpoint directory or a
            ``...ForSequenceClassification`` object with ``num_labels=1`` of a supported family
            (``verl.trainer.model_objects``). A reward model is the trainer's reward-model role
            (``reward_model.enable=true``, ``reward_model.model.path``): a frozen Megatron engine
            that scores each sequence at its last real token; this operator's scores are the
            model's alone (no rule-based scorer is added). It reads the policy's token ids, so it
            must share the policy's tokenizer (the trainer checks this before it builds anything).
            A vision-language reward model (``verl.models.vlm_reward``: a ``VLMRewardModel``
            scalar head or a ``VLMJudge``) is written with its processor and scored by the role's
            ``VLMRewardEngine`` with each row's images (``reward_model.strategy=fsdp2``: a
            transformers model, not a Megatron build).
        tokenizer: the tokenizer of an ``rm_model`` object (an object or a directory); a VLM
            reward model's processor.
        use_vllm: must be False: reward models run on the Megatron engine (vLLM generates only).
        name: the name in metrics (``reward/<name>/mean``).
    """

    def __init__(
        self,
        rm_model: Any = None,
        *,
        tokenizer: Any = None,
        use_vllm: bool = False,
        name: str | None = None,
    ) -> None:
        from verl.trainer.model_objects import is_model_object, model_directory

        if use_vllm:
            raise ValueError(
                "RewardModelScorer(use_vllm=True): reward models are scored by the trainer's Megatron reward-model "
                "role, not vLLM (which only generates); leave use_vllm=False"
            )
        self.model_path: str | None = None
        is_dir = isinstance(rm_model, (str, os.PathLike)) and os.path.isdir(os.fspath(rm_model))
        if is_model_object(rm_model) or is_dir:
            self.model_path = model_directory(
                rm_model, what="RewardModelScorer(rm_model=...)", tokenizer=tokenizer, head="reward"
            )
            Operator.__init__(self)
            self.scorer = None
            self.summary = True
            self.name = name or "reward_model"
            self._role = None
            return
        if tokenizer is not None:
            raise ValueError("RewardModelScorer(tokenizer=...) goes with a reward model (rm_model= a model or its directory)")
        if rm_model is not None and not isinstance(rm_model, str) and not callable(rm_model):
            raise TypeError(
                "RewardModelScorer(rm_model=...) takes a scorer name, a function, or a reward model (object or "
                f"directory), got {type(rm_model).__name__}"
            )
        super().__init__(rm_model, name=name)

    def config_overrides(self) -> dict[str, Any]:
        if self.model_path is None:
            return {}
        from verl.models.vlm_reward import is_vlm_reward_dir

        out: dict[str, Any] = {"reward_model.enable": True, "reward_model.model.path": self.model_path}
        if is_vlm_reward_dir(self.model_path):  # whole on each rank (VLMRewardEngine), not a Megatron build
            out["reward_model.strategy"] = "fsdp2"
        return out

    def bind(self, trainer: "StepPieces") -> None:
        if self.model_path is None:
            super().bind(trainer)
            return
        Operator.bind(self, trainer)
        if not trainer.reward.has_model:
            raise ValueError(
                "RewardModelScorer(rm_model=<reward model>): the stream's trainer has no reward model; build it with "
                f"reward_model.enable=true reward_model.model.path={self.model_path}"
            )
        self._role = trainer.reward.model_only()


class MultiRewardScorer(Operator):
    """The weighted sum of several scorers into ``token_level_scores``; logs each one's mean
    (``reward/<name>/mean``) and its weight.

    Args:
        scorers: ``[(scorer, weight), ...]``; a scorer is a :class:`RewardOperator` or what
            ``RewardOperator(scorer=...)`` takes.
    """

    inputs = RewardOperator.inputs
    outputs = RewardOperator.outputs

    def __init__(self, scorers: Sequence[tuple[Any, float]]) -> None:
        super().__init__()
        if not scorers:
            raise ValueError("MultiRewardScorer needs at least one (scorer, weight) pair")
        self.parts: list[tuple[RewardOperator, float]] = []
        names: list[str] = []
        for pair in scorers:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"MultiRewardScorer takes (scorer, weight) pairs, got {pair!r}")
            scorer, weight = pair
            op = scorer if isinstance(scorer, RewardOperator) else RewardOperator(scorer)
            if op.name in names:
                op.name = f"{op.name}_{len(names)}"
            names.append(op.name)
            self.parts.append((op, float(weight)))

    def config_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for op, _ in self.parts:
            for key, value in op.config_overrides().items():
                if key in out and out[key] != value:
                    raise ValueError(
                        f"MultiRewardScorer: two scorers set {key} differently ({out[key]!r}, {value!r}); the trainer "
                        "has one reward model"
                    )
                out[key] = value
        return out

    def bind(self, trainer: "StepPieces") -> None:
        super().bind(trainer)
        for op, _ in self.parts:
            op.bind(trainer)

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        total = None
        metrics: dict[str, float] = {}
        for op, weight in self.parts:
            scores, more = op.score(batch)
            metrics.update(more)
            metrics[f"reward/{op.name}/weight"] = weight
            total = weight * scores if total is None else total + weight * scores
        batch, more = self.trainer.place_scores(batch, total)  # an agent rollout's interaction rewards, once
        metrics.update(more)
        metrics["reward_mean"] = float(batch["token_level_scores"].sum(-1).mean())
        return batch, metrics


def sample_view(batch: "Batch", i: int, reward: torch.Tensor) -> dict[str, Any]:
    """Sample ``i`` as a dict for predicates: ``reward`` (its sequence score), every per-sample
    tensor field of shape [B] (as a Python number) and every non-tensor field."""
    view: dict[str, Any] = {"reward": float(reward[i])}
    for key in batch.keys():
        value = batch[key]
        if isinstance(value, torch.Tensor):
            if value.dim() == 1:
                view[key] = value[i].item()
        else:
            view[key] = value[i]
    return view


class FilterOperator(Operator):
    """Keeps the samples whose reward is at least ``threshold``, or for which ``predicate(sample)``
    is true (``sample``: :func:`sample_view`); the others leave the step's batch. A GRPO group
    left with one sample gets zero advantage. A step in which no sample is kept is skipped (no
    update; ``StepPipeline.run`` warns and counts it in ``training/empty_steps``).

    Logs ``filter/kept`` and ``filter/dropped``.
    """

    inputs = ("token_level_scores",)

    def __init__(
        self, threshold: float | None = None, *, predicate: Callable[[dict[str, Any]], bool] | None = None
    ) -> None:
        super().__init__()
        if (threshold is None) == (predicate is None):
            raise ValueError("FilterOperator takes threshold= or predicate=, exactly one")
        self.threshold = threshold
        self.predicate = predicate

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        reward = batch["token_level_scores"].sum(-1)  # [B]
        if self.threshold is not None:
            keep = [i for i in range(len(batch)) if float(reward[i]) >= self.threshold]
        else:
            keep = [i for i in range(len(batch)) if self.predicate(sample_view(batch, i, reward))]
        kept = batch if len(keep) == len(batch) else batch[keep]  # none kept: the pipeline skips the step
        return kept, {"filter/kept": float(len(keep)), "filter/dropped": float(len(batch) - len(keep))}


def _lookup(view: dict[str, Any], key: str) -> Any:
    """``view[key]``, reaching into dict fields with dots (``"extra_info.tier"``); KeyError naming what exists."""
    head, *rest = key.split(".")
    if head not in view:
        raise KeyError(f"no field {head!r} (the sample has {sorted(view)})")
    value = view[head]
    for part in rest:
        if not isinstance(value, dict) or part not in value:
            shown = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"no field {key!r} ({head} holds {shown})")
        value = value[part]
    return value


class WeightedFilterOperator(Operator):
    """Weights samples instead of dropping them: each sample's actor losses (policy, KL, entropy)
    are scaled by its weight (``sample_weight`` [B], applied in ``agg_loss`` over the unweighted
    token and sequence counts; weight 0 removes a sample's contribution, 1 leaves it as is).

    Give ``field`` and ``weights`` (a sample's value of ``field`` -> weight; ``field`` may reach
    into dicts: ``"extra_info.tier"``; a value missing from ``weights`` takes ``default``, or
    fails when ``default`` is None), or ``fn(sample) -> weight`` (``sample``: :func:`sample_view`,
    with ``reward``). Weights must be finite and >= 0; an earlier weight is multiplied. The critic's
    value loss is not weighted. Logs ``filter/weight_mean``, ``/min``, ``/max``.
    """

    inputs = ("token_level_scores",)
    outputs = ("sample_weight",)

    def __init__(
        self,
        weights: dict[Any, float] | None = None,
        *,
        field: str | None = None,
        fn: Callable[[dict[str, Any]], float] | None = None,
        default: float | None = 1.0,
    ) -> None:
        super().__init__()
        if (fn is None) == (field is None):
            raise ValueError("WeightedFilterOperator takes field= with weights=, or fn=, exactly one")
        if field is not None and not weights:
            raise ValueError(f"WeightedFilterOperator(field={field!r}) needs weights={{value: weight, ...}}")
        if fn is not None and weights:
            raise ValueError("WeightedFilterOperator: weights= goes with field=, not with fn=")
        for value, weight in (weights or {}).items():
            _check_weight_value(weight, f"weights[{value!r}]")
        self.field, self.weights, self.fn, self.default = field, dict(weights or {}), fn, default

    def weight_of(self, sample: dict[str, Any]) -> float:
        """The weight of one sample (a :func:`sample_view`)."""
        if self.fn is not None:
            return _check_weight_value(self.fn(sample), "fn(sample)")
        try:
            value = _lookup(sample, self.field)
        except KeyError as exc:
            raise ValueError(f"WeightedFilterOperator(field={self.field!r}): {exc.args[0]}") from None
        if value in self.weights:
            return float(self.weights[value])
        if self.default is None:
            raise ValueError(
                f"WeightedFilterOperator(field={self.field!r}): value {value!r} has no weight (weights for "
                f"{sorted(map(repr, self.weights))}); add it or set default="
            )
        return _check_weight_value(self.default, "default")

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        from verl.roles.actor import SAMPLE_WEIGHT

        reward = batch["token_level_scores"].sum(-1)  # [B]
        weight = torch.tensor([self.weight_of(sample_view(batch, i, reward)) for i in range(len(batch))])  # [B]
        if SAMPLE_WEIGHT in batch:
            weight = weight * batch[SAMPLE_WEIGHT].to(weight.dtype)
        batch[SAMPLE_WEIGHT] = weight
        return batch, {
            "filter/weight_mean": float(weight.mean()),
            "filter/weight_min": float(weight.min()),
            "filter/weight_max": float(weight.max()),
        }


def _check_weight_value(weight: Any, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight >= 0 and weight < float("inf")):
        raise ValueError(f"WeightedFilterOperator: {where} = {weight!r}; a weight is a finite number >= 0")
    return float(weight)


class GroupFilterOperator(Operator):
    """DAPO's group filter (dynamic sampling's drop, arXiv:2503.14476): removes every prompt group
    (samples of one ``uid``) whose ``metric`` is the same for all its samples, since GRPO gives
    them zero advantage. The trainer's own pieces: ``verl.algos.filter_groups`` on
    ``StepPieces.filter_metric`` (``seq_reward``, ``seq_final_reward``, ``score`` or a field the
    scorer returns, e.g. ``acc``). Unlike ``algorithm.filter_groups`` in the trainer's own step it
    does not draw more prompts to refill the batch: the step trains on the groups left; with no group
    left it is skipped (``training/empty_steps``). Logs ``filter/kept_groups`` and ``filter/dropped_groups``.
    """

    inputs = ("token_level_scores", "uid")

    def __init__(self, metric: str = "seq_reward") -> None:
        super().__init__()
        self.metric = metric

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        from verl.algos import filter_groups

        result = filter_groups(index=batch.non_tensors["uid"], metric_values=self.trainer.filter_metric(batch, self.metric))
        kept = batch if len(result.kept_indices) == len(batch) else batch[result.kept_indices]
        return kept, {
            "filter/kept_groups": float(result.num_kept_groups),
            "filter/dropped_groups": float(result.num_dropped_groups),
        }


def first_groups(batch: "Batch", groups: int) -> "Batch":
    """The rows of ``batch``'s first ``groups`` prompt groups (``uid``, in first-appearance order).
    A group's rows are not always ``n``: a split agent-program episode gives a row per trajectory,
    so cutting at ``groups * n`` rows could split a group or drop a kept one."""
    from verl.algos.checks import group_ids

    gid, _, _ = group_ids(batch.non_tensors["uid"], len(batch))
    return batch[torch.nonzero(gid < groups).flatten().numpy()]


class DynamicSamplingOperator(Operator):
    """DAPO's dynamic sampling (arXiv:2503.14476; ``algorithm.filter_groups``): draws prompt
    batches (rollout, then the config's reward) and keeps the prompt groups whose ``metric``
    (``StepPieces.filter_metric``) has a spread, until ``data.train_batch_size`` groups are kept;
    the step trains on exactly that many groups. Draw ``d`` samples with the step's seed + ``d``.
    Makes the step's batch; None when the data is used up. Fails after ``max_num_gen_batches``
    draws (0: no limit) with fewer groups. Logs ``dapo/num_gen_batches`` and ``dapo/num_kept_groups``.

    Unlike :class:`GroupFilterOperator` (which trains on the groups left of one draw) it refills
    the batch, as the reference verl's DAPO trainer does.
    """

    outputs = (*ROLLOUT_FIELDS, "token_level_scores")

    def __init__(self, *, metric: str | None = "seq_reward", max_num_gen_batches: int = 0) -> None:
        super().__init__()
        self.metric = metric
        self.max_num_gen_batches = max_num_gen_batches
        self.reward = RewardOperator(summary=False)

    def bind(self, trainer: "StepPieces") -> None:
        super().bind(trainer)
        self.reward.bind(trainer)

    def process(self, batch: "Batch | None") -> "tuple[Batch | None, dict[str, float]]":
        from verl.algos import filter_groups
        from verl.protocol import Batch

        if batch is not None:
            raise ValueError("DynamicSamplingOperator makes the step's batch: it must be the stream's first operator")
        trainer = self.trainer
        want = trainer.cfg.data.train_batch_size
        kept: list[Batch] = []
        kept_groups, draw = 0, 0
        metrics: dict[str, float] = {}
        while True:
            with trainer.phase("data"):
                prompts = trainer.prompt_batch(draw)
            if prompts is None:
                return None, {}
            with trainer.phase("gen"):
                drawn, more = trainer.generate(prompts, seed=trainer.sampling_seed(draw))
            metrics.update(more)
            drawn, more = self.reward.process(drawn)
            metrics.update(more)
            draw += 1
            result = filter_groups(index=drawn.non_tensors["uid"], metric_values=trainer.filter_metric(drawn, self.metric))
            kept.append(drawn[result.kept_indices])
            kept_groups += result.num_kept_groups
            if kept_groups >= want:
                metrics.update({"dapo/num_gen_batches": float(draw), "dapo/num_kept_groups": float(kept_groups)})
                return first_groups(Batch.concat(kept), want), metrics
            if 0 < self.max_num_gen_batches <= draw:
                raise ValueError(
                    f"dynamic sampling (algorithm.filter_groups) kept {kept_groups} of the {want} prompt "
                    f"groups a step needs after {draw} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches}): too many "
                    f"groups score the same on filter_groups.metric={self.metric!r}. Raise max_num_gen_batches "
                    "(0: no limit), raise actor_rollout_ref.rollout.n or the temperature, or use easier or "
                    "harder prompts"
                )


class PPOUpdateOperator(Operator):
    """The rest of the step: old and reference log-probs, values, advantages, the critic and
    actor updates and the step's metrics (``StepPieces.update_step``; advances the global step).

    Args (None: the config's value):
        actor: the policy it trains, as :class:`RolloutOperator`'s ``model=`` takes it (the same
            model as the rollout's: one actor generates and trains); None: the stream's.
        critic: the value model's start for ``estimator="gae"`` (PPO with a critic): a Hugging Face
            checkpoint directory or a ``...ForCausalLM`` object (its body gets a fresh value head;
            ``critic.model.path``); None: no critic, unless the estimator needs one (then the
            config's ``critic.model.path``, by default the actor's). A critic-free estimator
            (``grpo``, ``rloo``, ...) with ``critic=`` is refused.
        tokenizer: the tokenizer of an ``actor``/``critic`` object (as :class:`RolloutOperator`'s).
        estimator: the advantage estimator (``algorithm.adv_estimator``: ``grpo``, ``gae`` (PPO
            with a critic), ``rloo``, ``reinforce_plus_plus``, ``remax``, ...: ``verl.algos.list_adv_estimators()``).
        kl_coef: the KL-to-reference loss coefficient (``actor.kl_loss_coef``; sets ``use_kl_loss``).
        clip_range: PPO's ratio clip (``actor.clip_ratio``).
        lr: the actor's learning rate (``actor.optim.lr``).
    """

    inputs = ("responses", "response_mask", "uid", "token_level_scores")
    # old_log_probs too, unless the update took them from its own forward (actor.old_log_prob)
    outputs = ("token_level_rewards", "advantages", "returns")

    def __init__(
        self,
        *,
        actor: Any = None,
        critic: Any = None,
        tokenizer: Any = None,
        estimator: str | None = None,
        kl_coef: float | None = None,
        clip_range: float | None = None,
        lr: float | None = None,
    ) -> None:
        super().__init__()
        if estimator is not None:
            from verl.algos import list_adv_estimators

            if estimator not in list_adv_estimators():
                raise ValueError(
                    f"PPOUpdateOperator(estimator={estimator!r}): unknown estimator; choose one of {list_adv_estimators()}"
                )
        critic_settings: dict[str, Any] = {}
        if critic is not None:
            if estimator not in (None, "gae"):
                raise ValueError(
                    f"PPOUpdateOperator(critic=..., estimator={estimator!r}): {estimator} is critic-free; give "
                    "estimator='gae' to train a critic, or leave critic=None"
                )
            from verl.trainer.model_objects import model_directory

            critic_settings = {
                "critic.model.path": model_directory(
                    critic, what="PPOUpdateOperator(critic=...)", tokenizer=tokenizer, head="lm"
                ),
            }
            estimator = "gae"
        self.actor = actor
        a = "actor_rollout_ref.actor"
        self.settings = {
            **_policy_settings(actor, tokenizer if actor is not None else None, "PPOUpdateOperator(actor=...)"),
            **critic_settings,
            "algorithm.adv_estimator": estimator,
            f"{a}.use_kl_loss": None if kl_coef is None else kl_coef > 0,
            f"{a}.kl_loss_coef": kl_coef,
            f"{a}.clip_ratio": clip_range,
            f"{a}.optim.lr": lr,
        }

    def config_overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if v is not None}

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        metrics = self.trainer.update_step(batch)
        return batch, metrics


PAIR_FIELDS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", "uid", "pair_side")


class PreferenceOperator(Operator):
    """The step's preference pairs from the trainer's loader (``PPOTrainer.preference_batch``: the
    trainer built with ``data.pairs=true`` on prompt/chosen/rejected files). Makes the step's batch:
    pair i's chosen response at row 2i, its rejected one at 2i + 1; None when the data is used up."""

    outputs = PAIR_FIELDS

    def config_overrides(self) -> dict[str, Any]:
        return {"data.pairs": True}

    def process(self, batch: "Batch | None") -> "Batch | None":
        if batch is not None:
            raise ValueError("PreferenceOperator makes the step's batch: it must be the stream's first operator")
        return self.trainer.preference_batch()


class DPOUpdateOperator(Operator):
    """DPO's update (arXiv:2305.18290) on the step's pairs: the reference role's log-probs, then one
    optimizer step of the actor on the preference loss (``StepPieces.update_preference``;
    advances the global step). The loss is ``verl.algos.preference``'s: ``sigmoid`` (DPO,
    -log sigmoid(beta * margin)) or ``ipo``, on per-response log-prob sums at temperature 1.

    Args:
        actor / reference: the trainer's roles (the default); given, they must be that trainer's
            ``Actor`` and ``Reference`` (the stream runs one trainer's roles).
        beta: the KL strength (DPO's beta).
        loss_type: a registered preference loss (``verl.algos.list_preference_losses()``).
        label_smoothing: conservative DPO's epsilon (``sigmoid`` only).
        lr: the actor's learning rate (``actor.optim.lr``; None: the config's).
    """

    inputs = ("responses", "response_mask", "pair_side")
    outputs = ("ref_log_prob",)

    def __init__(
        self,
        *,
        actor: Any = None,
        reference: Any = None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        lr: float | None = None,
    ) -> None:
        super().__init__()
        from verl.algos import list_preference_losses

        if loss_type not in list_preference_losses():
            raise ValueError(f"DPOUpdateOperator(loss_type={loss_type!r}): choose one of {list_preference_losses()}")
        if not (isinstance(beta, (int, float)) and beta > 0):
            raise ValueError(f"DPOUpdateOperator(beta={beta!r}): beta must be a positive number")
        self.actor, self.reference = actor, reference
        self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, float(label_smoothing)
        self.lr = lr

    def config_overrides(self) -> dict[str, Any]:
        return {"data.pairs": True, **({"actor_rollout_ref.actor.optim.lr": self.lr} if self.lr is not None else {})}

    def bind(self, trainer: "StepPieces") -> None:
        for name, given, own in (("actor", self.actor, trainer.actor), ("reference", self.reference, trainer.reference)):
            if given is not None and given is not own:
                raise ValueError(
                    f"DPOUpdateOperator({name}=...) is not the stream's trainer's {name}; the stream runs one "
                    f"trainer's roles: leave {name}= unset or pass trainer.{name}"
                )
        super().bind(trainer)

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        metrics = self.trainer.update_preference(
            batch, beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing
        )
        return batch, metrics


class ConditionalUpdateOperator(Operator):
    """Routes each sample by ``condition(sample)`` (``sample``: :func:`sample_view`, with ``reward``):
    the samples it holds true for go to ``true_branch``, the others to ``false_branch``, one of
    them a :class:`PPOUpdateOperator` and the other a :class:`DPOUpdateOperator` (the hybrid PPO/DPO
    step). Both update the actor in the same step (the PPO update first; the step is counted once).

    The DPO branch gets pairs from its samples: within each prompt group (``uid``), the sample of
    highest reward is chosen and the one of lowest rejected (ties: the earlier sample); a group with
    fewer than two such samples or all rewards equal gives no pair. The PPO branch trains on its
    samples as :class:`FilterOperator` leaves them (a GRPO group keeps the members routed to it).
    DPO needs the reference policy: give the PPO branch a KL loss (``kl_coef > 0``).

    Logs the PPO branch's metrics as they are, the DPO branch's under ``dpo/`` (``dpo/loss``,
    ``dpo/actor/grad_norm``, ``timing_s/dpo_*``), and ``conditional/true_samples``,
    ``conditional/false_samples``, ``conditional/dpo_pairs`` and ``conditional/skipped`` (1 for a
    step in which neither branch had anything to train: counted and skipped, the run goes on); the
    rollout must sample ``n >= 2`` per prompt (checked when the stream gets its trainer). :attr:`last_routes` holds the last
    step's row indices: ``true``, ``false`` and ``pairs`` ((chosen, rejected) tuples).
    """

    inputs = ("responses", "response_mask", "uid", "token_level_scores")
    outputs = PPOUpdateOperator.outputs

    def __init__(self, *, condition: Callable[[dict[str, Any]], bool], true_branch: Operator, false_branch: Operator) -> None:
        super().__init__()
        if not callable(condition):
            raise TypeError(f"ConditionalUpdateOperator(condition=...) takes a function of a sample, got {type(condition).__name__}")
        branches = (true_branch, false_branch)
        kinds = sorted(type(b).__name__ for b in branches)
        if kinds != ["DPOUpdateOperator", "PPOUpdateOperator"]:
            raise ValueError(
                "ConditionalUpdateOperator takes one PPOUpdateOperator and one DPOUpdateOperator as its "
                f"branches, got {[type(b).__name__ for b in branches]}"
            )
        self.condition, self.true_branch, self.false_branch = condition, true_branch, false_branch
        self.last_routes: dict[str, list[Any]] = {}

    def config_overrides(self) -> dict[str, Any]:
        # The stream's data are prompts to sample (not pairs); the PPO branch's settings apply.
        out: dict[str, Any] = {}
        for branch in (self.true_branch, self.false_branch):
            out.update({k: v for k, v in branch.config_overrides().items() if k != "data.pairs"})
        return out

    @staticmethod
    def _check_samples(n: int) -> None:
        if n < 2:
            raise ValueError(
                f"ConditionalUpdateOperator: its DPO branch pairs the best and the worst sample of each prompt, but the "
                f"rollout samples actor_rollout_ref.rollout.n={n} response per prompt, so no pair can form; "
                "sample several: RolloutOperator(n=4) (or actor_rollout_ref.rollout.n=4)"
            )

    def check_config(self, cfg: Any) -> None:
        self._check_samples(cfg.actor_rollout_ref.rollout.n)

    def bind(self, trainer: "StepPieces") -> None:
        self._check_samples(trainer.n)
        super().bind(trainer)
        self.true_branch.bind(trainer)
        self.false_branch.bind(trainer)

    @staticmethod
    def best_vs_worst(uids: Sequence[Any], reward: torch.Tensor, rows: Sequence[int]) -> list[tuple[int, int]]:
        """(chosen, rejected) row pairs: per ``uid`` among ``rows``, the highest vs the lowest reward."""
        groups: dict[Any, list[int]] = {}
        for i in rows:
            groups.setdefault(uids[i], []).append(i)
        pairs = []
        for members in groups.values():
            best = max(members, key=lambda i: (float(reward[i]), -i))
            worst = min(members, key=lambda i: (float(reward[i]), i))
            if float(reward[best]) > float(reward[worst]):
                pairs.append((best, worst))
        return pairs

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        reward = batch["token_level_scores"].sum(-1)  # [B]
        picked = [bool(self.condition(sample_view(batch, i, reward))) for i in range(len(batch))]
        ppo, dpo = (self.true_branch, self.false_branch)
        true_rows = [i for i, p in enumerate(picked) if p]
        false_rows = [i for i, p in enumerate(picked) if not p]
        ppo_rows, dpo_rows = (true_rows, false_rows) if isinstance(ppo, PPOUpdateOperator) else (false_rows, true_rows)
        if not isinstance(ppo, PPOUpdateOperator):
            ppo, dpo = dpo, ppo
        pairs = self.best_vs_worst(list(batch.non_tensors["uid"]), reward, dpo_rows)
        self.last_routes = {"true": true_rows, "false": false_rows, "pairs": pairs}
        metrics: dict[str, float] = {
            "conditional/true_samples": float(len(true_rows)),
            "conditional/false_samples": float(len(false_rows)),
            "conditional/dpo_pairs": float(len(pairs)),
            "conditional/skipped": 0.0,
        }
        if not ppo_rows and not pairs:
            # Nothing to train this step (every sample went to DPO, and no group has a reward
            # spread): the step is counted and skipped, the run goes on.
            trainer = self.trainer
            logger.warning(
                "step %d: ConditionalUpdateOperator had nothing to train (no sample for the PPO branch; the DPO "
                "branch's %d samples make no pair: no prompt group has a reward spread); the step is skipped",
                trainer.step_in_progress(), len(dpo_rows),
            )
            metrics.update({"conditional/skipped": 1.0, "training/global_step": float(trainer.step_in_progress())})
            return batch, metrics
        out = batch
        if ppo_rows:
            out = batch if len(ppo_rows) == len(batch) else batch[ppo_rows]
            out, more = ppo.process(out)
            metrics.update(more)
        if pairs:
            rows = [i for pair in pairs for i in pair]
            pair_batch = batch[rows].select(["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "uid"])
            pair_batch["pair_side"] = torch.arange(2).repeat(len(pairs))
            more = self.trainer.update_preference(
                pair_batch,
                beta=dpo.beta,
                loss_type=dpo.loss_type,
                label_smoothing=dpo.label_smoothing,
            )
            for key, value in more.items():
                if key.startswith("dpo/"):
                    metrics[key] = value
                elif key.startswith("timing_s/"):
                    metrics[f"timing_s/dpo_{key.removeprefix('timing_s/')}"] = value
                elif key.startswith("actor/"):
                    metrics[f"dpo/{key}"] = value
                elif not ppo_rows:
                    metrics[key] = value
        return out, metrics


class DistillationOperator(Operator):
    """On-policy distillation's teacher pass: the frozen teacher's log-probability of every sampled
    response token, ``teacher_log_prob`` [B, R], and with a top-k loss (``loss_mode=forward_kl_topk``)
    its top-k at every response position, ``teacher_topk_ids``/``teacher_topk_log_prob`` [B, R, k]
    (``StepPieces.compute_teacher_log_prob``; on the teacher's ranks, handed to every rank when it is
    placed apart). The actor's update then adds the
    distillation loss (``distillation.distillation_loss``, :mod:`verl.algos.distill`). Goes between the
    reward and :class:`PPOUpdateOperator`; the config's step has it when ``distillation.enabled``.

    Args:
        teacher: the teacher (``distillation.teacher_model.model_path``): a Hugging Face checkpoint
            directory or a ``...ForCausalLM`` object of a supported family, of the policy's
            tokenizer; None: the config's.
        tokenizer: the tokenizer of a ``teacher`` object.

    Logs ``distillation/teacher_log_prob_mean`` (the teacher's mean log-probability of the student's
    tokens: it rises as the student learns to say what the teacher would).
    """

    inputs = ("responses", "response_mask")
    outputs = ("teacher_log_prob",)

    def __init__(self, *, teacher: Any = None, tokenizer: Any = None) -> None:
        super().__init__()
        self.settings: dict[str, Any] = {"distillation.enabled": True}
        if teacher is not None:
            from verl.trainer.model_objects import model_directory

            self.settings["distillation.teacher_model.model_path"] = model_directory(
                teacher, what="DistillationOperator(teacher=...)", tokenizer=tokenizer, head="lm"
            )
        elif tokenizer is not None:
            raise ValueError("DistillationOperator(tokenizer=...) goes with teacher= (a model object)")

    def config_overrides(self) -> dict[str, Any]:
        return dict(self.settings)

    def bind(self, trainer: "StepPieces") -> None:
        super().bind(trainer)
        if not trainer.cfg.use_teacher:
            raise ValueError(
                "DistillationOperator: the stream's trainer has no teacher; build it with distillation.enabled=true "
                "distillation.teacher_model.model_path=<the teacher's directory>"
            )

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        return self.trainer.compute_teacher_log_prob(batch)
