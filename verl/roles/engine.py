"""A Megatron-core training engine: the model, optimizer and schedule that SFT and the trained roles share.

``MegatronEngine`` owns, for one role on one rank:

- the model chunks built from a Hugging Face directory on the role's parallel layout
  (TP/PP/SP/DP from the ``ProcessGroupCollection`` it is given) with the HF weights loaded,
  wrapped in Megatron's ``DistributedDataParallel``;
- Megatron's optimizer (``get_megatron_optimizer``: Adam/SGD, fp32 master weights) and
  learning-rate scheduler (``OptimizerParamScheduler``: linear warm-up, then constant,
  linear, cosine or inverse-square-root decay);
- ``train_step``: micro-batched forward/backward through the pipeline schedule
  (``verl.models.forward.forward_backward``), gradient finalisation over DP (and TP for
  sequence-parallel norms), global-norm clipping, one optimizer and scheduler step;
- ``save``/``load`` of model + optimizer (Megatron distributed checkpoints, reshardable)
  and scheduler + RNG states, and ``export_hf`` (a Hugging Face checkpoint for the rollout
  engines).

Loss convention. ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` returns this
micro-batch's *share of the global-batch loss*: per-token losses summed and divided by the
global denominator (tokens or sequences of the whole step on every DP rank), times the DP
size — exactly what ``verl.algos.agg_loss(..., global_batch_info=GlobalBatchInfo.from_masks(...))``
computes. The shares of all micro-batches on all DP ranks then add up to the loss of one
step on the whole batch, and so do the gradients, whatever the micro-batch size or DP size.
(Megatron's schedule divides each micro-batch loss by the number of micro-batches, and its
DDP averages gradients over DP; the engine undoes the first, the ``dp_size`` factor the second.)

Gradient clipping is done here, not by Megatron (its clip asserts CUDA tensors): the global
norm comes from the optimizer's ``get_grad_norm`` (which counts TP-duplicated and shared
parameters once and reduces over the right group), and gradients are scaled in place when
the norm exceeds ``optim.clip_grad``. A step whose gradient norm is not finite is skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl.config.schema import MegatronConfig, ModelConfig, OptimConfig
from verl.models.builder import ModelBuildConfig, build_model_chunks
from verl.models.checkpoint import iter_hf_weights, load_checkpoint, load_hf_weights, save_checkpoint
from verl.models.forward import ForwardResult, LossFn, OutputKind, forward_backward
from verl.models.hf_config import HFModelSpec, parse_hf_config
from verl.models.safetensors_io import SafetensorsWriter, copy_side_files
from verl.models.weight_mapping import HeadKind
from verl.utils.logging import log_rank0, warn_once

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["EngineStepResult", "MegatronEngine", "resolve_dtype", "lr_schedule_steps"]

MODEL_SUBDIR = "model"
OPTIM_SUBDIR = "optim"
EXTRA_SUBDIR = "extra"
ENGINE_META = "engine.json"

# Megatron's names for the decay styles of OptimConfig.lr_decay_style.
_DECAY_STYLES = {
    "constant": "constant",
    "linear": "linear",
    "cosine": "cosine",
    "inverse_square_root": "inverse-square-root",
}


def resolve_dtype(dtype: str) -> str:
    """``megatron.dtype`` -> the builder's dtype name: auto is bf16 on GPU, fp32 on CPU."""
    if dtype == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]


def lr_schedule_steps(optim: OptimConfig, total_training_steps: int) -> tuple[int, int]:
    """(warm-up steps, decay steps) of ``optim`` for a run of ``total_training_steps`` optimizer steps.

    Raises ValueError naming the fields when warm-up does not end before the decay does.
    """
    if total_training_steps < 1:
        raise ValueError(
            f"total_training_steps={total_training_steps}: the learning-rate schedule needs the run length "
            "(>= 1); the trainer fills optim.total_training_steps from the data and epochs"
        )
    warmup = optim.lr_warmup_steps
    if warmup is None:
        warmup = int(optim.lr_warmup_steps_ratio * total_training_steps)
    decay = optim.lr_decay_steps if optim.lr_decay_steps is not None else total_training_steps
    if optim.lr_decay_style == "constant":
        # Megatron's scheduler wants decay > warm-up even when nothing decays.
        decay = max(decay, warmup + 1)
    if warmup >= decay:
        raise ValueError(
            f"optim.lr_warmup_steps resolves to {warmup}, not below the decay length {decay} "
            f"(optim.lr_decay_steps={optim.lr_decay_steps}, total_training_steps={total_training_steps}); "
            "shorten the warm-up or lengthen the decay"
        )
    return warmup, decay


@dataclass(kw_only=True)
class EngineStepResult:
    """What one ``train_step`` reports (identical on every rank of the role)."""

    loss: float
    """Loss of the whole step (sum of every micro-batch's share on every DP rank)."""
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    lr: float
    """Learning rate the step was taken with."""
    update_successful: bool
    """False when the step was skipped (non-finite gradient norm)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Other ``loss_fn`` metrics, averaged over micro-batches and DP ranks."""


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(module, "verl_spec") and hasattr(module, "module"):
        module = module.module
    return module


def _load_spec(model: ModelConfig) -> HFModelSpec:
    if not model.path:
        raise ValueError(
            "model.path is not set; point it at a Hugging Face model directory (config.json + safetensors)"
        )
    path = os.path.expanduser(model.path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"model.path={model.path!r}: no config.json there; give a Hugging Face model directory"
        )
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(model.override_config)
    return parse_hf_config(raw, source=config_path)


class MegatronEngine:
    """Model chunks + optimizer + LR scheduler of one Megatron role on this rank.

    Args:
        model: the Hugging Face model to start from (``path``, ``override_config``, gradient checkpointing).
        megatron: the role's Megatron options (dtype, sequence parallel, distributed optimizer, VPP).
        pg: the role's process groups (TP/PP/DP/CP); every rank of the role builds its engine together.
        optim: optimizer and LR schedule; None builds a frozen, forward-only engine (a reference policy).
        total_training_steps: optimizer steps of the run (sizes the LR schedule); ignored without ``optim``.
        head: ``lm`` (policy), ``value`` (critic) or ``reward``.
        max_sequence_length: longest sequence the model will see; None: the HF config's maximum.
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        megatron: MegatronConfig,
        pg: "ProcessGroupCollection",
        optim: OptimConfig | None = None,
        total_training_steps: int | None = None,
        head: HeadKind = "lm",
        max_sequence_length: int | None = None,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        if megatron.override_transformer_config:
            raise ValueError(
                "megatron.override_transformer_config is not applied by verl's model builder; the "
                "TransformerConfig is derived from the Hugging Face config (got keys "
                f"{sorted(megatron.override_transformer_config)}); "
                "remove them, or use model.override_config for Hugging Face fields"
            )
        self.model_config = model
        self.megatron_config = megatron
        self.optim_config = optim
        self.pg = pg
        self.spec = _load_spec(model)
        self.hf_dir = os.path.expanduser(model.path)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.build_config = ModelBuildConfig(
            dtype=resolve_dtype(megatron.dtype),
            head=head,
            sequence_parallel=megatron.sequence_parallel,
            recompute_activations=model.enable_gradient_checkpointing,
            max_sequence_length=max_sequence_length,
        )
        vpp = megatron.virtual_pipeline_model_parallel_size
        chunks = build_model_chunks(self.spec, self.build_config, pg, vpp_size=vpp)
        if self.device.type == "cuda":
            chunks = [c.to(self.device) for c in chunks]
        load_hf_weights(chunks, self.hf_dir, pg=pg)
        self.transformer_config = chunks[0].config
        self.trainable = optim is not None
        self.optimizer = None
        self.scheduler = None
        self.steps_taken = 0
        if not self.trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.chunks: list[torch.nn.Module] = chunks
            return

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=megatron.use_distributed_optimizer,
        )
        self.chunks = [
            DistributedDataParallel(
                c.config,
                ddp_config,
                c,
                # Megatron's convention: only the first chunk's buffers are bucketed.
                disable_bucketing=i > 0,
                pg_collection=pg,
            )
            for i, c in enumerate(chunks)
        ]
        for chunk in self.chunks:
            # The pipeline schedule calls these; forward_backward passes pg_collection through.
            chunk.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = self._build_optimizer(optim)
        for chunk in self.chunks:
            chunk.config.grad_scale_func = self.optimizer.scale_loss
        self.total_training_steps = int(total_training_steps or 0)
        self.scheduler = self._build_scheduler(optim, self.total_training_steps)
        log_rank0(
            logger,
            logging.INFO,
            "engine ready: %s %s head, %s, tp=%d pp=%d dp=%d, %s lr=%g "
            "(%s, warm-up %d, decay %d of %d steps), clip %g",
            self.spec.model_type,
            head,
            self.build_config.dtype,
            pg.tp.size(),
            pg.pp.size(),
            pg.dp.size(),
            optim.optimizer,
            optim.lr,
            optim.lr_decay_style,
            self.scheduler.lr_warmup_steps,
            self.scheduler.lr_decay_steps,
            self.total_training_steps,
            optim.clip_grad,
        )

    # ------------------------------------------------------------------------------------------
    # construction helpers

    def _build_optimizer(self, optim: OptimConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if len(optim.betas) != 2:
            raise ValueError(f"optim.betas must hold two numbers (beta1, beta2), got {optim.betas}")
        dtype = self.build_config.torch_dtype
        config = OptimizerConfig(
            optimizer=optim.optimizer,
            lr=optim.lr,
            min_lr=optim.lr * optim.min_lr_ratio,
            weight_decay=optim.weight_decay,
            adam_beta1=float(optim.betas[0]),
            adam_beta2=float(optim.betas[1]),
            adam_eps=optim.eps,
            sgd_momentum=0.0,
            # Clipping is done in _optimizer_step (Megatron's asserts CUDA tensors).
            clip_grad=0.0,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=self.megatron_config.use_distributed_optimizer,
        )
        return get_megatron_optimizer(
            config,
            self.chunks,
            use_gloo_process_groups=False,
            pg_collection=self.pg,
        )

    def _build_scheduler(self, optim: OptimConfig, total_training_steps: int):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        warmup, decay = lr_schedule_steps(optim, total_training_steps)
        scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if warmup > 0 else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.lr * optim.min_lr_ratio,
            lr_warmup_steps=warmup,
            lr_decay_steps=decay,
            lr_decay_style=_DECAY_STYLES[optim.lr_decay_style],
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=decay,
            wd_incr_style="constant",
            # A resumed run continues the saved schedule.
            use_checkpoint_opt_param_scheduler=True,
        )
        # Megatron's schedule gives position 0 the initial lr (0 with warm-up); starting at 1
        # makes the k-th update use position k, so no update is spent at lr 0 and the last one
        # (k = decay steps) reaches min_lr.
        scheduler.step(1)
        return scheduler

    # ------------------------------------------------------------------------------------------
    # properties

    @property
    def dp_size(self) -> int:
        """Data-parallel degree of this role."""
        return self.pg.dp.size()

    @property
    def dp_rank(self) -> int:
        """This rank's index in the role's data-parallel group."""
        return self.pg.dp.rank()

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (where outputs and losses live)."""
        return self.pg.pp.rank() == self.pg.pp.size() - 1

    def current_lr(self) -> float:
        """The learning rate the next step will use."""
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise ValueError(
                f"MegatronEngine.{what}: this engine was built without an optimizer (optim=None)"
            )

    # ------------------------------------------------------------------------------------------
    # compute

    def _to_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
        }

    @torch.no_grad()
    def forward(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        micro_batch_size: int,
        output: OutputKind = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> ForwardResult:
        """Forward only: per-token outputs ([B, T]) of ``batch`` on every pipeline stage."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            return forward_backward(
                self.chunks,
                self._to_device(batch),
                pg=self.pg,
                micro_batch_size=micro_batch_size,
                output=output,
                temperature=temperature,
                with_entropy=with_entropy,
                broadcast=True,
            )
        finally:
            for chunk in self.chunks:
                chunk.train(self.trainable)

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        micro_batch_size: int,
        loss_fn: LossFn,
        output: OutputKind = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> EngineStepResult:
        """One optimizer step on this rank's share of the batch.

        ``batch`` holds ``input_ids`` and ``attention_mask`` [B, T] plus whatever ``loss_fn`` reads.

        ``loss_fn`` returns each micro-batch's share of the global loss (module docstring);
        every metric it returns must be a scalar and present for every micro-batch.
        """
        self._require_trainable("train_step")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        rows = batch["input_ids"].shape[0]
        num_micro = -(-rows // micro_batch_size)

        def scaled(outputs: dict[str, torch.Tensor], micro_batch: Mapping[str, torch.Tensor]):
            loss, metrics = loss_fn(outputs, micro_batch)
            record = {
                k: (v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v)))
                for k, v in metrics.items()
            }
            record["__loss__"] = loss.detach().float()
            # Megatron divides by the number of micro-batches; the share is already global.
            return loss * num_micro, record

        result = forward_backward(
            self.chunks,
            self._to_device(batch),
            pg=self.pg,
            micro_batch_size=micro_batch_size,
            output=output,
            loss_fn=scaled,
            temperature=temperature,
            with_entropy=with_entropy,
            broadcast=False,
        )
        lr = self.current_lr()
        grad_norm, ok = self._optimizer_step()
        if ok:
            self.scheduler.step(1)
            self.steps_taken += 1
        loss, metrics = self._reduce_metrics(result.metrics)
        return EngineStepResult(loss=loss, grad_norm=grad_norm, lr=lr, update_successful=ok, metrics=metrics)

    def _optimizer_params(self) -> list[torch.nn.Parameter]:
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [p for opt in optimizers for p in opt.get_parameters()]

    @torch.no_grad()
    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip by the global norm and step; returns (norm before clipping, whether the step was taken)."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            warn_once(logger, "non-finite gradient norm (%s): optimizer step skipped", grad_norm)
            self.optimizer.zero_grad()
            return grad_norm, False
        clip = self.optim_config.clip_grad
        if clip > 0:
            coeff = clip / (grad_norm + 1e-6)
            if coeff < 1.0:
                for p in self._optimizer_params():
                    if p.grad is not None:
                        p.grad.mul_(coeff)
        ok = bool(self.optimizer.step_with_ready_grads())
        return grad_norm, ok

    def _reduce_metrics(self, per_micro: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, float]]:
        """Loss summed, other metrics averaged, over micro-batches and DP; handed to every stage."""
        keys: list[str] = []
        if self.is_last_stage:
            keys = sorted(k for k in per_micro[0] if k != "__loss__")
        if self.pg.pp.size() > 1:
            holder = [keys]
            src = dist.get_global_rank(self.pg.pp, self.pg.pp.size() - 1)
            dist.broadcast_object_list(
                holder, src=src, group=self.pg.pp, device=self.device if self.device.type == "cuda" else None
            )
            keys = holder[0]
        values = torch.zeros(1 + len(keys), dtype=torch.float64, device=self.device)
        if self.is_last_stage:
            values[0] = sum(float(m["__loss__"]) for m in per_micro)
            for i, k in enumerate(keys):
                missing = [j for j, m in enumerate(per_micro) if k not in m]
                if missing:
                    raise ValueError(
                        f"loss_fn returned metric {k!r} for some micro-batches but not for {missing}"
                    )
                values[1 + i] = sum(float(m[k]) for m in per_micro) / len(per_micro)
        dp = self.dp_size
        if dp > 1:
            dist.all_reduce(values, group=self.pg.dp)
            values /= dp  # the loss shares carry a dp_size factor; the metric means are averaged
        if self.pg.pp.size() > 1:
            dist.broadcast(
                values, src=dist.get_global_rank(self.pg.pp, self.pg.pp.size() - 1), group=self.pg.pp
            )
        out = values.tolist()
        return out[0], dict(zip(keys, out[1:], strict=True))

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def _model_sharded_state_dict(self) -> dict:
        inners = [_inner(c) for c in self.chunks]
        if len(inners) == 1:
            return {"model": inners[0].sharded_state_dict()}
        return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(inners)}

    def _rng_state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "tracker": get_cuda_rng_tracker().get_states(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        get_cuda_rng_tracker().set_states(state["tracker"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def save(self, ckpt_dir: str) -> None:
        """Write model, optimizer, scheduler and RNG states under ``ckpt_dir`` (collective over the world).

        Layout: ``model/`` (``verl.models.save_checkpoint``: distributed checkpoint + ``hf/``
        config and tokenizer), ``optim/`` (distributed checkpoint of the optimizer state),
        ``extra/rank_<5-digit rank>.pt`` (this rank's RNG states and the scheduler), ``engine.json``.
        """
        from megatron.core import dist_checkpointing

        save_checkpoint(self.chunks, os.path.join(ckpt_dir, MODEL_SUBDIR), pg=self.pg, hf_dir=self.hf_dir)
        if self.trainable:
            optim_dir = os.path.join(ckpt_dir, OPTIM_SUBDIR)
            os.makedirs(optim_dir, exist_ok=True)
            sharded = self.optimizer.sharded_state_dict(self._model_sharded_state_dict())
            dist_checkpointing.save(sharded, optim_dir)
        extra_dir = os.path.join(ckpt_dir, EXTRA_SUBDIR)
        os.makedirs(extra_dir, exist_ok=True)
        rank = dist.get_rank()
        extra = {
            "rng": self._rng_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "steps_taken": self.steps_taken,
        }
        torch.save(extra, os.path.join(extra_dir, f"rank_{rank:05d}.pt"))
        if rank == 0:
            meta = {
                "world_size": dist.get_world_size(),
                "tp": self.pg.tp.size(),
                "pp": self.pg.pp.size(),
                "dp": self.pg.dp.size(),
                "trainable": self.trainable,
                "steps_taken": self.steps_taken,
            }
            with open(os.path.join(ckpt_dir, ENGINE_META), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
        dist.barrier()

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote (collective). The model and optimizer reshard to this layout;
        RNG states are restored only when the world size matches (else a warning)."""
        from megatron.core import dist_checkpointing

        meta_path = os.path.join(ckpt_dir, ENGINE_META)
        if not os.path.isfile(meta_path):
            raise ValueError(
                f"{ckpt_dir}: {ENGINE_META} is missing; not a checkpoint written by MegatronEngine.save"
            )
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        load_checkpoint(self.chunks, os.path.join(ckpt_dir, MODEL_SUBDIR), pg=self.pg)
        if self.trainable and load_optimizer:
            optim_dir = os.path.join(ckpt_dir, OPTIM_SUBDIR)
            if not os.path.isfile(os.path.join(optim_dir, "metadata.json")):
                raise ValueError(
                    f"{ckpt_dir}: {OPTIM_SUBDIR}/ holds no optimizer checkpoint; it was saved by a frozen "
                    "engine "
                    "or is incomplete — load with load_optimizer=False to take the weights only"
                )
            sharded = self.optimizer.sharded_state_dict(self._model_sharded_state_dict(), is_loading=True)
            state = dist_checkpointing.load(sharded, optim_dir)
            self.optimizer.load_state_dict(state)
        rank = dist.get_rank()
        extra_path = os.path.join(ckpt_dir, EXTRA_SUBDIR, f"rank_{rank:05d}.pt")
        if not os.path.isfile(extra_path):
            extra_path = os.path.join(ckpt_dir, EXTRA_SUBDIR, "rank_00000.pt")
        if not os.path.isfile(extra_path):
            raise ValueError(
                f"{ckpt_dir}: {EXTRA_SUBDIR}/rank_00000.pt is missing (scheduler and RNG states)"
            )
        extra = torch.load(extra_path, weights_only=False)
        if self.trainable and load_optimizer and extra["scheduler"] is not None:
            self.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved count to the current one
            self.scheduler.load_state_dict(extra["scheduler"])
            self.steps_taken = int(extra["steps_taken"])
        if meta["world_size"] == dist.get_world_size():
            self._set_rng_state(extra["rng"])
        else:
            warn_once(
                logger,
                "%s was written by %d ranks, this run has %d: RNG states not restored "
                "(weights and optimizer are)",
                ckpt_dir,
                meta["world_size"],
                dist.get_world_size(),
            )

    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face checkpoint (config, tokenizer, safetensors) of the weights (collective).

        Each pipeline stage's first DP/TP rank writes its stage's tensors; global rank 0 then
        renumbers the files and writes the index, so no rank ever holds the whole model.
        """
        world_rank = dist.get_rank()
        pp_rank, pp_size = self.pg.pp.rank(), self.pg.pp.size()
        writer_rank = self.pg.tp.rank() == 0 and self.pg.dp.rank() == 0 and self.pg.cp.rank() == 0
        stage_dir = os.path.join(out_dir, f".stage{pp_rank:03d}")
        if world_rank == 0:
            if os.path.isdir(out_dir):
                shutil.rmtree(out_dir)
            os.makedirs(out_dir)
        dist.barrier()
        if self.pg.dp.rank() == 0 and self.pg.cp.rank() == 0:
            if writer_rank:
                os.makedirs(stage_dir, exist_ok=True)
                writer = SafetensorsWriter(stage_dir)
            for name, tensor in iter_hf_weights(self.chunks, pg=self.pg):  # every TP rank takes part
                if writer_rank:
                    writer.add(name, tensor)
            if writer_rank:
                files = writer.finish()
                with open(os.path.join(stage_dir, "files.json"), "w", encoding="utf-8") as f:
                    json.dump(files, f)
        dist.barrier()
        if world_rank == 0:
            _merge_stage_dirs(out_dir, pp_size)
            copy_side_files(self.hf_dir, out_dir, include_config=False)
            config = dict(self.spec.raw)
            config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[
                self.build_config.dtype
            ]
            with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        dist.barrier()
        log_rank0(logger, logging.INFO, "exported Hugging Face checkpoint to %s", out_dir)


_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1}


def _merge_stage_dirs(out_dir: str, pp_size: int) -> None:
    """Move each stage's safetensors files into ``out_dir`` with global names and write the index."""
    from safetensors import safe_open

    stage_files: list[tuple[str, str]] = []
    for stage in range(pp_size):
        stage_dir = os.path.join(out_dir, f".stage{stage:03d}")
        with open(os.path.join(stage_dir, "files.json"), encoding="utf-8") as f:
            stage_files += [(stage_dir, name) for name in json.load(f)]
    total = len(stage_files)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, (stage_dir, name) in enumerate(stage_files):
        final = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(os.path.join(stage_dir, name), os.path.join(out_dir, final))
        with safe_open(os.path.join(out_dir, final), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = final
                sl = f.get_slice(key)
                total_bytes += math.prod(sl.get_shape()) * _SAFETENSORS_DTYPE_BYTES[sl.get_dtype()]
    for stage in range(pp_size):
        shutil.rmtree(os.path.join(out_dir, f".stage{stage:03d}"))
    if total > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
