"""``verl.RLTrainer``: the keyword-argument facade over :class:`verl.trainer.ppo_trainer.PPOTrainer`.

It only builds a ``PPOConfig`` (from a YAML file under configs/, then its arguments, then
``overrides``) and calls the trainer's ``fit`` — the loop ``python -m verl.trainer.main_ppo``
runs. Checkpoints are the trainer's: ``output_dir/global_step_N/`` (actor, critic, and
``trainer_state.json``; :meth:`RLTrainer.from_checkpoint` also takes ``output_dir/checkpoint-N``,
the Hugging Face Trainer's name), logs under ``output_dir/logs`` (``metrics.jsonl``) or a
``verl.monitor.VerlMonitor``'s ``log_dir``. ``fit(dataset=...)`` takes prompt files or
``verl.utils.load_hf_dataset``'s result (written to ``output_dir/data/train.parquet``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl.api.monitor import VerlMonitor
    from verl.config import PPOConfig

__all__ = ["ALGORITHMS", "RLTrainer"]

ALGORITHMS: dict[str, str] = {
    "ppo": "gae",
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
    "remax": "remax",
    "gpg": "gpg",
    "opo": "opo",
    "grpo_passk": "grpo_passk",
}
"""``algorithm=`` name -> ``algorithm.adv_estimator`` (``ppo`` is GAE with a critic)."""

PREFERENCE_ALGORITHMS = ("dpo",)
"""``algorithm=`` names that train on preference pairs (``prompt``, ``chosen``, ``rejected``), not rewards."""

HYBRID_ALGORITHMS = ("hybrid_ppo",)
"""``algorithm=`` names of HybridFlow: with a ``hybrid_condition`` the step routes each sample to PPO (GRPO) or
DPO (``ConditionalUpdateOperator``); without one it is HybridFlow's PPO (actor, critic with GAE, the reward,
the reference: ``ppo``'s step on the default colocated placement)."""

_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

RUN_FILE = "verl_rl_trainer.json"
"""Written into ``output_dir`` by :meth:`RLTrainer.fit`: the arguments, for :meth:`RLTrainer.from_checkpoint`."""

_FIT_DEFAULTS: dict[str, Any] = {
    "save_steps": -1,
    "logging_steps": 1,
    "output_dir": "outputs/verl",
    "val_dataset_path": None,
    "eval_steps": -1,
    "save_hf": True,
}


def reward_change(rewards: Sequence[float]) -> float:
    """The mean of the last quarter of ``rewards`` (one per step, in order) minus the mean of the
    first quarter (at least one step each; one step: 0.0)."""
    quarter = max(1, len(rewards) // 4)
    return sum(rewards[-quarter:]) / quarter - sum(rewards[:quarter]) / quarter


def _summary(metrics: dict[str, Any], log_dir: str) -> dict[str, Any]:
    """:meth:`RLTrainer.fit`'s summary keys from the last step's ``metrics`` and the run's
    ``metrics.jsonl`` in ``log_dir`` (see ``fit``'s docstring)."""
    from verl.trainer import report

    out: dict[str, Any] = {}
    if "critic/score/mean" in metrics and "reward_mean" not in metrics:  # a stream's is of all its samples
        out["reward_mean"] = metrics["critic/score/mean"]
    run = report.load_run(log_dir)
    _, rewards = run.series("critic/score/mean")
    if rewards:
        out["reward_delta"] = reward_change(rewards)
    val_keys = sorted(k for k in run.keys() if k.startswith("val-core/") and "/reward/mean@" in k)
    if val_keys:
        _, val = run.series(val_keys[0])
        if len(val) >= 2:
            out["val_reward_delta"] = val[-1] - val[0]
    loss_key = "actor/pg_loss" if "actor/pg_loss" in metrics else "dpo/loss"
    if loss_key in metrics:
        out["loss"] = metrics[loss_key]
    kl_key = "actor/kl_loss" if "actor/kl_loss" in metrics else "actor/ppo_kl"
    if kl_key in metrics:
        out["final_kl"] = metrics[kl_key]
    if "rollout/tokens_per_s" in metrics:
        out["rollout_tokens_per_second"] = metrics["rollout/tokens_per_s"]
    return out


def _model_source(model: Any, arg: str, head: str) -> tuple[Any, str | None]:
    """(the model object, None) for an object of a supported family (written by ``fit``), or
    (None, its directory) for a checkpoint directory; (None, None) for None (a reward model only)."""
    from verl.trainer.model_objects import _check_object, is_model_object, model_directory

    what = f"RLTrainer({arg}=...)"
    if model is None and head == "reward":
        return None, None
    if is_model_object(model):
        _check_object(model, what, head)
        return model, None
    if isinstance(model, (str, os.PathLike)):
        if head == "reward":  # checked now: a reward model's head is read before anything is built
            return None, model_directory(model, what=what, head=head)
        return None, os.fspath(model)
    kind = "a Hugging Face reward model directory or a ...ForSequenceClassification object" if head == "reward" else (
        "a Hugging Face checkpoint directory or a transformers model object")
    raise TypeError(f"{what} takes {kind}, got {type(model).__name__}")


def _check_logging_steps(logging_steps: Any) -> None:
    if isinstance(logging_steps, bool) or not isinstance(logging_steps, int) or logging_steps < 1:
        raise ValueError(
            f"RLTrainer.fit: logging_steps={logging_steps!r}; give an int >= 1 (metrics are logged and printed "
            "every logging_steps steps)"
        )


def _check_output_dir(output_dir: str, where: str) -> None:
    """ValueError naming ``output_dir`` when it is a file or lies below one (nothing could be written
    there); checked before ``fit`` writes anything into it (data, model objects)."""
    path = os.path.abspath(os.path.expanduser(output_dir))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        how = "is a file" if path == os.path.abspath(os.path.expanduser(output_dir)) else f"lies inside {path}, a file"
        raise ValueError(
            f"RLTrainer.{where}: output_dir={output_dir} {how}, not a folder: the run writes its checkpoints and logs "
            "into a folder; give output_dir= a folder path, new or existing"
        )


def _estimator(algorithm: str, hybrid_condition: Any) -> str:
    """``algorithm.adv_estimator`` of a reward-based ``algorithm=`` (``hybrid_ppo``: GRPO beside DPO with a
    condition, HybridFlow's PPO (GAE) without one)."""
    if algorithm in HYBRID_ALGORITHMS:
        return "grpo" if hybrid_condition is not None else "gae"
    return ALGORITHMS[algorithm]


def _check_algorithm(
    algorithm: str, *, hybrid_condition: Any, kl_coef: float, beta: Any, preference_dataset_path: Any
) -> None:
    """The facade's algorithm arguments hold together (ValueError naming the fix otherwise)."""
    choices = sorted([*ALGORITHMS, *PREFERENCE_ALGORITHMS, *HYBRID_ALGORITHMS])
    if algorithm not in choices:
        raise ValueError(f"unknown algorithm={algorithm!r}; choose one of {choices}")
    if algorithm in HYBRID_ALGORITHMS and hybrid_condition is not None:
        if not callable(hybrid_condition):
            raise ValueError(
                f"algorithm={algorithm!r}: hybrid_condition={hybrid_condition!r} is not callable; it routes each "
                "sample (true: the PPO/GRPO update, false: DPO on the best-vs-worst pair of its group), e.g. "
                "lambda s: s['reward'] > 0; or leave it out for HybridFlow's PPO"
            )
        if not kl_coef > 0:
            raise ValueError(f"algorithm={algorithm!r}: its DPO half needs the reference policy; give kl_coef > 0")
    elif algorithm not in HYBRID_ALGORITHMS and hybrid_condition is not None:
        raise ValueError(f"hybrid_condition= is for algorithm='hybrid_ppo', not {algorithm!r}")
    if algorithm in PREFERENCE_ALGORITHMS and not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"RLTrainer(beta={beta!r}): DPO's beta must be a positive number")
    if preference_dataset_path is not None and algorithm not in PREFERENCE_ALGORITHMS:
        raise ValueError(
            f"RLTrainer(preference_dataset_path=...) gives preference pairs (prompt, chosen, rejected), but "
            f"algorithm={algorithm!r} learns from a reward, which pairs do not give. Train on pairs with DPO: "
            "RLTrainer(..., algorithm=\"dpo\", preference_dataset_path=..., beta=0.1); or give "
            f"{algorithm} prompts to score: fit(dataset=...)"
        )


def _files_setting(files: str | Sequence[str]) -> str:
    if isinstance(files, (str, os.PathLike)):
        return os.fspath(files)
    return "[" + ",".join(os.fspath(f) for f in files) + "]"


_LORA_ALPHA, _TARGET_MODULES = 16, "all-linear"
"""``RLTrainer``'s ``lora_alpha`` and ``target_modules`` when a ``lora_rank`` is given without them."""


def _lora_settings(rank: Any, alpha: Any, target_modules: Any) -> list[str]:
    """``actor_rollout_ref.model.lora_*`` settings of RLTrainer's LoRA arguments; ValueError naming
    the argument when one is not usable (before any model is read). ``alpha`` and ``target_modules``
    are None when not given: given without a rank they would be dropped and every weight trained."""
    from verl.models.lora import resolve_target_modules

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"RLTrainer: lora_rank={rank!r}; give an int >= 0 (0 trains every weight)")
    if rank == 0:
        given = [f"{k}={v!r}" for k, v in (("lora_alpha", alpha), ("target_modules", target_modules)) if v is not None]
        if given:
            raise ValueError(
                f"RLTrainer: {' and '.join(given)} given, but lora_rank=0 builds no adapters and trains every "
                "weight: give lora_rank= (e.g. lora_rank=16) to train LoRA adapters, or drop "
                f"{' and '.join(g.split('=')[0] + '=' for g in given)}"
            )
        return []
    alpha = _LORA_ALPHA if alpha is None else alpha
    target_modules = _TARGET_MODULES if target_modules is None else target_modules
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha <= 0:
        raise ValueError(f"RLTrainer: lora_alpha={alpha!r}; give an int > 0 (the adapters scale by lora_alpha / lora_rank)")
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    resolve_target_modules(target_modules if isinstance(target_modules, str) else names, key="RLTrainer: target_modules")
    a = "actor_rollout_ref.model"
    modules = names[0] if isinstance(target_modules, str) else "[" + ",".join(names) + "]"
    return [f"{a}.lora_rank={rank}", f"{a}.lora_alpha={alpha}", f"{a}.target_modules={modules}"]


_TEACHER_SET_BY_ARGUMENT = ("enabled", "teacher_model.model_path")
"""``distillation.*`` keys ``teacher=`` sets itself (refused in ``distillation=``)."""


def _teacher_path(teacher: Any) -> str:
    """The absolute directory of ``RLTrainer(teacher=...)``; ValueError with the command line's
    message for ``distillation.teacher_model.model_path`` when it is not a model directory."""
    from verl.utils.paths import check_model_dir

    if not isinstance(teacher, (str, os.PathLike)):
        raise TypeError(
            f"RLTrainer(teacher=...) takes the teacher's Hugging Face checkpoint directory, got {type(teacher).__name__}"
            " (a model object: save it with save_pretrained, with the student's tokenizer, and pass the directory)"
        )
    path = os.fspath(teacher)
    try:
        check_model_dir(path, "distillation.teacher_model.model_path")
    except ValueError as exc:
        raise ValueError(f"RLTrainer(teacher=...): {exc}") from None
    return os.path.abspath(os.path.expanduser(path))


def _distillation_settings(teacher: str | None, options: Any) -> list[str]:
    """``distillation.*`` settings of RLTrainer's ``teacher=`` and ``distillation=`` arguments; ValueError
    naming the key when an option is not a ``distillation.*`` field, cannot take its value, or is set by
    ``teacher=`` (before any model is read)."""
    from verl.config.core import close_matches, coerce, is_section, schema
    from verl.config.loader import all_paths
    from verl.config.schema import DistillationConfig

    if teacher is None:
        if options:
            raise ValueError(
                "RLTrainer(distillation=...) sets on-policy distillation's options, which need a teacher; "
                "give teacher=<the teacher's Hugging Face directory> too"
            )
        return []
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"RLTrainer(distillation=...) takes a dict of distillation.* keys, got {type(options).__name__}")
    flat: dict[str, Any] = {}

    def walk(cls: type, prefix: str, items: dict[str, Any]) -> None:
        fields = schema(cls)
        for key, value in items.items():
            head, _, rest = str(key).partition(".")
            full = f"{prefix}{key}"
            if head not in fields:
                paths = all_paths(DistillationConfig)
                keys = [p for p in paths if p not in _TEACHER_SET_BY_ARGUMENT and not any(
                    q.startswith(p + ".") for q in paths)]  # the settable leaves
                # a key given without its section (loss_mode) is the section's key
                near = [p for p in keys if p.endswith("." + full)] or close_matches(full, keys)
                tip = "; did you mean " + " or ".join(repr(p) for p in near) + "?" if near else (
                    f" (its keys: {', '.join(keys)})")
                raise ValueError(f"RLTrainer(distillation=...): distillation.{full} is not a setting{tip}")
            field, hint = fields[head]
            if is_section(hint):
                if rest:
                    walk(hint, f"{prefix}{head}.", {rest: value})
                elif isinstance(value, dict):
                    walk(hint, f"{prefix}{head}.", value)
                else:
                    raise ValueError(
                        f"RLTrainer(distillation=...): distillation.{full} is a section; give a dict of its keys"
                    )
                continue
            if rest:
                raise ValueError(f"RLTrainer(distillation=...): distillation.{prefix}{head} has no key {rest!r}")
            if full in _TEACHER_SET_BY_ARGUMENT:
                raise ValueError(
                    f"RLTrainer(distillation=...): distillation.{full} is set by teacher= (the teacher's directory "
                    "turns distillation on); leave it out"
                )
            flat[full] = coerce(value, hint, where=f"RLTrainer(distillation=...): distillation.{full}",
                                metadata=field.metadata)

    walk(DistillationConfig, "", options)
    return [
        "distillation.enabled=true",
        f"distillation.teacher_model.model_path={teacher}",
        *(f"distillation.{k}={json.dumps(v)}" for k, v in flat.items()),
    ]


class RLTrainer:
    """Train a policy with PPO, GRPO, RLOO, ... from a few keyword arguments."""

    def __init__(
        self,
        actor_model: Any,
        *,
        tokenizer: Any = None,
        reward_model: Any = None,
        teacher: str | os.PathLike | None = None,
        distillation: dict[str, Any] | None = None,
        algorithm: str = "grpo",
        use_vllm: bool = True,
        rollout_batch_size: int = 32,
        n_samples: int = 4,
        train_batch_size: int | None = None,
        micro_batch_size: int = 16,
        learning_rate: float = 1e-6,
        kl_coef: float = 0.001,
        clip_range: float = 0.2,
        beta: float = 0.1,
        hybrid_condition: Callable[[dict[str, Any]], bool] | None = None,
        preference_dataset_path: str | Sequence[str] | None = None,
        max_prompt_length: int = 512,
        max_response_length: int = 256,
        temperature: float = 1.0,
        seed: int = 1,
        device: str = "auto",
        lora_rank: int = 0,
        lora_alpha: int | None = None,
        target_modules: str | Sequence[str] | None = None,
        config: str = "ppo_trainer",
        overrides: Sequence[str] = (),
    ) -> None:
        """
        Args:
            actor_model: the policy: a Hugging Face checkpoint directory, or a ``transformers``
                ``...ForCausalLM`` object (Llama, Qwen2, Mistral families), trained through
                Megatron-core. An object is written to ``output_dir/model_init/`` when :meth:`fit`
                starts and the trained weights are loaded back into it when it ends (the run also
                exports them to ``output_dir/huggingface/``). Any other ``nn.Module`` with ``forward()``
                and ``generate()`` trains on the plain PyTorch engine (``verl.engine.torch_engine``: the
                object itself, on one process or DDP under torchrun; critic-free algorithms); one
                log line says which engine was chosen and why.
            tokenizer: the tokenizer of an ``actor_model`` object (an object or its directory); None:
                read from the object's ``name_or_path`` directory. Unused for a directory.
            reward_model: a trained reward model that scores every response: a Hugging Face checkpoint
                directory, or a ``...ForSequenceClassification`` object with ``num_labels=1`` (Llama,
                Qwen2, Mistral families; written to ``output_dir/reward_model_init/`` by :meth:`fit`).
                It is the trainer's reward-model role (``reward_model.enable``, a frozen Megatron engine
                scoring each sequence at its last real token) and reads the policy's token ids, so it
                must share the policy's tokenizer. None: the rule-based scorers by ``data_source``.
            teacher: on-policy distillation's teacher: a Hugging Face checkpoint directory of the
                policy's tokenizer (any size or depth of a supported family). It turns distillation on
                (``distillation.enabled=true``, ``distillation.teacher_model.model_path``): a frozen
                Megatron role scores every sampled token and the actor's loss adds the KL to it
                (docs/algorithms.md, "On-policy distillation"); placed with the actor unless
                ``overrides`` set ``trainer.placement.teacher``. With ``algorithm="grpo"`` (or another
                reward-based one) only: DPO does not train on the policy's own samples. None: no teacher.
            distillation: distillation options with ``teacher``: ``distillation.*`` config keys without
                the prefix, dotted or nested (``{"distillation_loss.loss_mode": "k1",
                "distillation_loss.use_policy_gradient": True}``, ``{"teacher_model": {"megatron":
                {"tensor_model_parallel_size": 2}}}``); ``python -m verl.config --help`` lists them.
            algorithm: one of :data:`ALGORITHMS` (``"ppo"`` trains a critic; the others are critic-free),
                or ``"dpo"``: DPO on preference pairs (``DPOUpdateOperator``'s step in the trainer's loop),
                or ``"hybrid_ppo"``: HybridFlow's PPO (actor, critic with GAE, ``reward_model`` or the
                rule-based scorers, the reference when ``kl_coef > 0``; the same step as ``"ppo"``), or with
                ``hybrid_condition``, GRPO and DPO in one step, by that condition.
            use_vllm: rollout with vLLM (``True``) or the transformers ``generate`` engine.
            rollout_batch_size: prompts per step (``data.train_batch_size``).
            n_samples: responses per prompt (``actor_rollout_ref.rollout.n``).
            train_batch_size: prompts per optimizer step (``actor.ppo_mini_batch_size``;
                ``rollout_batch_size`` when None: one update per step).
            micro_batch_size: sequences per forward/backward pass and per log-prob pass.
            learning_rate: the actor's (and critic's) learning rate.
            kl_coef: KL-to-reference loss coefficient (0: no reference model, no KL loss).
            clip_range: PPO's policy-ratio clip.
            beta: DPO's beta (``algorithm="dpo"`` and the DPO half of ``"hybrid_ppo"``).
            hybrid_condition: ``algorithm="hybrid_ppo"``, optional: ``f(sample) -> bool`` (a sample as
                ``FilterOperator``'s predicate sees it, with ``reward``); true: the sample trains with
                GRPO, false: its group's best and worst such samples make a DPO pair
                (``verl.ConditionalUpdateOperator``). Not saved for :meth:`from_checkpoint`: pass it again.
            preference_dataset_path: preference pairs (``prompt``, ``chosen``, ``rejected`` columns;
                parquet/jsonl/json, or ``verl.utils.load_hf_dataset``'s result) for
                ``algorithm="dpo"``: the data :meth:`fit` trains on when it is given no ``dataset``.
                Reward-based algorithms (``grpo``, ``ppo``, ...) cannot learn from pairs: refused,
                pointing to ``algorithm="dpo"``.
            max_prompt_length: prompt tokens kept (``data.max_prompt_length``).
            max_response_length: new tokens per response (``data.max_response_length``).
            temperature: rollout sampling temperature.
            seed: the trainer's and the rollout's seed.
            device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (``trainer.device``).
            lora_rank: > 0: train LoRA adapters of this rank on the policy (Megatron engine), the base
                weights frozen; the reference is the policy with its adapters off
                (``actor_rollout_ref.model.lora_rank``, docs/lora.md). 0: train every weight.
            lora_alpha: the adapters' scaling numerator (``lora_alpha / lora_rank``, PEFT's); None: 16.
                With ``lora_rank`` only: refused without it.
            target_modules: Hugging Face module names the adapters go on (``q_proj``, ``k_proj``,
                ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), or ``"all-linear"``;
                None: ``"all-linear"``. With ``lora_rank`` only: refused without it.
            config: the YAML config started from (a name under configs/ or a path).
            overrides: ``key=value`` settings applied last (any ``python -m verl.config --help`` key).
        """
        self._init_args = {
            k: v for k, v in locals().items() if k not in ("self", "__class__", "hybrid_condition", "tokenizer")
        }
        self._init_args["overrides"] = list(overrides)
        lora = _lora_settings(lora_rank, lora_alpha, target_modules)
        if target_modules is not None and not isinstance(target_modules, str):
            self._init_args["target_modules"] = list(target_modules)
        _check_algorithm(algorithm, hybrid_condition=hybrid_condition, kl_coef=kl_coef, beta=beta,
                         preference_dataset_path=preference_dataset_path)
        self._tokenizer = tokenizer
        self._actor_object, self.actor_model = _model_source(actor_model, "actor_model", "lm")
        self._reward_object, self.reward_model = _model_source(reward_model, "reward_model", "reward")
        self.teacher = None if teacher is None else _teacher_path(teacher)
        self._init_args["teacher"] = self.teacher
        self._init_args["distillation"] = None if distillation is None else dict(distillation)
        if self.teacher is not None and (
            algorithm in PREFERENCE_ALGORITHMS or (algorithm in HYBRID_ALGORITHMS and hybrid_condition is not None)
        ):
            raise ValueError(
                f"RLTrainer(teacher=...) distils on the policy's own samples, which algorithm={algorithm!r} does "
                "not train on (DPO learns from pairs); use a reward-based algorithm (grpo, ppo, ...) or drop teacher="
            )
        distill = _distillation_settings(self.teacher, distillation)
        # An object is written by fit(): its directory is saved for from_checkpoint then.
        self._init_args["actor_model"], self._init_args["reward_model"] = self.actor_model, self.reward_model
        if isinstance(preference_dataset_path, (str, os.PathLike)):
            preference_dataset_path = os.path.abspath(os.fspath(preference_dataset_path))
            self._init_args["preference_dataset_path"] = preference_dataset_path
        self.preference_dataset_path = preference_dataset_path
        self.algorithm = algorithm
        self.beta = float(beta)
        self.hybrid_condition = hybrid_condition
        mini = rollout_batch_size if train_batch_size is None else train_batch_size
        a = "actor_rollout_ref"
        self._settings = [
            *(
                ["data.pairs=true", "data.val_files=null", f"algorithm.dpo.beta={float(beta)}"]
                if algorithm in PREFERENCE_ALGORITHMS
                else [f"algorithm.adv_estimator={_estimator(algorithm, hybrid_condition)}"]
            ),
            # the hybrid step's DPO half (build_step(cfg, hybrid_condition=...)) reads its beta from the config
            *([f"algorithm.dpo.beta={float(beta)}"] if algorithm in HYBRID_ALGORITHMS and hybrid_condition is not None else []),
            f"{a}.rollout.name={'vllm' if use_vllm else 'hf'}",
            f"data.train_batch_size={rollout_batch_size}",
            f"{a}.rollout.n={n_samples}",
            f"{a}.actor.ppo_mini_batch_size={mini}",
            f"{a}.actor.ppo_micro_batch_size_per_gpu={micro_batch_size}",
            f"{a}.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
            f"{a}.ref.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
            f"critic.ppo_mini_batch_size={mini}",
            f"critic.ppo_micro_batch_size_per_gpu={micro_batch_size}",
            f"critic.forward_micro_batch_size_per_gpu={micro_batch_size}",
            f"{a}.actor.optim.lr={learning_rate}",
            f"critic.optim.lr={learning_rate}",
            f"{a}.actor.use_kl_loss={str(kl_coef > 0).lower()}",
            f"{a}.actor.kl_loss_coef={kl_coef}",
            f"{a}.actor.clip_ratio={clip_range}",
            f"data.max_prompt_length={max_prompt_length}",
            f"data.max_response_length={max_response_length}",
            f"{a}.rollout.temperature={temperature}",
            f"trainer.seed={seed}",
            f"{a}.rollout.seed={seed}",
            f"trainer.device={device}",
            "trainer.n_gpus_per_node=1",
            *lora,
            *distill,
        ]
        self._config = config
        self._overrides = list(overrides)
        self.last_config: PPOConfig | None = None
        self.last_checkpoint: str | None = None
        self._resume_path: str | None = None
        self._fit_defaults: dict[str, Any] = {}

    @classmethod
    def from_checkpoint(cls, path: str, *, hybrid_condition: Callable[[dict[str, Any]], bool] | None = None) -> "RLTrainer":
        """The trainer whose :meth:`fit` wrote checkpoint ``path``, with its arguments (read from
        ``output_dir/``verl_rl_trainer.json````); ``.fit(resume_from_checkpoint=True)`` then continues
        at step N+1 with the same data and ``max_steps`` unless given again.

        ``path`` is ``output_dir/global_step_N`` (the trainer's checkpoint folder, as ``main_ppo``
        writes it), ``output_dir/checkpoint-N`` (the same checkpoint under the Hugging Face
        Trainer's name), or ``output_dir`` itself (its newest checkpoint)."""
        from verl.utils.checkpoint import CheckpointManager, step_dir_name

        path = os.path.abspath(os.fspath(path))
        name = os.path.basename(path)
        match = _HF_CHECKPOINT.match(name)
        if match is not None and not os.path.isdir(path):
            path = os.path.join(os.path.dirname(path), step_dir_name(int(match.group(1))))
        elif os.path.isfile(os.path.join(path, RUN_FILE)):
            found = CheckpointManager(path).latest()
            if found is None:
                raise ValueError(f"RLTrainer.from_checkpoint: {path} holds no checkpoint (global_step_N/) yet")
            path = found.path
        run_file = os.path.join(os.path.dirname(path), RUN_FILE)
        if not os.path.isdir(path):
            raise ValueError(
                f"RLTrainer.from_checkpoint: {path} is not a checkpoint directory (output_dir/global_step_N, "
                "output_dir/checkpoint-N or output_dir)"
            )
        try:
            with open(run_file, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"RLTrainer.from_checkpoint: cannot read {run_file} ({exc}); it is written by verl.RLTrainer.fit "
                "beside its checkpoints. For a main_ppo run, resume with trainer.resume_mode=resume_path"
            ) from None
        if saved.get("hybrid_condition") and hybrid_condition is None:
            raise ValueError(
                f"RLTrainer.from_checkpoint: the run in {os.path.dirname(path)} routed its samples by a "
                "hybrid_condition, which is not saved; pass it again: from_checkpoint(path, hybrid_condition=f)"
            )
        init = dict(saved["init"])
        if not init.get("lora_rank"):  # a run file written before these defaulted to None: the run had no adapters
            init.pop("lora_alpha", None)
            init.pop("target_modules", None)
        trainer = cls(**init, hybrid_condition=hybrid_condition)
        trainer._resume_path = path
        trainer._fit_defaults = dict(saved["fit"])
        return trainer

    def build_config(
        self,
        *,
        dataset_path: str | Sequence[str],
        max_steps: int | None = None,
        save_steps: int = -1,
        logging_steps: int = 1,
        output_dir: str = "outputs/verl",
        val_dataset_path: str | None = None,
        eval_steps: int = -1,
        resume_from_checkpoint: bool = False,
        save_hf: bool = True,
        monitor: "VerlMonitor | None" = None,
    ) -> "PPOConfig":
        """The ``PPOConfig`` :meth:`fit` trains with these arguments (see :meth:`fit`)."""
        from verl.api.stream import build_config

        _check_logging_steps(logging_steps)
        if self.actor_model is None:
            raise ValueError(
                "RLTrainer.build_config: actor_model is a model object, written to output_dir/model_init/ by fit(); "
                "call fit(), or give actor_model= a checkpoint directory"
            )
        out = os.fspath(output_dir)
        _check_output_dir(out, "build_config")
        if resume_from_checkpoint and self._resume_path is not None:
            resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={self._resume_path}"]
        else:
            resume = [f"trainer.resume_mode={'auto' if resume_from_checkpoint else 'disable'}"]
        if max_steps is None:  # one pass over the data, as a tutorial's fit(dataset_path=...) means
            length = ["trainer.total_training_steps=null", "trainer.total_epochs=1"]
        else:  # max_steps ends the run, not the epochs
            length = [f"trainer.total_training_steps={max_steps}", "trainer.total_epochs=1000000"]
        run = [
            *length,
            f"trainer.save_freq={save_steps}",
            f"trainer.log_freq={logging_steps}",
            f"trainer.default_local_dir={out}",
            f"trainer.log_dir={os.path.join(out, 'logs')}",
            "trainer.logger=[console,jsonl]",
            *resume,
            f"trainer.save_hf={str(save_hf).lower()}",
            f"trainer.test_freq={eval_steps}",
            f"trainer.val_before_train={'true' if val_dataset_path and eval_steps > 0 else 'false'}",
            f"data.val_files={_files_setting(val_dataset_path) if val_dataset_path else 'null'}",
        ]
        if monitor is not None:
            run += [f"{k}={v}" for k, v in monitor.config_overrides().items()]
        if self.reward_model is not None:
            run += ["reward_model.enable=true", f"reward_model.model.path={self.reward_model}"]
        elif self._reward_object is not None:
            raise ValueError(
                "RLTrainer.build_config: reward_model is a model object, written to output_dir/reward_model_init/ by "
                "fit(); call fit(), or give reward_model= a checkpoint directory"
            )
        return build_config(
            model=self.actor_model,
            train_files=dataset_path,
            config=self._config,
            overrides=[*self._settings, *run, *self._overrides],
        )

    def fit(
        self,
        *,
        dataset: Any = None,
        dataset_path: str | Sequence[str] | None = None,
        max_steps: int | None = None,
        save_steps: int | None = None,
        logging_steps: int | None = None,
        output_dir: str | None = None,
        val_dataset_path: Any = None,
        eval_steps: int | None = None,
        resume_from_checkpoint: bool = False,
        save_hf: bool | None = None,
        monitor: "VerlMonitor | None" = None,
    ) -> dict[str, Any]:
        """Train ``max_steps`` steps on the prompts of ``dataset`` (parquet/jsonl/json with
        ``prompt``, ``data_source`` and ``reward_model.ground_truth``, as ``main_ppo`` reads).

        An argument left None takes the value of the run :meth:`from_checkpoint` read, else its
        default: ``save_steps=-1``, ``logging_steps=1``, ``output_dir="outputs/verl"``, ``eval_steps=-1``,
        ``save_hf=True``.

        Args:
            dataset: training prompts: file path(s), or what ``verl.utils.load_hf_dataset`` returned
                (written to ``output_dir/data/train.parquet`` for the trainer, batch by batch).
            dataset_path: the same as ``dataset`` for files (the earlier name).
            max_steps: trainer steps to run (each: ``rollout_batch_size`` prompts); None: one pass over
                the dataset.
            save_steps: checkpoint every this many steps and at the end (-1: no checkpoints).
            logging_steps: send the metrics to the loggers (the console line, ``metrics.jsonl``,
                TensorBoard, a ``monitor``, ...) every this many steps, and at a step that validates,
                the last step and a stop (``trainer.log_freq``); the progress bar moves every step.
            output_dir: checkpoints ``output_dir/global_step_N/`` (``from_checkpoint`` also takes
                ``output_dir/checkpoint-N``), logs ``output_dir/logs/``, the final Hugging Face model
                ``output_dir/huggingface/`` (with ``save_hf``).
            val_dataset_path / eval_steps: validation prompts (files or ``load_hf_dataset``'s result)
                and how often to validate (-1: never).
            resume_from_checkpoint: continue from the newest checkpoint in ``output_dir``.
            save_hf: export the trained actor as a Hugging Face checkpoint at the end.
            monitor: a ``verl.monitor.VerlMonitor``: the run logs to its ``log_dir`` (instead of
                ``output_dir/logs``), rewrites ``report.html`` every ``report_interval`` steps and
                sends it every step's metrics.

        Returns the last step's metrics (the trainer's keys) plus ``reward_mean``
        (``critic/score/mean``), ``reward_delta`` (the change of the training reward over the run:
        the mean ``critic/score/mean`` of the last quarter of the run's logged steps minus that of
        the first quarter, at least one step each, from ``metrics.jsonl``: one step's reward is one
        noisy batch; with validation, ``val_reward_delta`` is the last validation's
        ``val-core/*/reward/mean@*`` minus the first's), ``loss`` (``actor/pg_loss``), ``final_kl`` (``actor/kl_loss``
        with a KL loss, else ``actor/ppo_kl``), ``rollout_tokens_per_second`` (the last step's
        response tokens per second of generation, ``rollout/tokens_per_s``), ``global_step`` and
        ``checkpoint`` (the newest checkpoint directory, or None).
        """
        from verl.api.stream import prepare_start
        from verl.trainer.run_checks import hf_export_dir

        if dataset is not None and dataset_path is not None:
            raise ValueError("RLTrainer.fit: pass dataset= or dataset_path=, not both")
        if logging_steps is not None:
            _check_logging_steps(logging_steps)
        given = dict(
            dataset_path=dataset if dataset is not None else dataset_path,
            max_steps=max_steps,
            save_steps=save_steps,
            logging_steps=logging_steps,
            output_dir=output_dir,
            val_dataset_path=val_dataset_path,
            eval_steps=eval_steps,
            save_hf=save_hf,
        )
        args = {**_FIT_DEFAULTS, **self._fit_defaults, **{k: v for k, v in given.items() if v is not None}}
        if args.get("dataset_path") is None and self.preference_dataset_path is not None:
            args["dataset_path"] = self.preference_dataset_path
        if args.get("dataset_path") is None:
            raise ValueError("RLTrainer.fit needs dataset= (prompt files, or verl.utils.load_hf_dataset(...))")
        _check_output_dir(os.fspath(args["output_dir"]), "fit")
        args["output_dir"] = os.path.abspath(os.fspath(args["output_dir"]))
        self._write_model_objects(args)
        args["dataset_path"] = self._data_files(args["dataset_path"], args["output_dir"], "train")
        if args["val_dataset_path"] is not None:
            args["val_dataset_path"] = self._data_files(args["val_dataset_path"], args["output_dir"], "val")
        cfg = self.build_config(**args, resume_from_checkpoint=resume_from_checkpoint, monitor=monitor)
        self.last_config = cfg
        os.makedirs(args["output_dir"], exist_ok=True)
        with open(os.path.join(args["output_dir"], RUN_FILE), "w", encoding="utf-8") as f:
            json.dump({"init": self._init_args, "fit": args, "hybrid_condition": self.hybrid_condition is not None}, f,
                      indent=2)
        prepare_start(cfg)
        from verl.trainer.entry import trainer_session
        from verl.trainer.ppo_trainer import PPOTrainer

        with trainer_session(cfg, PPOTrainer) as trainer:  # the world started here is torn down at its end
            if monitor is not None:
                monitor.attach(trainer)
            self._use_hybrid_step(trainer)
            metrics: dict[str, Any] = dict(trainer.fit())
            step = trainer.global_step
            self.last_checkpoint = trainer.last_checkpoint
            if self._actor_object is not None:
                self._write_back(hf_export_dir(cfg.trainer))
        metrics.update(_summary(metrics, cfg.trainer.log_dir))
        metrics["global_step"] = step
        metrics["checkpoint"] = self.last_checkpoint
        return metrics

    def _write_model_objects(self, args: dict[str, Any]) -> None:
        """Model objects given to :meth:`__init__` written under ``output_dir`` (the policy's to
        ``model_init/``, trained and loaded back; the reward model's to ``reward_model_init/``)."""
        from verl.trainer.model_objects import model_directory

        if self._actor_object is not None:
            self.actor_model = model_directory(
                self._actor_object,
                what="RLTrainer(actor_model=...)",
                tokenizer=self._tokenizer,
                out_dir=os.path.join(args["output_dir"], "model_init"),
            )
            self._init_args["actor_model"] = self.actor_model
            args["save_hf"] = True  # the export is what goes back into the object
        if self._reward_object is not None:
            self.reward_model = model_directory(
                self._reward_object,
                what="RLTrainer(reward_model=...)",
                head="reward",
                out_dir=os.path.join(args["output_dir"], "reward_model_init"),
            )
            self._init_args["reward_model"] = self.reward_model

    def _write_back(self, export_dir: str) -> None:
        """The trained weights (the run's Hugging Face export) into the ``actor_model`` object."""
        import logging

        from verl.trainer.model_objects import write_back

        if not os.path.isdir(export_dir):  # another node's rank: the export is on the first node's disk
            logging.getLogger(__name__).warning(
                "RLTrainer: the trained weights are in %s on the first node; not loaded into actor_model here",
                export_dir,
            )
            return
        write_back(self._actor_object, export_dir)

    def _use_hybrid_step(self, trainer: Any) -> None:
        """For ``hybrid_ppo`` with a ``hybrid_condition``: the config's hybrid step routing by that
        function (``build_step(cfg, hybrid_condition=...)``) replaces the trainer's pipeline. Otherwise
        the trainer keeps the config's own step (the RL step, or DPO's with ``data.pairs``)."""
        if self.algorithm in HYBRID_ALGORITHMS and self.hybrid_condition is not None:
            from verl.trainer.step import build_step

            trainer.use_pipeline(build_step(trainer.cfg, hybrid_condition=self.hybrid_condition))

    def _data_files(self, data: Any, output_dir: str, split: str) -> str | list[str]:
        """``data`` as the trainer's file setting: paths made absolute, or a ``load_hf_dataset``
        result checked against the algorithm and written to ``output_dir/data/<split>.parquet``."""
        from verl.data.hf_dataset import RecordData
        from verl.trainer.ppo_checks import preference_pairs_problem

        if isinstance(data, RecordData):
            if self.algorithm in PREFERENCE_ALGORITHMS:
                if data.kind != "preferences":
                    raise ValueError(
                        f"algorithm={self.algorithm!r} trains on preference pairs (prompt, chosen, rejected), but "
                        f"the dataset {data.label} holds prompts ({data.columns}); give pairs, or choose a "
                        "reward-based algorithm (grpo, ppo, ...)"
                    )
                return data.write_parquet(os.path.join(output_dir, "data", f"{split}.parquet"))
            problem = preference_pairs_problem(
                f"the dataset {data.label}", data.columns, "data_source", f"algorithm={self.algorithm!r}"
            )
            if problem:
                raise ValueError(problem)
            return data.write_parquet(os.path.join(output_dir, "data", f"{split}.parquet"))
        if isinstance(data, (str, os.PathLike)):
            return os.path.abspath(os.fspath(data))
        if isinstance(data, (list, tuple)) and data and all(isinstance(p, (str, os.PathLike)) for p in data):
            return [os.path.abspath(os.fspath(p)) for p in data]
        raise TypeError(
            f"RLTrainer.fit: a dataset is a file path, a list of them, or verl.utils.load_hf_dataset(...)'s "
            f"result, got {type(data).__name__}"
        )
