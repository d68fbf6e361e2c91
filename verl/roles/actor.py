"""``Actor``: the trained policy (the engine with the LM head) and its PPO update.

The loss of one mini-batch is, with every term a share of the mini-batch's global loss
(``verl.models.forward``'s contract, through ``GlobalBatchInfo``):

    policy_loss(loss_mode)  -  entropy_coeff * entropy  +  kl_loss_coef * KL(actor || reference)

and with on-policy distillation (``distillation.enabled``: the batch's ``teacher_log_prob``) the
policy term becomes ``policy_loss + distillation_loss_coef * distillation_loss`` (or the
distillation loss alone without task rewards; :mod:`verl.algos.distill`). A top-k distillation
loss (``forward_kl_topk``) reads the student's log-probabilities of the teacher's top-k ids
(``teacher_topk_ids``), which the update's own forward computes (the engine's ``score_ids``).

:meth:`Actor.update_preference` is DPO's update on preference pairs (``verl.algos.preference``).

With a ``sample_weight`` [B] field in the batch (``verl.WeightedFilterOperator``) each term
scales each sample's losses by its weight, over the unweighted token/sequence denominators.

``policy_loss`` is the registered function ``policy_loss.loss_mode`` (vanilla PPO clip with DAPO's
clip-higher and dual clip, GSPO, CISPO, GPG, SAPO, GMPO, ...), aggregated with ``loss_agg_mode``, with
its hyper-parameters from the config (:func:`loss_hyperparameters`); the KL term
is there only with ``use_kl_loss`` (estimator ``kl_loss_type``). Log-probabilities are those of
the sampling temperature (the rollout's), as the engine drew them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from verl.algos import (
    TOPK_LOSS_MODES,
    GlobalBatchInfo,
    agg_loss,
    compute_distillation_loss,
    compute_kl_loss,
    compute_policy_loss,
    get_policy_loss,
    preference_step,
)
from verl.engine import LossShare
from verl.models.router_replay import AGREEMENT, ROUTED_EXPERTS
from verl.protocol import Batch
from verl.roles.engine_role import RoleEngine, step_metrics, token_budget
from verl.roles.teacher import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROB

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.config.schema import ActorConfig, DistillationLossConfig, ModelConfig
    from verl.models.vocab_parallel import SamplingTruncation

__all__ = ["Actor", "SAMPLE_WEIGHT"]

IS_WEIGHTS = "rollout_is_weights"
"""Optional batch field [B, R]: the decoupled rollout correction's importance weights, passed to the
policy loss (``algorithm.rollout_correction.rollout_is``)."""

SAMPLE_WEIGHT = "sample_weight"
"""Optional batch field [B]: each sample's weight in every actor loss term (``agg_loss``'s
``sample_weight``); ``verl.WeightedFilterOperator`` sets it."""

# loss_fn metric key -> the reference verl's logged key
_METRICS = {
    "pg_loss": "actor/pg_loss",
    "pg_clipfrac": "actor/pg_clipfrac",
    "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "kl_loss": "actor/kl_loss",
    "kl_coef": "actor/kl_coef",
    "entropy": "actor/entropy_loss",
    "router_replay/agreement": "actor/router_replay/agreement",  # R2: verl.models.router_replay.AGREEMENT
    # bypass_mode's rollout correction (the reference logs these keys as they are)
    "rollout_corr/kl": "rollout_corr/kl",
    "rollout_corr/k3_kl": "rollout_corr/k3_kl",
    "rollout_corr/rollout_is_mean": "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_rs_masked_fraction": "rollout_corr/rollout_rs_masked_fraction",
    # on-policy distillation (verl.algos.distill)
    "distill_loss": "distillation/loss",
    "distill_k1": "distillation/reverse_kl_k1",
    "distill_pg_pg_clipfrac": "distillation/pg_clipfrac",
    "distill_student_mass": "distillation/student_mass",
    "distill_teacher_mass": "distillation/teacher_mass",
}


class Actor:
    """The policy being trained (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.actor``.
        model: ``actor_rollout_ref.model``.
        pg: the actor's process groups.
        total_training_steps: optimizer steps of the run (sizes the LR schedule).
        max_sequence_length: prompt + response length.
        log_prob_micro_batch_size: sequences per forward in :meth:`compute_log_prob`
            (``rollout.log_prob_micro_batch_size_per_gpu``).
        log_prob_max_token_len: real tokens per forward micro-batch there instead (``rollout.
            log_prob_max_token_len_per_gpu`` with ``log_prob_use_dynamic_bsz``); None: rows.
        temperature: the sampling temperature the log-probabilities are taken at.
        truncation: the rollout's top-k / top-p that the log-probabilities replay (the old-policy pass and
            the update; ``actor.replay_sampling_mask``); None: full-vocabulary log-probabilities.
        balance: ``trainer.balance_batch``.
        old_log_prob: where the ratio's old log-probabilities come from (``PPOConfig.old_log_prob_source``):
            ``recompute``/``rollout``: the batch's ``old_log_probs``; ``current``: the update's own
            forward, detached (the batch must be one optimizer step). Without a separate pass,
            the update also measures ``actor/entropy`` and, against ``rollout_log_probs``, the
            rollout agreement (``training/*``) on its first mini-batch, before any weight changes.
    """

    distillation: "DistillationLossConfig | None" = None  # on-policy distillation's loss (distillation.enabled)

    def __init__(
        self,
        cfg: "ActorConfig",
        model: "ModelConfig",
        *,
        pg: "ProcessGroupCollection",
        total_training_steps: int,
        max_sequence_length: int,
        log_prob_micro_batch_size: int,
        temperature: float,
        balance: bool = False,
        old_log_prob: str = "recompute",
        log_prob_max_token_len: int | None = None,
        distillation: "DistillationLossConfig | None" = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> None:
        if old_log_prob not in ("recompute", "current", "rollout"):
            raise ValueError(f"old_log_prob={old_log_prob!r}; expected recompute, current or rollout")
        self.cfg = cfg
        self.old_log_prob = old_log_prob
        self.distillation = distillation
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.log_prob_max_token_len = log_prob_max_token_len
        self.max_token_len = token_budget(
            cfg.use_dynamic_bsz,
            cfg.ppo_max_token_len_per_gpu,
            flag="actor_rollout_ref.actor.use_dynamic_bsz",
            key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        )
        self.temperature = temperature if temperature > 0 else 1.0
        self.truncation = truncation if truncation is not None and truncation.active else None
        # Router replay (verl.models.router_replay): R2, the old-policy pass records each token's experts and
        # the update replays them; R3, both replay the experts the rollout engine recorded while generating.
        self.router_replay = cfg.megatron.router_replay.mode if cfg.strategy == "megatron" else "disabled"
        self.log_prob_metrics: dict[str, float] = {}
        """Metrics of the last :meth:`compute_log_prob` (R3: ``actor/router_replay/rollout_agreement``)."""
        self.role = RoleEngine(
            model=model,
            megatron=cfg.megatron,
            strategy=cfg.strategy,
            fsdp=cfg.fsdp_config,
            freeze_vision_tower=cfg.freeze_vision_tower,
            pg=pg,
            optim=cfg.optim,
            total_training_steps=total_training_steps,
            head="lm",
            name="actor",
            max_sequence_length=max_sequence_length,
            balance=balance,
        )

    @property
    def engine(self):
        """The underlying ``MegatronEngine`` (weight sync, checkpoints, export)."""
        return self.role.engine

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, entropy) of every response token under the current weights, each [B, R].
        With R2 router replay it also writes ``routed_experts`` [B, T, layers, k] into ``batch``: the
        experts this pass chose, which :meth:`update` replays; with R3 it routes by the batch's
        ``routed_experts`` (the rollout engine's)."""
        if self.router_replay == "R3":
            self._require_routing(batch, "the old-policy pass")
        out = self.role.forward(
            batch,
            output="logprobs",
            micro_batch_size=self.log_prob_micro_batch_size,
            max_token_len=self.log_prob_max_token_len,
            response_length=batch["responses"].shape[1],
            temperature=self.temperature,
            with_entropy=True,
            routing={"R2": "record", "R3": "replay"}.get(self.router_replay),
            truncation=self.truncation,
        )
        if self.router_replay == "R2":
            batch[ROUTED_EXPERTS] = out[ROUTED_EXPERTS]
        if self.router_replay == "R3":  # the engine's experts against the trainer's free choice, same weights
            self.log_prob_metrics = {"actor/router_replay/rollout_agreement": float(out[AGREEMENT])}
        return out["logprobs"], out["entropy"]

    def _require_routing(self, batch: Batch, where: str) -> None:
        if ROUTED_EXPERTS in batch:
            return
        source = {"R2": "the old-policy pass recorded (set actor.old_log_prob=recompute)",
                  "R3": "the rollout engine recorded (rollout.name=hf records them, and vllm on GPU)"}[self.router_replay]
        raise ValueError(
            f"actor.megatron.router_replay.mode={self.router_replay}: {where} replays the experts {source}, but the "
            f"batch has no '{ROUTED_EXPERTS}'"
        )

    @property
    def measures_in_update(self) -> bool:
        """Whether :meth:`update` measures entropy and rollout agreement (no separate pass did)."""
        return self.old_log_prob != "recompute"

    def _loss_builder(self, response_length: int):
        cfg = self.cfg
        measure = self.measures_in_update
        hyper = loss_hyperparameters(cfg)

        def make_loss(info: GlobalBatchInfo, num_micro: int):
            def loss_fn(outputs, micro) -> LossShare:
                log_prob = outputs["logprobs"][:, -response_length:]  # [b, R]
                mask = micro["response_mask"].to(log_prob.dtype)
                weight = micro.get(SAMPLE_WEIGHT)  # [b] or None
                is_weights = micro.get(IS_WEIGHTS)  # [b, R] or None (decoupled rollout correction)
                old_log_prob = micro["old_log_probs"] if "old_log_probs" in micro else log_prob.detach()
                pg_loss, pg_metrics = compute_policy_loss(
                    cfg.policy_loss.loss_mode,
                    old_log_prob=old_log_prob,
                    log_prob=log_prob,
                    advantages=micro["advantages"],
                    response_mask=mask,
                    loss_agg_mode=cfg.loss_agg_mode,
                    clip_ratio=cfg.clip_ratio,
                    clip_ratio_low=cfg.clip_ratio_low,
                    clip_ratio_high=cfg.clip_ratio_high,
                    clip_ratio_c=cfg.clip_ratio_c,
                    global_batch_info=info,
                    sample_weight=weight,
                    **({} if is_weights is None else {"rollout_is_weights": is_weights.to(log_prob.dtype)}),
                    **hyper,
                )
                loss = pg_loss
                metrics = {**pg_metrics, "pg_loss": pg_loss.detach() * num_micro}
                if self.distillation is not None:
                    student_topk = outputs["score_logprobs"][:, -response_length:] if self._topk else None
                    loss = self._with_distillation(
                        pg_loss, log_prob, old_log_prob, micro, mask, info, num_micro, metrics, student_topk
                    )
                if cfg.entropy_coeff != 0:
                    entropy = agg_loss(
                        outputs["entropy"][:, -response_length:],
                        mask,
                        cfg.loss_agg_mode,
                        global_batch_info=info,
                        sample_weight=weight,
                    )
                    loss = loss - cfg.entropy_coeff * entropy
                    metrics["entropy"] = entropy.detach() * num_micro
                if cfg.use_kl_loss:
                    kl = compute_kl_loss(
                        log_prob=log_prob,
                        ref_log_prob=micro["ref_log_prob"],
                        response_mask=mask,
                        kl_loss_type=cfg.kl_loss_type,
                        loss_agg_mode=cfg.loss_agg_mode,
                        global_batch_info=info,
                        sample_weight=weight,
                    )
                    loss = loss + cfg.kl_loss_coef * kl
                    metrics["kl_loss"] = kl.detach() * num_micro
                    metrics["kl_coef"] = cfg.kl_loss_coef
                if measure:
                    metrics.update(_measures(outputs["entropy"][:, -response_length:], log_prob, micro, mask))
                return LossShare(loss, metrics)

            return loss_fn

        return make_loss

    @property
    def _topk(self) -> bool:
        """Whether the distillation loss is a top-k one (it reads the student's log-probabilities of
        the teacher's top-k ids)."""
        return self.distillation is not None and self.distillation.loss_mode in TOPK_LOSS_MODES

    def _with_distillation(self, pg_loss, log_prob, old_log_prob, micro, mask, info, num_micro, metrics,
                           student_topk=None):
        """The policy term with on-policy distillation (``distillation.distillation_loss``, verl.algos.distill):
        pg_loss + coef x distillation loss, or the distillation loss alone (``use_task_rewards=false``);
        its metrics added to ``metrics``. ``student_topk`` [b, R, k]: a top-k loss's student side."""
        d = self.distillation
        loss, found = compute_distillation_loss(
            log_prob=log_prob,
            teacher_log_prob=micro["teacher_log_prob"],
            response_mask=mask,
            old_log_prob=old_log_prob,
            loss_mode=d.loss_mode,
            use_policy_gradient=d.use_policy_gradient,
            policy_loss_mode=d.policy_loss_mode,
            clip_ratio=d.clip_ratio,
            clip_ratio_low=d.clip_ratio_low,
            clip_ratio_high=d.clip_ratio_high,
            loss_agg_mode=self.cfg.loss_agg_mode,
            global_batch_info=info,
            sample_weight=micro.get(SAMPLE_WEIGHT),
            log_prob_min_clamp=d.log_prob_min_clamp,
            loss_max_clamp=d.loss_max_clamp,
            student_topk_log_prob=student_topk,
            teacher_topk_log_prob=micro.get(TEACHER_TOPK_LOG_PROB),
        )
        metrics.update(found)
        metrics["distill_loss"] = found["distill_loss"] * num_micro  # a share of the mini-batch's loss
        return pg_loss + d.distillation_loss_coef * loss if d.use_task_rewards else loss

    def update(self, batch: Batch, *, shuffle_seed: int, rollout_n: int) -> dict[str, float]:
        """PPO epochs over ``batch`` (``old_log_probs``, ``advantages``, ``response_mask`` and, with
        ``use_kl_loss``, ``ref_log_prob`` [B, R]) in mini-batches of ``ppo_mini_batch_size`` prompts
        (x ``rollout_n`` responses); returns the reference verl's ``actor/*`` metrics."""
        cfg = self.cfg
        keys = ["response_mask", "advantages"]
        if self.old_log_prob != "current":
            keys.append("old_log_probs")
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if self.distillation is not None:
            keys.append("teacher_log_prob")
        if self._topk:
            keys += [TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROB]
        if self.measures_in_update and "rollout_log_probs" in batch:
            keys.append("rollout_log_probs")
        if self.router_replay != "disabled":
            self._require_routing(batch, "the update")
            keys.append(ROUTED_EXPERTS)
        if SAMPLE_WEIGHT in batch:
            if SAMPLE_WEIGHT not in inspect.signature(get_policy_loss(cfg.policy_loss.loss_mode)).parameters:
                raise ValueError(
                    f"the batch has per-sample weights ({SAMPLE_WEIGHT}, e.g. from a WeightedFilterOperator) but "
                    f"actor.policy_loss.loss_mode={cfg.policy_loss.loss_mode!r} takes no sample_weight; give the "
                    "registered loss a sample_weight argument (passed to agg_loss) or drop the weights"
                )
            keys.append(SAMPLE_WEIGHT)
        if IS_WEIGHTS in batch:
            if IS_WEIGHTS not in inspect.signature(get_policy_loss(cfg.policy_loss.loss_mode)).parameters:
                raise ValueError(
                    f"algorithm.rollout_correction.rollout_is put IS weights ({IS_WEIGHTS}) in the batch, but "
                    f"actor.policy_loss.loss_mode={cfg.policy_loss.loss_mode!r} takes no rollout_is_weights; give "
                    "the registered loss a rollout_is_weights argument, or set rollout_is=null"
                )
            keys.append(IS_WEIGHTS)
        results = self.role.train(
            batch,
            keys=keys,
            mini_batch_rows=cfg.ppo_mini_batch_size * rollout_n,
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            max_token_len=self.max_token_len,
            epochs=cfg.ppo_epochs,
            make_loss=self._loss_builder(batch["responses"].shape[1]),
            shuffle_seed=shuffle_seed if cfg.shuffle else None,
            output="logprobs",
            temperature=self.temperature,
            with_entropy=cfg.entropy_coeff != 0 or self.measures_in_update,
            score_ids=TEACHER_TOPK_IDS if self._topk else None,
            routing="replay" if self.router_replay != "disabled" else None,
            truncation=self.truncation,
        )
        metrics = step_metrics("actor", results, _METRICS)
        if self.measures_in_update and results:
            metrics.update(_measured(results[0].metrics))
        return metrics

    def update_preference(
        self, batch: Batch, *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0
    ) -> dict[str, float]:
        """One optimizer step of a preference loss (``verl.algos.preference``: ``sigmoid`` is DPO) on
        ``batch``: pairs as rows 2i (chosen) and 2i + 1 (rejected), with ``response_mask`` and the
        reference's ``ref_log_prob`` [2B, R]; log-probabilities at temperature 1, summed per response
        (averaged for a length-averaged loss such as ``ipo``: ``verl.algos.preference_step``).

        The loss goes through the engine's forward-backward as a ``LossShare``: a first forward at the
        current weights gives each response's sequence log-prob and the loss's derivative c_i with
        respect to it; the training pass then back-propagates sum_i c_i * logp_i(theta), whose
        gradient is exactly the loss's at these weights. So micro-batches and data-parallel ranks
        need not keep a pair together, and the step is one optimizer update on the whole batch
        (several would use stale c_i). Returns ``dpo/loss`` (at the weights before the step),
        ``dpo/rewards/{chosen,rejected,accuracy,margin}`` and ``actor/grad_norm``, ``actor/lr``.
        """
        side = batch["pair_side"]  # [2B]: 0 chosen, 1 rejected
        if len(batch) % 2 or not (bool((side[0::2] == 0).all()) and bool((side[1::2] == 1).all())):
            raise ValueError(
                "update_preference needs pairs as rows 2i (chosen) and 2i + 1 (rejected) "
                "(RLTrainer.preference_batch lays them out so); the batch was reordered or filtered"
            )
        response_length = batch["responses"].shape[1]
        mask = batch["response_mask"]
        out = self.role.forward(
            batch,
            output="logprobs",
            micro_batch_size=self.log_prob_micro_batch_size,
            max_token_len=self.log_prob_max_token_len,
            response_length=response_length,
            temperature=1.0,
        )
        loss, pref_metrics, coef = preference_step(
            loss_type,
            log_prob=out["logprobs"],
            ref_log_prob=batch["ref_log_prob"],
            response_mask=mask,
            beta=beta,
            label_smoothing=label_smoothing,
        )
        batch["preference_coef"] = coef.float()  # [2B]: d loss / d (summed logp_i)

        def make_loss(info: GlobalBatchInfo, num_micro: int):
            def loss_fn(outputs, micro) -> LossShare:
                log_prob = outputs["logprobs"][:, -response_length:]  # [b, R]
                seq = (log_prob * micro["response_mask"].to(log_prob.dtype)).sum(-1)  # [b]
                # c_i already carries the whole batch's 1/num_pairs; x dp_size undoes DDP's average.
                return LossShare((micro["preference_coef"].to(seq.dtype) * seq).sum() * info.dp_size, {})

            return loss_fn

        results = self.role.train(
            batch,
            keys=["response_mask", "preference_coef"],
            mini_batch_rows=len(batch),
            micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu,
            max_token_len=self.max_token_len,
            epochs=1,
            make_loss=make_loss,
            shuffle_seed=None,
            output="logprobs",
            temperature=1.0,
        )
        metrics = step_metrics("actor", results, {})
        metrics["dpo/loss"] = float(loss)
        metrics.update({f"dpo/{k}": float(v) for k, v in pref_metrics.items()})
        return metrics


def loss_hyperparameters(cfg: "ActorConfig") -> dict[str, object]:
    """The policy losses' own hyper-parameters, under the reference verl's key names (each registered
    loss takes the ones it names: ``compute_policy_loss`` passes only those)."""
    pl = cfg.policy_loss
    rc = pl.rollout_correction
    return {
        "tau_pos": cfg.tau_pos,
        "tau_neg": cfg.tau_neg,
        "clip_cov_ratio": pl.clip_cov_ratio,
        "clip_cov_lb": pl.clip_cov_lb,
        "clip_cov_ub": pl.clip_cov_ub,
        "kl_cov_ratio": pl.kl_cov_ratio,
        "ppo_kl_coef": pl.ppo_kl_coef,
        "dro_beta": pl.dro_beta,
        "loss_type": rc.loss_type,
        "rollout_is": rc.rollout_is,
        "rollout_is_threshold": rc.rollout_is_threshold,
        "rollout_is_batch_normalize": rc.rollout_is_batch_normalize,
        "rollout_rs": rc.rollout_rs,
        "rollout_rs_threshold": rc.rollout_rs_threshold,
    }


# What the update measures per micro-batch when no separate pass gave old log-probabilities: sums
# (the engine averages every metric over micro-batches and DP ranks, so a ratio of two averaged
# sums is the ratio over the whole mini-batch) and maxima ("max:" keys, reduced by max).
def _measures(entropy: torch.Tensor, log_prob: torch.Tensor, micro, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    keep = mask.bool()
    out = {
        "measure/tokens": mask.sum().double(),
        "measure/entropy_sum": (entropy.detach().double() * mask).sum(),
    }
    if "rollout_log_probs" in micro:
        rollout, trainer = micro["rollout_log_probs"].double()[keep], log_prob.detach().double()[keep]
        diff = (rollout - trainer).abs()
        probs = (rollout.exp() - trainer.exp()).abs()
        zero = torch.zeros((), dtype=torch.float64, device=diff.device)
        out.update(
            {
                "measure/logprob_abs_sum": diff.sum(),
                "measure/logprob_exp_sum": diff.exp().sum(),
                "measure/probs_sum": probs.sum(),
                "measure/probs_sq_sum": (probs * probs).sum(),
                "max:measure/logprob_abs": diff.max() if diff.numel() else zero,
                "max:measure/probs": probs.max() if probs.numel() else zero,
            }
        )
    return out


def _measured(m: dict[str, float]) -> dict[str, float]:
    """``actor/entropy`` and the rollout agreement (``ppo_metrics.rollout_agreement_metrics``'s keys)
    from one optimizer step's ``_measures``."""
    tokens = m.get("measure/tokens", 0.0)
    if tokens <= 0:
        return {}
    out = {"actor/entropy": m["measure/entropy_sum"] / tokens}
    if "measure/logprob_abs_sum" in m:
        mean = m["measure/probs_sum"] / tokens
        # the population std (the pass's is torch's sample std: a factor sqrt(n / (n - 1)) apart)
        var = max(m["measure/probs_sq_sum"] / tokens - mean * mean, 0.0)
        out.update(
            {
                "training/rollout_probs_diff_max": m["max:measure/probs"],
                "training/rollout_probs_diff_mean": mean,
                "training/rollout_probs_diff_std": var**0.5,
                "training/rollout_logprob_diff_max": m["max:measure/logprob_abs"],
                "training/token_mult_prob_error": m["measure/logprob_exp_sum"] / tokens,
            }
        )
    return out
