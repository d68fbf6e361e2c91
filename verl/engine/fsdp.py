"""``FSDPEngine``: the plain PyTorch engine sharded with torch's FSDP2 over a role's data-parallel ranks.

``actor_rollout_ref.actor.strategy=fsdp2`` (the reference verl's name; ``fsdp_config`` its keys)
trains any Hugging Face causal LM -- a family Megatron-core does not build (Gemma, Phi, OLMo, ...)
as well as one it does -- or a plain ``nn.Module`` given to the Python API, sharded so that a model
larger than one device fits: each rank holds ``1 / dp`` of the parameters, gradients and optimizer
state, and every layer's parameters are all-gathered just before it runs.

The engine is :class:`~verl.engine.torch_engine.TorchEngine` (the same calls, loss contract,
micro-batches, clipping rule and metrics; the module contract of its docstring) with the module
parallelised by :func:`apply_fsdp2`, in this order, each step logged:

1. activation checkpointing of each decoder layer (``model.enable_gradient_checkpointing``);
2. ``fully_shard`` of each decoder layer (``fsdp_config.wrap_policy``: the classes in the model's
   ``_no_split_modules``, else the blocks of its longest ``nn.ModuleList``), then of the root
   (embeddings, final norm, head: tied weights stay in one unit);

over a one-dimensional ``DeviceMesh`` of the role's DP group (or HSDP's two, replicate x shard, with
``fsdp_config.fsdp_size`` below the DP size), with ``MixedPrecisionPolicy``
(``fsdp_config.mixed_precision``: parameters all-gathered and computed in ``param_dtype``,
gradients reduce-scattered in ``reduce_dtype``, the shards and the optimizer in ``model_dtype``),
``reshard_after_forward`` and FSDP2's ``CPUOffloadPolicy`` (``offload_policy``, GPU only). The
optimizer is built over the DTensor shards; the gradient norm is the global norm over all
shards (a replicated DTensor), and clipping scales every shard by the same factor.
``param_offload`` / ``optimizer_offload`` (the reference's keys; GPU only) keep the shards, and the
optimizer state, in host memory between calls: on the device only inside a forward, an update or a
checkpoint (the optimizer state only for the optimizer step).

Gradients are averaged over the DP ranks (FSDP2's reduce-scatter divides by the group size, as
DDP's all-reduce does), so a rank's ``LossShare`` is the same share of the global loss as under
the unsharded engine.

Ulysses sequence parallelism (``fsdp_config.ulysses_sequence_parallel_size`` above 1,
:mod:`verl.models.ulysses`): the DP ranks form groups of that many consecutive ranks; each micro-batch
of each member of a group runs over the whole group (one turn per member, its rows packed and split
into equal pieces of tokens, attention heads split by all-to-all), the member keeps its rows' outputs
and its own loss. FSDP2 still shards over every DP rank, and its gradient average stays right: a
rank's gradients are its tokens' share of every member's loss, which sum over the group to each
member's whole gradient.

Every forward all-gathers over the DP group, so every rank of the role must run the same number
of micro-batches in each call -- ``verl.roles.dispatch`` and ``verl.models.micro_batches`` give
every rank the same count.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) folders: each rank writes its own shards of
the model and optimizer, and a load reads whatever slices its own layout needs, so a run saved
on 2 ranks resumes on 1 or 4 (:meth:`FSDPEngine.save`). The Hugging Face export gathers the full
state dict once on the first rank.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl.config.schema import FSDPConfig, ModelConfig, OptimConfig
from verl.engine.contract import EngineCapabilities
from verl.engine.torch_engine import (
    MODULE_FILE,
    TorchEngine,
    restore_rng_states,
    save_rng_states,
)
from verl.utils.logging import log_rank0, warn_once

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = [
    "DCP_DIR", "FSDPEngine", "apply_fsdp2", "decoder_layers", "load_hf_causal_lm", "load_hf_value_model",
    "resolve_fsdp_dtypes", "tied_names",
]

DCP_DIR = "dcp"
"""Inside a checkpoint directory: the torch.distributed.checkpoint folder (model and optimizer shards)."""

STATE_FILE = "fsdp_engine.pt"
"""Beside it: the LR schedule, the step count and what saved it (written by the first DP rank)."""

_MESH_IDS = itertools.count()

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_fsdp_dtypes(cfg: FSDPConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(model_dtype, param_dtype, reduce_dtype) of ``cfg``: ``auto`` compute is bfloat16 on GPU and
    float32 on CPU; ``auto`` model and reduce dtypes follow the compute dtype."""
    param = cfg.mixed_precision.param_dtype
    param_dtype = _DTYPES[param] if param != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model_dtype = param_dtype if cfg.model_dtype == "auto" else _DTYPES[cfg.model_dtype]
    reduce = cfg.mixed_precision.reduce_dtype
    reduce_dtype = param_dtype if reduce == "auto" else _DTYPES[reduce]
    return model_dtype, param_dtype, reduce_dtype


def _hf_config(model: ModelConfig, key: str) -> tuple[str, Any]:
    """The model directory of ``model.path`` and its Hugging Face config with ``override_config`` applied;
    ValueError naming ``key`` when it holds no config.json."""
    from transformers import AutoConfig

    path = os.path.abspath(os.path.expanduser(model.path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{key}={model.path}: no config.json there; strategy=fsdp2 loads a Hugging Face model directory "
            "(config.json and weights)"
        )
    config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    for name, value in model.override_config.items():
        setattr(config, name, value)
    return path, config


def load_hf_causal_lm(model: ModelConfig, *, dtype: torch.dtype) -> torch.nn.Module:
    """The Hugging Face causal LM at ``model.path`` in ``dtype`` on the host (``override_config``
    applied; ``trust_remote_code`` as configured); a vision-language model (a config with a
    ``vision_config``) whole, as ``AutoModelForImageTextToText`` loads it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path, config = _hf_config(model, "actor_rollout_ref.model.path")
    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=model.trust_remote_code
        )
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, trust_remote_code=model.trust_remote_code
    )


def load_hf_value_model(model: Any, *, dtype: torch.dtype, key: str = "critic.model.path") -> torch.nn.Module:
    """A critic's or reward model's model: the Hugging Face ``*ForSequenceClassification`` with one label
    on the checkpoint at ``model.path`` (a causal LM's, a value or reward model's), in ``dtype`` on the
    host; ``key`` names the path's setting in errors.

    Its ``score`` [1, hidden] (no bias) is the Megatron critic's scalar head under the same
    name (``verl.models.weight_mapping``): read from the checkpoint when it holds ``score.weight``,
    else initialised as the Megatron critic initialises it (``verl.models.heads.scalar_head_init``),
    so both engines start from the same values. The engine reads the head per token (the value
    of every state), not the class's last-token pooling.

    A vision-language model (a config with a ``vision_config``; transformers has no
    ``*ForSequenceClassification`` for the Qwen-VL families) is loaded whole as
    ``AutoModelForImageTextToText`` loads it and wrapped in :class:`verl.models.vlm.VLMValueModel`:
    its decoder, vision encoder included, with the same ``score`` head (read or initialised as above)."""
    from transformers import AutoModelForImageTextToText, AutoModelForSequenceClassification

    from verl.models.heads import scalar_head_init

    path, config = _hf_config(model, key)
    if getattr(config, "vision_config", None) is not None:
        from verl.models.vlm import VLMValueModel, saved_score

        vlm = AutoModelForImageTextToText.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=model.trust_remote_code
        )
        return VLMValueModel(vlm, score=saved_score(path)).to(dtype)
    config.num_labels = 1
    if config.pad_token_id is None:
        # The class's last-token pooling (unused here) refuses batches without a pad id.
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    loaded, info = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, trust_remote_code=model.trust_remote_code, output_loading_info=True
    )
    score = getattr(loaded, "score", None)
    if not isinstance(score, torch.nn.Linear) or score.out_features != 1 or score.bias is not None:
        raise ValueError(
            f"{key}={model.path}: {type(loaded).__name__} has no score Linear(hidden, 1, bias=False); "
            "strategy=fsdp2 value and reward heads need a transformers family whose *ForSequenceClassification has one"
        )
    if "score.weight" in info["missing_keys"]:
        with torch.no_grad():
            score.weight.copy_(scalar_head_init(score.in_features, config.initializer_range))
    return loaded


def decoder_layers(module: torch.nn.Module, class_names: list[str] | None = None) -> tuple[list[torch.nn.Module], str]:
    """The submodules FSDP2 shards one by one, and where that choice came from.

    ``class_names`` (``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap``) or else the model's
    ``_no_split_modules`` (transformers names its decoder layer there) select by class name; with
    neither, the blocks of the longest ``nn.ModuleList`` (a custom stack of layers); else none.
    """
    source = "fsdp_config.wrap_policy.transformer_layer_cls_to_wrap"
    names = list(class_names or [])
    if not names:
        names = sorted(getattr(module, "_no_split_modules", None) or [])
        source = f"{type(module).__name__}._no_split_modules"
    if names:
        found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        if not found:
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"{source}={names}: no submodule of {type(module).__name__} has that class (its classes: "
                f"{present}); set actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap "
                "to the decoder layer's class name"
            )
        return found, f"{len(found)} x {'/'.join(sorted({type(m).__name__ for m in found}))} ({source})"
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if lists:
        longest = max(lists, key=len)
        return list(longest), f"{len(longest)} blocks of its longest nn.ModuleList"
    return [], "no decoder layers found: the root alone"


def _checkpoint_forward(layer: torch.nn.Module) -> None:
    """Recompute ``layer``'s activations in backward (non-reentrant ``torch.utils.checkpoint``);
    the layer keeps its class and parameter names (the forward is replaced on the instance)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    forward = layer.forward
    layer.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def apply_fsdp2(
    module: torch.nn.Module,
    *,
    mesh: Any,
    cfg: FSDPConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    gradient_checkpointing: bool,
    name: str,
) -> list[str]:
    """Parallelise ``module`` in place (the module docstring's order); returns what was done, one line each."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    layers, chosen = decoder_layers(module, cfg.wrap_policy.transformer_layer_cls_to_wrap)
    done = []
    if gradient_checkpointing:
        if not layers:
            raise ValueError(
                f"{name}: model.enable_gradient_checkpointing=true, but {type(module).__name__} has no decoder layers "
                "to recompute (no _no_split_modules, no nn.ModuleList); name them in "
                "fsdp_config.wrap_policy.transformer_layer_cls_to_wrap, or set it to false"
            )
        for layer in layers:
            _checkpoint_forward(layer)
        done.append(f"activation checkpointing of {len(layers)} layers")
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    model_dtype = next(module.parameters()).dtype
    if param_dtype != model_dtype or reduce_dtype != model_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cfg.offload_policy:
        if mesh.device_type == "cpu":
            warn_once(
                logger, "%s: fsdp_config.offload_policy=true on a CPU run: the shards live in host memory already", name
            )
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    done.append(
        f"fully_shard of {chosen} and the root over {mesh.size()} ranks"
        f"{f' (HSDP: replicate {mesh.shape[0]} x shard {mesh.shape[1]})' if mesh.ndim == 2 else ''} "
        f"(params {model_dtype} sharded, compute {param_dtype}, reduce {reduce_dtype}; "
        f"reshard_after_forward={cfg.reshard_after_forward}"
        f"{', CPUOffloadPolicy' if 'offload_policy' in kwargs else ''})"
    )
    return done


def _dp_mesh(dp: "dist.ProcessGroup", fsdp_size: int, device_type: str, name: str) -> Any:
    """The role's ``DeviceMesh``: one dimension over the DP group (full sharding), or with ``fsdp_size``
    a divisor of the DP size below it, HSDP's two -- replicate (``dp / fsdp_size``) x shard
    (``fsdp_size``): consecutive DP ranks share a parameter's shards, a rank's peers in the other
    groups hold the same shard (FSDP2 reduce-scatters over the shard groups, then all-reduces over the
    replicate groups). Every rank of the world makes every group (``new_group`` is collective), so HSDP
    needs the role on the whole world."""
    from torch.distributed.device_mesh import DeviceMesh

    size = dp.size()
    mesh_id = next(_MESH_IDS)
    if fsdp_size in (-1, size):
        # A name of its own for every mesh: DeviceMesh equality (and so DTensor's cached
        # redistribute plans, which keep the mesh they were made with) ignores the process
        # group, so a mesh of the same ranks and name from an earlier engine (another role, a
        # run before in this process) would stand for this one and all-gather over its group,
        # by then destroyed or another one ("Could not resolve the process group ...").
        return DeviceMesh.from_group(dp, device_type, mesh_dim_names=(f"{name}_dp{mesh_id}",))
    if fsdp_size < 1 or size % fsdp_size:
        raise ValueError(
            f"{name}: fsdp_config.fsdp_size={fsdp_size} does not divide the role's {size} data-parallel ranks; set it "
            f"to a divisor of {size} (HSDP: replicate {size} / fsdp_size x shard fsdp_size) or -1 (shard over all)"
        )
    ranks = dist.get_process_group_ranks(dp)
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            f"{name}: fsdp_config.fsdp_size={fsdp_size} (HSDP) needs the role on every rank of the world ({len(ranks)} "
            f"of {dist.get_world_size()} here); place it on all ranks or set fsdp_size=-1"
        )
    replicas = size // fsdp_size
    layout = torch.tensor(ranks).view(replicas, fsdp_size)
    mine = dist.get_rank()
    shard_group = replicate_group = None
    for row in layout.tolist():  # the shard groups, then the replicate groups: the same order on every rank
        group = dist.new_group(row)
        shard_group = group if mine in row else shard_group
    for column in layout.t().tolist():
        group = dist.new_group(column)
        replicate_group = group if mine in column else replicate_group
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device_type, mesh=layout,
        mesh_dim_names=(f"{name}_replicate{mesh_id}", f"{name}_shard{mesh_id}"),
    )


def _base_class(module: torch.nn.Module) -> type:
    """The module's own class (FSDP2 swaps in a subclass ``FSDP<name>`` whose base it is)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if c is not FSDPModule and not issubclass(c, FSDPModule))
    return cls


class FSDPEngine(TorchEngine):
    """``TorchEngine`` with the module sharded by FSDP2 over the role's DP group (module docstring).

    Args:
        module: the causal LM on the host (a Hugging Face model from :func:`load_hf_causal_lm`, or
            the Python API's ``nn.Module``), in ``fsdp.model_dtype``. Trained in place (it becomes
            the sharded module); a frozen engine (``optim`` None) shards it too, with no gradients.
        pg: the role's process groups (TP, PP and CP of size 1; FSDP2 over DP).
        fsdp: ``fsdp_config``.
        optim, total_training_steps, hf_dir, name: as ``TorchEngine``.
        gradient_checkpointing: recompute each decoder layer's activations in backward.
        freeze_vision_tower: a vision-language model's vision encoder takes no gradient (the reference's key).

    A vision-language model (``verl.models.vlm``) gets each micro-batch's images (the batch's ``mm_*``
    columns) in its forward, and computes its own multimodal rotary positions.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        pg: "ProcessGroupCollection",
        fsdp: FSDPConfig,
        optim: OptimConfig | None = None,
        total_training_steps: int | None = None,
        hf_dir: str,
        name: str = "model",
        gradient_checkpointing: bool = False,
        head: str = "lm",
        freeze_vision_tower: bool = False,
    ) -> None:
        if head not in ("lm", "value", "reward"):
            raise ValueError(f"{name}: the FSDP2 engine runs heads lm, value and reward, not head={head!r}")
        if head != "lm" and not isinstance(getattr(module, "score", None), torch.nn.Linear):
            raise ValueError(f"{name}: a {head} head needs a module with a score Linear (load_hf_value_model)")
        self.head = head
        for what, group in (("tensor", pg.tp), ("pipeline", pg.pp), ("context", pg.cp)):
            if group.size() != 1:
                raise ValueError(
                    f"{name}: the FSDP2 engine shards over data-parallel ranks only ({what} parallel size "
                    f"{group.size()}); set {name}'s megatron.{what}_model_parallel_size to 1 with strategy=fsdp2"
                    if what != "context" else
                    f"{name}: the FSDP2 engine has no context parallelism (size {group.size()}); set it to 1"
                )
        self.pg = pg
        self.name = name
        self.hf_dir = os.path.abspath(os.path.expanduser(hf_dir))
        self.optim_config = optim
        self.trainable = optim is not None
        self.fsdp_config = fsdp
        on_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        self.model_dtype, self.param_dtype, self.reduce_dtype = resolve_fsdp_dtypes(fsdp, self.device)
        self.is_hf = hasattr(module, "config") and hasattr(module, "save_pretrained")
        self.module_class = _base_class(module)
        module = module.to(self.model_dtype)
        if not self.trainable:
            module.requires_grad_(False)
        self.image_feed = self._feed_images(module, freeze_vision_tower, name)
        self.sharded = dist.is_initialized()
        self.sp_group = self._ulysses(module, pg, fsdp.ulysses_sequence_parallel_size, name)
        if self.sharded:
            self.mesh = _dp_mesh(pg.dp, fsdp.fsdp_size, self.device.type, name)
            done = apply_fsdp2(
                module, mesh=self.mesh, cfg=fsdp, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                gradient_checkpointing=gradient_checkpointing, name=name,
            )
            if self.sp_group is not None:
                sp = self.sp_group.size()
                done.append(f"Ulysses sequence parallel: {pg.dp.size() // sp} group(s) of {sp} ranks, each turn's "
                            f"tokens split over a group and attention heads over its ranks (FSDP2 shards over all "
                            f"{pg.dp.size()})")
        else:  # a world of one without torch.distributed: nothing to shard over
            self.mesh = None
            if gradient_checkpointing:
                for layer in decoder_layers(module, fsdp.wrap_policy.transformer_layer_cls_to_wrap)[0]:
                    _checkpoint_forward(layer)
            done = ["no process group: the module unsharded"]
        self.module = module.to(self.device) if not self.sharded else module
        self.param_offload, self.optimizer_offload = self._offload_flags(fsdp, name)
        self.module.train(self.trainable)
        self.model = self.module  # FSDP2 hooks the module itself: no wrapper
        self.chunks: list[torch.nn.Module] = [self.module]
        self.capabilities = EngineCapabilities(
            megatron_layout=False, hf_checkpoint=self.is_hf, packed_sequences=False, head_columns=False
        )
        self.steps_taken = 0
        self.total_training_steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        for line in done:
            log_rank0(logger, logging.INFO, "%s: %s", name, line)
        if not self.trainable:
            return
        self._build_training(
            optim, total_training_steps,
            f"{self.module_class.__name__} on the FSDP2 engine, {self.model_dtype} shards on {self.device}, "
            f"dp={pg.dp.size()}",
        )
        if self.param_offload:
            self._move_params("cpu")

    def _ulysses(self, module: torch.nn.Module, pg: "ProcessGroupCollection", sp: int, name: str) -> Any:
        """This rank's Ulysses SP group (``fsdp_config.ulysses_sequence_parallel_size`` above 1; the model's
        attention routed through ``verl.models.ulysses``), else None."""
        if sp == 1:
            return None
        from verl.models.ulysses import enable_ulysses, ulysses_group

        key = f"{name}: fsdp_config.ulysses_sequence_parallel_size={sp}"
        if not self.sharded:
            raise ValueError(f"{key} needs torch.distributed (torchrun) over a multiple of {sp} ranks; set it to 1")
        if self.image_feed is not None:
            raise ValueError(f"{key}: a vision-language model does not run with Ulysses here; set it to 1")
        enable_ulysses(module, sp, name)
        return ulysses_group(pg.dp, sp, name)

    def _feed_images(self, module: torch.nn.Module, freeze: bool, name: str) -> Any:
        """A vision-language model's :class:`~verl.models.vlm.ImageFeed` (each micro-batch's images reach its
        forward; ``freeze`` freezes its vision encoder), or None for a text model."""
        from verl.models import vlm

        if not vlm.is_vlm(module):
            if freeze:
                raise ValueError(f"{name}: freeze_vision_tower=true, but {type(module).__name__} has no vision encoder")
            return None
        if freeze:
            frozen = vlm.freeze_vision_tower(module)
            log_rank0(logger, logging.INFO, "%s: vision encoder frozen (%d parameters)", name, frozen)
        # Sharded over several ranks, every rank runs the vision encoder in every micro-batch.
        several = dist.is_initialized() and self.pg.dp.size() > 1
        feed = vlm.ImageFeed(module, every_rank_sees_images=several)
        self._outputs = feed.around(self._outputs)
        return feed

    # -- offload between calls (fsdp_config.param_offload / optimizer_offload) -------------

    def _offload_flags(self, fsdp: FSDPConfig, name: str) -> tuple[bool, bool]:
        """Which of ``param_offload`` / ``optimizer_offload`` can move anything here: none on a CPU run
        (host memory is the device), no ``param_offload`` beside ``offload_policy`` (the shards live
        on the host already); each flag that cannot act is warned once."""
        params, optimizer = fsdp.param_offload, fsdp.optimizer_offload and self.trainable
        for key, on in (("param_offload", params), ("optimizer_offload", optimizer)):
            if on and self.device.type == "cpu":
                what = "shards live" if key == "param_offload" else "optimizer state lives"
                warn_once(logger, "%s: fsdp_config.%s=true on a CPU run: it cannot move anything (the %s in host "
                          "memory already)", name, key, what)
        if params and fsdp.offload_policy and self.device.type != "cpu":
            warn_once(logger, "%s: fsdp_config.param_offload=true beside offload_policy=true: CPUOffloadPolicy keeps "
                      "the shards in host memory already", name)
            params = False
        on_device = self.device.type != "cpu"
        return params and on_device, optimizer and on_device

    def _move_params(self, device: str | torch.device) -> None:
        """The parameter shards and their gradients to ``device`` (FSDP2 moves its DTensor shards)."""
        self.module.to(device)
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _move_optimizer(self, device: str | torch.device) -> None:
        """The optimizer state's tensors to ``device`` (the scalar step counters stay where torch keeps them)."""
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=True)
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The parameter shards on the device inside the block when ``param_offload`` keeps them on the
        host between calls (else nothing moves)."""
        if not self.param_offload:
            yield
            return
        self._move_params(self.device)
        try:
            yield
        finally:
            self._move_params("cpu")

    def forward(
        self,
        batch,
        *,
        micro_batch_size=None,
        split=None,
        output="logprobs",
        temperature=1.0,
        with_entropy=False,
        head_columns=None,
        topk=None,
        score_ids=None,
        routing=None,
        truncation=None,
    ):
        """``TorchEngine.forward`` with the shards on the device (:meth:`on_device`)."""
        with self.on_device():
            return super().forward(
                batch, micro_batch_size=micro_batch_size, split=split, output=output,
                temperature=temperature, with_entropy=with_entropy, head_columns=head_columns,
                topk=topk, score_ids=score_ids, routing=routing, truncation=truncation,
            )

    def train_step(
        self,
        batch,
        *,
        micro_batch_size=None,
        split=None,
        loss_fn,
        output="logprobs",
        temperature=1.0,
        with_entropy=False,
        head_columns=None,
        topk=None,
        score_ids=None,
        routing=None,
        truncation=None,
    ):
        """``TorchEngine.train_step`` with the shards on the device (:meth:`on_device`)."""
        with self.on_device():
            return super().train_step(
                batch, micro_batch_size=micro_batch_size, split=split, loss_fn=loss_fn, output=output,
                temperature=temperature, with_entropy=with_entropy, head_columns=head_columns,
                topk=topk, score_ids=score_ids, routing=routing, truncation=truncation,
            )

    def _optimizer_step(self) -> tuple[float, bool]:
        """``TorchEngine._optimizer_step`` with the optimizer state on the device for the step only
        (``optimizer_offload``)."""
        if not self.optimizer_offload:
            return super()._optimizer_step()
        self._move_optimizer(self.device)
        try:
            return super()._optimizer_step()
        finally:
            self._move_optimizer("cpu")

    # -- compute --------------------------------------------------------------------------

    def _outputs(self, model, mb, *, output, temperature, with_entropy, topk=None, score_ids=None, truncation=None):
        """As ``TorchEngine._outputs``; a critic's or reward model's ``values`` [b, T]: its score head on
        every column (``values[:, t]`` the value of the state after token ``t``, as Megatron's scalar head's)."""
        if (output == "values") != (self.head != "lm"):
            raise ValueError(f"{self.name}: output={output!r} from a {self.head} head")
        if self.sp_group is not None:  # every member's micro-batch, a turn each; this rank's outputs kept
            mine = None
            for outputs, _ in self._turns(model, mb, output=output, temperature=temperature, with_entropy=with_entropy,
                                          topk=topk, score_ids=score_ids, truncation=truncation):
                mine = outputs if outputs is not None else mine
            return mine
        if output != "values":
            return super()._outputs(model, mb, output=output, temperature=temperature, with_entropy=with_entropy,
                                    topk=topk, score_ids=score_ids, truncation=truncation)
        import torch.nn.functional as F

        from verl.engine.torch_engine import module_forward_kwargs

        ids, mask = mb["input_ids"], mb["attention_mask"]
        real_cols = mask.any(dim=0).nonzero()
        width = int(real_cols[-1]) + 1 if real_cols.numel() else 1
        scores: list[torch.Tensor] = []
        # The root forward runs (FSDP2 gathers every unit, the score's too); its pooled output is dropped.
        handle = self.module.score.register_forward_hook(lambda _m, _i, out: scores.append(out))
        try:
            pooled = model(ids[:, :width], **module_forward_kwargs(self.module, mask[:, :width])).logits  # [b, 1]
        finally:
            handle.remove()
        # FSDP2 gathers the root's parameters for backward (the score's among them) from a hook on the
        # root forward's outputs; the zero term puts that output into the graph the loss runs back through.
        values = scores[-1].squeeze(-1) + 0.0 * pooled.sum()  # [b, width]
        return {"values": F.pad(values, (0, ids.shape[1] - width)) * mask.to(values.dtype)}

    def _turns(self, model, mb, *, output, temperature, with_entropy, topk=None, score_ids=None, truncation=None):
        """``verl.models.ulysses.ulysses_turns`` of one micro-batch (log-probs, entropy or values only)."""
        from verl.models.ulysses import ulysses_turns

        if output == "logits" or topk is not None or score_ids is not None:
            what = "output='logits'" if output == "logits" else "topk" if topk is not None else "score_ids"
            raise ValueError(
                f"{self.name}: fsdp_config.ulysses_sequence_parallel_size={self.sp_group.size()} computes log-probs, "
                f"entropy and values; {what} needs it at 1"
            )
        return ulysses_turns(model, mb, self.sp_group, output=output, temperature=temperature,
                             with_entropy=with_entropy, truncation=truncation,
                             score=self.module.score if output == "values" else None)

    def _micro_step(self, mb, *, last, loss_fn, compute):
        """As ``TorchEngine._micro_step``; under Ulysses one turn per member of the SP group, each run back
        before the next (this rank's loss on its own turn, a zero gradient through the others')."""
        if self.sp_group is None:
            return super()._micro_step(mb, last=last, loss_fn=loss_fn, compute=compute)
        from verl.engine.torch_engine import check_loss_share

        share = None
        for outputs, gathered in self._turns(self.model, mb, **compute):
            if outputs is None:
                torch.autograd.backward([gathered], [torch.zeros_like(gathered)])
                continue
            share = check_loss_share(loss_fn(outputs, mb))
            # The gathered tensor beside the loss: its backward is collective, whatever the loss reads.
            torch.autograd.backward([share.loss, gathered], [torch.ones_like(share.loss), torch.zeros_like(gathered)])
        return share

    # -- memory ---------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state (its shards' local
        tensors; a DTensor's local shard, else the tensor)."""

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        params = [local(p) for p in self.module.parameters()]
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        state = []
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                state += [local(v) for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0]
        return {
            "params": sum(t.numel() * t.element_size() for t in params),
            "grads": sum(t.numel() * t.element_size() for t in grads),
            "optimizer": sum(t.numel() * t.element_size() for t in state),
        }

    # -- checkpoints and export -----------------------------------------------------------

    def _state_dicts(self, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.module, [self.optimizer] if self.optimizer is not None else [],
                              options=StateDictOptions(**options))

    def save(self, ckpt_dir: str) -> None:
        """Write a DCP folder (:data:`DCP_DIR`: this rank's model and optimizer shards), the schedule and
        step count (:data:`STATE_FILE`, first DP rank) and this rank's RNG states (collective over the role)."""
        os.makedirs(ckpt_dir, exist_ok=True)
        with self.on_device():
            self._save(ckpt_dir)

    def _save(self, ckpt_dir: str) -> None:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state_dicts()
        state = {"model": model_sd}
        if self.optimizer is not None:
            state["optimizer"] = optim_sd
        dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, DCP_DIR), process_group=self.pg.dp if self.sharded else None)
        if self.dp_rank == 0:
            torch.save(
                {
                    "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                    "steps_taken": self.steps_taken,
                    "module_class": f"{self.module_class.__module__}.{self.module_class.__qualname__}",
                    "dp_size": self.dp_size,
                    "has_optimizer": self.optimizer is not None,
                },
                os.path.join(ckpt_dir, STATE_FILE),
            )
        save_rng_states(ckpt_dir)
        if self.sharded and self.dp_size > 1:
            dist.barrier(group=self.pg.dp)

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote, on any number of DP ranks (DCP reads the slices this
        rank's shards need); RNG states when the world size matches, else a warning."""
        meta_path = os.path.join(ckpt_dir, STATE_FILE)
        if not os.path.isfile(meta_path) or not os.path.isdir(os.path.join(ckpt_dir, DCP_DIR)):
            raise FileNotFoundError(
                f"{ckpt_dir} holds no {STATE_FILE} and {DCP_DIR}/: it is not an FSDP2 engine checkpoint (a Megatron one "
                "holds model/ and optimizer/ folders, the plain engine's torch_engine.pt); resume with the strategy "
                "it was saved with"
            )
        meta = torch.load(meta_path, map_location="cpu", weights_only=False)
        mine = f"{self.module_class.__module__}.{self.module_class.__qualname__}"
        if meta.get("module_class") != mine:
            raise ValueError(f"{meta_path} holds a {meta.get('module_class')}'s state, not a {mine}'s")
        with_optimizer = load_optimizer and self.optimizer is not None and meta["has_optimizer"]
        with self.on_device():
            self._load(ckpt_dir, meta, with_optimizer)
        if with_optimizer and self.optimizer_offload:
            self._move_optimizer("cpu")

    def _load(self, ckpt_dir: str, meta: dict[str, Any], with_optimizer: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = self._state_dicts()  # templates in this rank's layout (optimizer state initialised)
        state: dict[str, Any] = {"model": model_sd}
        if with_optimizer:
            state["optimizer"] = optim_sd
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, DCP_DIR), process_group=self.pg.dp if self.sharded else None)
        set_state_dict(
            self.module, [self.optimizer] if with_optimizer else [],
            model_state_dict=state["model"], optim_state_dict=state["optimizer"] if with_optimizer else {},
        )
        if with_optimizer and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        self.steps_taken = int(meta["steps_taken"])
        restore_rng_states(ckpt_dir)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on the host of the first DP rank (an empty dict elsewhere);
        collective over the role."""
        with self.on_device():
            model_sd, _ = self._state_dicts(full_state_dict=True, cpu_offload=True)
        return model_sd

    def _export_state(self) -> dict[str, torch.Tensor]:
        """The gathered state dict (first rank) with each tied tensor once (transformers ties the
        head back at load from the config's ``tie_word_embeddings``)."""
        tied = tied_names(self.module)
        return {k: v.contiguous() for k, v in self.full_state_dict().items() if k not in tied}

    def export_hf(self, out_dir: str) -> None:
        """The trained model gathered once on the first rank: a Hugging Face checkpoint (config.json,
        safetensors, generation config, the tokenizer) for a transformers model, else the module's
        state dict as ``model.safetensors`` and :data:`MODULE_FILE` (as ``TorchEngine.export_hf``).
        Staged and renamed (collective)."""
        from verl.utils.outputs import commit_output, staging_dir

        full = self._export_state()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            stage = staging_dir(out_dir)
            try:
                if self.is_hf:
                    self._write_hf(stage, full)
                else:
                    from safetensors.torch import save_file

                    save_file(full, os.path.join(stage, "model.safetensors"))
                    with open(os.path.join(stage, MODULE_FILE), "w", encoding="utf-8") as f:
                        json.dump({"class": f"{self.module_class.__module__}.{self.module_class.__qualname__}",
                                   "engine": "fsdp2", "steps_taken": self.steps_taken}, f, indent=2)
                for name in os.listdir(self.hf_dir):  # the tokenizer (and anything else that is not weights)
                    src = os.path.join(self.hf_dir, name)
                    if os.path.isfile(src) and not os.path.exists(os.path.join(stage, name)) and not _is_weights(name):
                        shutil.copy2(src, os.path.join(stage, name))
                commit_output(stage, out_dir, what="FSDP2 engine export (FSDPEngine.export_hf)")
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _write_hf(self, stage: str, full: dict[str, torch.Tensor]) -> None:
        """config.json (the model's own class in ``architectures``), safetensors and generation config."""
        from safetensors.torch import save_file

        config = self.module.config.to_dict()
        config["architectures"] = [self.module_class.__name__]
        config["torch_dtype"] = config["dtype"] = str(self.model_dtype).removeprefix("torch.")
        with open(os.path.join(stage, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(full, os.path.join(stage, "model.safetensors"), metadata={"format": "pt"})
        generation = getattr(self.module, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(stage)


def tied_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of ``module`` that hold a tensor an earlier name holds already (tied
    embeddings: the head's weight is the embedding's)."""
    seen: set[int] = set()
    tied = set()
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in seen:
            tied.add(key)
        seen.add(id(value))
    return tied


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name.endswith(".index.json") or name in (
        "config.json", "generation_config.json",
    )
