"""``MegatronEngine``: the model, optimizer and schedule of one Megatron role on one rank.

It owns, for SFT and every trained role (actor, critic, reference, reward model), composed from
the modules of ``verl.engine``:

- the model chunks built from a Hugging Face directory on the role's parallel layout
  (TP/PP/SP/DP from the ``ProcessGroupCollection`` it is given), wrapped in Megatron's DDP
  when it trains, and its optimizer and LR schedule (:mod:`verl.engine.build`);
- ``forward`` and ``train_step``: micro-batched forward/backward through the pipeline schedule
  (``verl.models.forward.forward_backward``; its module docstring states the loss contract,
  ``LossShare``), gradient finalisation over DP (and TP for sequence-parallel norms), clipping,
  one optimizer and scheduler step (:mod:`verl.engine.step`);
- ``save``/``load`` (:mod:`verl.engine.state`) and ``export_hf`` (:mod:`verl.engine.export`).

A Qwen2.5-VL directory builds ``verl.models.megatron_vlm.MegatronVLM`` as the one chunk (TP, sequence
parallel, PP with the vision tower on the first stage, DP, packed sequences; virtual stages, CP, LoRA
refused before the build by ``verl.engine.build.check_vlm_engine``): the batch's image columns reach
each micro-batch's forward, the vision tower is in the checkpoint, the export and
:meth:`MegatronEngine.hf_weights` (the push into a transformers rollout engine; every stage's tensors
on every rank).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl.config.schema import MegatronConfig, ModelConfig, OptimConfig
from verl.engine.build import (
    build_optimizer,
    build_scheduler,
    build_trainable_chunks,
    build_vlm_chunk,
    check_remove_padding,
    check_vlm_engine,
    load_model_spec,
    lora_spec,
    resolve_dtype,
)
from verl.engine.contract import EngineCapabilities, EngineStepResult
from verl.engine.export import export_hf_checkpoint
from verl.engine.state import EngineState, load_engine_state, save_engine_state
from verl.engine.step import optimizer_step, reduce_step_metrics
from verl.models.builder import ModelBuildConfig
from verl.models.forward import ForwardResult, LossShareFn, OutputKind, forward_backward
from verl.models.micro_batches import MicroBatchSplit, fixed_split
from verl.models.weight_mapping import HeadKind
from verl.utils.logging import log_rank0

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.models.router_replay import RoutingMode
    from verl.models.vocab_parallel import SamplingTruncation

logger = logging.getLogger(__name__)

__all__ = ["EngineStepResult", "MegatronEngine"]


TRANSFORMER_CONFIG_OVERRIDES = (
    "moe_aux_loss_coeff", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "pipeline_model_parallel_layout", "moe_enable_routing_replay",
)
"""The Megatron ``TransformerConfig`` fields ``megatron.override_transformer_config`` may set (the
reference verl's key names); each is a :class:`~verl.models.builder.ModelBuildConfig` field."""


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
        freeze_vision_tower: a vision-language model's vision encoder takes no gradient and no optimizer
            state (the reference's key); refused for a text model.
    """

    capabilities = EngineCapabilities(megatron_layout=True, hf_checkpoint=True, packed_sequences=True, head_columns=True)

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
        freeze_vision_tower: bool = False,
    ) -> None:
        overrides = dict(megatron.override_transformer_config)
        unknown = sorted(set(overrides) - set(TRANSFORMER_CONFIG_OVERRIDES))
        if unknown:
            raise ValueError(
                f"megatron.override_transformer_config keys {unknown} are not applied by verl's model builder; the "
                "TransformerConfig is derived from the Hugging Face config, and only "
                f"{', '.join(TRANSFORMER_CONFIG_OVERRIDES)} may be set here; "
                "remove them, or use model.override_config for Hugging Face fields"
            )
        if megatron.router_replay.mode != "disabled":  # the routers record and replay (verl.models.router_replay)
            overrides["moe_enable_routing_replay"] = True
        self.model_config = model
        self.megatron_config = megatron
        self.optim_config = optim
        self.pg = pg
        self.spec = load_model_spec(model)
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
            **overrides,
        )
        self.trainable = optim is not None
        from verl.models.megatron_vlm import is_vlm_config

        self.is_vlm = is_vlm_config(self.hf_dir)
        """A vision-language model (``verl.models.megatron_vlm``): its one chunk holds the vision tower."""
        if freeze_vision_tower and not self.is_vlm:
            raise ValueError(
                f"freeze_vision_tower=true, but {model.path} is not a vision-language model (no vision_config); "
                "set it to false"
            )
        if self.is_vlm:
            check_vlm_engine(model, megatron, self.build_config, pg)
        self.lora = lora_spec(model, megatron)
        self._lora_base: dict | None = None
        if self.is_vlm:
            self.chunks: list[torch.nn.Module] = build_vlm_chunk(
                self.build_config,
                self.hf_dir,
                pg,
                device=self.device,
                megatron=megatron,
                trainable=self.trainable,
                freeze_vision_tower=freeze_vision_tower,
            )
        else:
            self.chunks = build_trainable_chunks(
                self.spec,
                self.build_config,
                self.hf_dir,
                pg,
                device=self.device,
                vpp_size=megatron.virtual_pipeline_model_parallel_size,
                megatron=megatron,
                trainable=self.trainable,
                lora=self.lora,
            )
        self.transformer_config = self.chunks[0].config
        first_rank = pg.dp.rank() == 0 and pg.tp.rank() == 0 and pg.pp.rank() == 0
        check_remove_padding(
            model.use_remove_padding,
            self.transformer_config.transformer_impl,
            cp_size=pg.cp.size(),
            log=first_rank,
        )
        self.pack_sequences = model.use_remove_padding
        self.optimizer = None
        self.scheduler = None
        self.steps_taken = 0
        self.total_training_steps = 0
        if not self.trainable:
            return
        self.optimizer = build_optimizer(
            optim,
            self.chunks,
            pg,
            dtype=self.build_config.torch_dtype,
            use_distributed_optimizer=megatron.use_distributed_optimizer,
        )
        self.total_training_steps = int(total_training_steps or 0)
        self.scheduler = build_scheduler(self.optimizer, optim, self.total_training_steps)
        log_rank0(
            logger,
            logging.INFO,
            "engine ready: %s %s head, %s, tp=%d pp=%d dp=%d, %s lr=%g "
            "(%s, warm-up %d, decay %d of %d steps), %s",
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
            # Megatron's optimizer config says clip_grad=0.0: verl clips (engine.step), not Megatron.
            f"grad-norm clip {optim.clip_grad:g} (by verl)" if optim.clip_grad > 0 else "no grad-norm clip",
        )

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
        micro_batch_size: int | None = None,
        split: MicroBatchSplit | None = None,
        output: OutputKind = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
        head_columns: int | None = None,
        topk: int | None = None,
        score_ids: str | None = None,
        routing: "RoutingMode | None" = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> ForwardResult:
        """Forward only: per-token outputs ([B, T]) of ``batch`` on every pipeline stage, in micro-batches
        of ``micro_batch_size`` rows or as ``split`` cuts them (one of the two); ``head_columns``, ``topk``,
        ``score_ids``, ``routing``: as ``verl.models.forward.forward_backward`` (log-probabilities of the
        last columns only; the top-k tokens; the log-probabilities of given ids; recording the experts
        each token goes to, as ``routed_experts``, or replaying the batch's)."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            return forward_backward(
                self.chunks,
                self._to_device(batch),
                pg=self.pg,
                micro_batch_size=micro_batch_size,
                split=split,
                output=output,
                temperature=temperature,
                with_entropy=with_entropy,
                broadcast=True,
                head_columns=head_columns,
                pack_sequences=self.pack_sequences,
                topk=topk,
                score_ids=score_ids,
                routing=routing,
                truncation=truncation,
            )
        finally:
            for chunk in self.chunks:
                chunk.train(self.trainable)

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        *,
        micro_batch_size: int | None = None,
        split: MicroBatchSplit | None = None,
        loss_fn: LossShareFn,
        output: OutputKind = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
        head_columns: int | None = None,
        topk: int | None = None,
        score_ids: str | None = None,
        routing: "RoutingMode | None" = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> EngineStepResult:
        """One optimizer step on this rank's share of the batch (``head_columns``, ``topk``, ``score_ids``,
        ``routing``: as :meth:`forward`; ``routing='replay'`` routes by the batch's ``routed_experts``).

        ``batch`` holds ``input_ids`` and ``attention_mask`` [B, T] plus whatever ``loss_fn`` reads.
        ``loss_fn`` returns each micro-batch's ``LossShare`` of the global loss (the contract of
        ``verl.models.forward``); every metric it returns must be a scalar and present for every
        micro-batch. Micro-batches are ``micro_batch_size`` rows or as ``split`` cuts them (one of the two;
        ``verl.models.micro_batches``).
        """
        self._require_trainable("train_step")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        result = forward_backward(
            self.chunks,
            self._to_device(batch),
            pg=self.pg,
            micro_batch_size=micro_batch_size,
            split=split,
            output=output,
            loss_fn=loss_fn,
            temperature=temperature,
            with_entropy=with_entropy,
            broadcast=False,
            head_columns=head_columns,
            pack_sequences=self.pack_sequences,
            topk=topk,
            score_ids=score_ids,
            routing=routing,
            truncation=truncation,
        )
        lr = self.current_lr()
        grad_norm, ok = optimizer_step(self.optimizer, self.optim_config.clip_grad)
        if ok:
            self.scheduler.step(1)
            self.steps_taken += 1
        loss, metrics = reduce_step_metrics(result.losses, result.metrics, self.pg, self.device)
        if split is None:
            split = fixed_split(batch["input_ids"].shape[0], micro_batch_size)
        return EngineStepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            update_successful=ok,
            metrics=metrics,
            micro_batches=split.count,
            token_fill=split.fill,
        )

    # ------------------------------------------------------------------------------------------
    # checkpoints and export

    def _state(self) -> EngineState:
        return EngineState(
            chunks=self.chunks,
            pg=self.pg,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            steps_taken=self.steps_taken,
            lora=self.lora,
            lora_base=self.lora_base,
        )

    def lora_base(self) -> dict:
        """The base model's fingerprint (path, content checksum) that adapter checkpoints record;
        hashed once per engine (``verl.models.lora_io.base_fingerprint``)."""
        if self._lora_base is None:
            from verl.models.lora_io import base_fingerprint

            self._lora_base = base_fingerprint(self.hf_dir, self.model_config.override_config)
        return self._lora_base

    def save(self, ckpt_dir: str) -> None:
        """Write model, optimizer, scheduler and RNG states under ``ckpt_dir`` (collective over the world;
        layout in :mod:`verl.engine.state`)."""
        save_engine_state(self._state(), ckpt_dir, hf_dir=self.hf_dir)

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote (collective). The model and optimizer reshard to this layout;
        RNG states are restored only when the world size matches (else a warning)."""
        state = self._state()
        load_engine_state(state, ckpt_dir, load_optimizer=load_optimizer)
        self.steps_taken = state.steps_taken

    def export_peft(self, out_dir: str) -> list[str]:
        """Write the LoRA adapters in PEFT's format (``adapter_config.json`` +
        ``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained`` onto the
        base); collective over the role, written by its first rank; returns the paths there."""
        from verl.models.lora_io import gather_peft_state, write_peft

        if self.lora is None:
            raise ValueError("MegatronEngine.export_peft: this engine has no LoRA adapters (model.lora_rank=0)")
        state = gather_peft_state(self.chunks, self.pg)
        first = self.pg.tp.rank() == 0 and self.pg.pp.rank() == 0 and self.pg.dp.rank() == 0
        return write_peft(out_dir, state, self.lora, base_path=self.hf_dir) if first else []

    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face checkpoint (config, tokenizer, safetensors) of the weights (collective);
        with LoRA adapters, of the merged weights ``W + scaling B A``. A vision-language model's holds
        the vision tower (``visual.*``), its own config and image processor: transformers loads it."""
        if self.is_vlm:
            from verl.models.builder import unwrap_model
            from verl.models.convert_vlm import IMAGE_PROCESSOR_FILES
            from verl.models.megatron_vlm import VISION_PREFIX
            from verl.utils.paths import load_json_object

            vlm = unwrap_model(self.chunks[0])
            export_hf_checkpoint(
                [vlm.language_model], self.pg, spec=self.spec, dtype=self.build_config.dtype, hf_dir=self.hf_dir,
                out_dir=out_dir, config=load_json_object(os.path.join(self.hf_dir, "config.json")),
                extra=lambda: ((VISION_PREFIX + n, p.detach()) for n, p in vlm.vision.named_parameters()),
                more_side_files=IMAGE_PROCESSOR_FILES,
            )
            return
        export_hf_checkpoint(
            self.chunks, self.pg, spec=self.spec, dtype=self.build_config.dtype, hf_dir=self.hf_dir, out_dir=out_dir
        )

    def hf_weights(self):
        """(Hugging Face name, whole tensor) pairs of the weights in the hub's layout, gathered over TP one
        tensor at a time (collective over the role's TP group: every TP rank iterates to the end); a
        vision-language model's vision tower (``visual.*``) after its decoder. One pipeline stage, or a
        vision-language model's stages: each stage's tensors in stage order, broadcast over the PP group
        one at a time (collective over the role: every rank gets every tensor, the tower from the first
        stage)."""
        from verl.models.checkpoint import iter_hf_weights

        if self.pg.pp.size() > 1:
            if not self.is_vlm:
                raise ValueError("MegatronEngine.hf_weights: one pipeline stage only (each stage holds its own layers)")
            yield from self._stages_hf_weights()
            return
        if not self.is_vlm:
            yield from iter_hf_weights(self.chunks, pg=self.pg)
            return
        yield from self._stage_hf_weights()

    def _stage_hf_weights(self):
        """This pipeline stage's pairs of a vision-language model (gathered over TP): its decoder layers,
        then the vision tower on the first stage."""
        from verl.models.builder import unwrap_model
        from verl.models.checkpoint import iter_hf_weights
        from verl.models.megatron_vlm import VISION_PREFIX

        vlm = unwrap_model(self.chunks[0])
        yield from iter_hf_weights([vlm.language_model], pg=self.pg)
        if vlm.vision is not None:
            for name, param in vlm.vision.named_parameters():
                yield VISION_PREFIX + name, param.detach()

    def _stages_hf_weights(self):
        """Every stage's pairs on every rank: stage by stage, the holder broadcasts each tensor's name,
        shape and dtype, then the tensor, over the PP group; an empty name ends the stage."""
        group = self.pg.pp
        mine = group.rank()
        for stage in range(group.size()):
            src = dist.get_global_rank(group, stage)
            local = self._stage_hf_weights() if stage == mine else None
            while True:
                if local is not None:
                    pair = next(local, None)
                    header = [None] if pair is None else [(pair[0], tuple(pair[1].shape), pair[1].dtype)]
                else:
                    header = [None]
                dist.broadcast_object_list(header, src=src, group=group, device=self.device)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                tensor = pair[1].to(self.device).contiguous() if local is not None else torch.empty(
                    shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=src, group=group)
                yield name, tensor
