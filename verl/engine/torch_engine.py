"""``TorchEngine``: a plain PyTorch ``nn.Module`` as a role's engine, where Megatron-core cannot build it.

``MegatronEngine`` builds the Hugging Face families Megatron-core covers (llama, qwen2,
qwen3, mistral) from a checkpoint directory, with TP/PP/SP/CP. Any other causal language model, a
user's own ``nn.Module`` or a transformers model of another family, trains here instead: the
same calls (``forward``, ``train_step``, ``save``/``load``, ``export_hf``), the same loss contract
(``verl.models.forward.LossShare``), micro-batches (rows or a token budget), clipping rule and
metrics, so the roles and the trainer drive either engine without knowing which.

The module contract (``verl.trainer.model_objects`` checks it before anything is built):

- ``module(input_ids [B, T])`` returns logits ``[B, T, V]`` (a tensor, or an object or dict
  with ``logits``, as transformers returns), ``logits[:, t]`` predicting token ``t + 1``; the
  batch's ``attention_mask`` is passed as ``attention_mask=`` when ``forward`` takes that
  argument (or ``**kwargs``);
- ``module.generate(...)`` samples (the rollout engine, ``verl.rollout.module_engine``).

Rows are fed as the rollout made them: the prompt left-padded, the response right-padded, so
every response token is scored in exactly the context ``generate`` produced it in. Each
micro-batch drops the trailing columns that are padding in all its rows (a causal model never
lets a real token see a later column).

What it does not do: tensor, pipeline, sequence or context parallelism (the role's layout must
be 1 x 1 x 1; ``verl.trainer.ppo_checks`` says so before building), value or reward heads (a
critic or reward model is a Hugging Face model of a supported family), mixed precision (the
module trains in its own dtype). Data parallelism is torch's ``DistributedDataParallel`` over
the role's DP group when it has more than one rank (torchrun); in a world of one the module
trains on its own.

The trained module is the caller's own object (moved to the engine's device in place), so its
weights are the trained ones as training goes; a frozen engine (the reference policy) holds a
copy with the weights of :data:`INITIAL_WEIGHTS` in the module's directory.

Checkpoints (``save``/``load``): ``torch_engine.pt`` (the module's ``state_dict``, the
optimizer's, the LR schedule's, the step count), written by the first DP rank, and every
rank's RNG states in ``rng_rank{r}.pt``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.config.schema import OptimConfig
from verl.engine.contract import EngineCapabilities, EngineStepResult
from verl.engine.step import reduce_step_metrics
from verl.models.forward import ForwardResult, LossShare, LossShareFn, OutputKind, full_width
from verl.models.micro_batches import MicroBatchSplit, fixed_split
from verl.models.vocab_parallel import (
    SamplingTruncation,
    vocab_parallel_gather_logprobs,
    vocab_parallel_logprobs_entropy,
    vocab_parallel_topk,
)
from verl.utils.logging import log_rank0, warn_once

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = [
    "INITIAL_WEIGHTS",
    "MODULE_FILE",
    "TorchEngine",
    "build_torch_optimizer",
    "check_loss_share",
    "frozen_copy",
    "restore_rng_states",
    "save_rng_states",
    "module_forward_kwargs",
    "module_logits",
    "register_module",
    "registered_module",
]

MODULE_FILE = "verl_module.json"
"""Written into a plain module's directory (beside its tokenizer): the module's class, and that
it trains on this engine. The directory stands for the module in the config (``model.path``)."""

INITIAL_WEIGHTS = "model.safetensors"
"""In a plain module's directory: its weights when it was given to the API. A frozen engine (the
reference policy) starts from them, as a Megatron reference reads its checkpoint, so a run
resumed in the same process (where the module object has trained since) keeps the original
reference."""

STATE_FILE = "torch_engine.pt"

_MODULES: dict[str, torch.nn.Module] = {}


def register_module(path: str, module: torch.nn.Module) -> None:
    """Let ``path`` (a directory holding the module's tokenizer and :data:`MODULE_FILE`) stand for
    ``module`` wherever the config names a model directory (this process only)."""
    _MODULES[os.path.abspath(os.path.expanduser(path))] = module


def registered_module(path: str | os.PathLike | None) -> torch.nn.Module | None:
    """The plain module ``path`` stands for (:func:`register_module`), or None (a Hugging Face
    directory for the Megatron engine). A directory marked as a module's but registered in no
    process (a config written by another run) fails naming why."""
    if not path:
        return None
    key = os.path.abspath(os.path.expanduser(os.fspath(path)))
    module = _MODULES.get(key)
    if module is None and os.path.isfile(os.path.join(key, MODULE_FILE)):
        raise ValueError(
            f"{key} stands for a plain nn.Module given to the Python API in another process ({MODULE_FILE}); "
            "the module itself is not in this process: pass the module object to verl.RLTrainer / "
            "verl.DataStream in the process that trains it"
        )
    return module


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _names(fn: Any, name: str) -> bool:
    """Whether ``fn`` has a parameter called ``name`` (not merely ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def module_forward_kwargs(inner: torch.nn.Module, attention_mask: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments a padded batch's forward passes ``inner`` (the bare module): the mask, and for
    a transformers model the positions and ``use_cache=False``."""
    kwargs = {"attention_mask": attention_mask} if _accepts(inner.forward, "attention_mask") else {}
    if _names(inner.forward, "position_ids"):
        # Positions count real tokens, as generate() and vLLM number a left-padded prompt (a
        # transformers model otherwise numbers the padding too and scores every left-padded row
        # in other positions than it sampled them in).
        position_ids = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = position_ids.clamp_(min=0)
    if _names(inner.forward, "use_cache"):
        kwargs["use_cache"] = False  # one pass over whole rows: a KV cache would only grow (and break recompute)
    return kwargs


def module_logits(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``module``'s logits [B, T, V] for a padded batch (the module contract in the module docstring)."""
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    out = module(input_ids, **module_forward_kwargs(inner, attention_mask))
    if isinstance(out, Mapping):
        out = out.get("logits")
    elif not torch.is_tensor(out):
        out = getattr(out, "logits", None)
    if not torch.is_tensor(out) or out.dim() != 3 or tuple(out.shape[:2]) != tuple(input_ids.shape):
        got = type(out).__name__ if not torch.is_tensor(out) else f"a tensor of shape {list(out.shape)}"
        raise ValueError(
            f"{type(inner).__name__}.forward(input_ids {list(input_ids.shape)}) returned {got}; the plain "
            "PyTorch engine needs logits [B, T, vocab] (a tensor, or an output with .logits / ['logits'])"
        )
    return out


def _step_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def save_rng_states(ckpt_dir: str) -> None:
    """This rank's CPU (and CUDA) RNG states as ``rng_rank{r}.pt`` under ``ckpt_dir``."""
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, os.path.join(ckpt_dir, f"rng_rank{dist.get_rank() if dist.is_initialized() else 0}.pt"))


def restore_rng_states(ckpt_dir: str) -> None:
    """Restore this rank's RNG states from :func:`save_rng_states`' file when the checkpoint was saved
    by as many ranks as run now (else warn once: another world size draws other streams anyway)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_path = os.path.join(ckpt_dir, f"rng_rank{rank}.pt")
    saved_world = len([f for f in os.listdir(ckpt_dir) if f.startswith("rng_rank")])
    if saved_world == world and os.path.isfile(rng_path):
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        warn_once(logger, "%s: checkpoint saved by %d ranks, resumed on %d: RNG states not restored", ckpt_dir, saved_world, world)


def frozen_copy(module: torch.nn.Module, hf_dir: str) -> torch.nn.Module:
    """A frozen copy of the Python API's ``module`` for a forward-only role (the reference policy),
    with the weights of :data:`INITIAL_WEIGHTS` in its directory ``hf_dir`` when that file exists:
    the weights the module was given with, not its current ones."""
    frozen = copy.deepcopy(module)
    frozen.requires_grad_(False)
    initial = os.path.join(hf_dir, INITIAL_WEIGHTS)
    if os.path.isfile(initial):
        from safetensors.torch import load_model

        load_model(frozen, initial, device=str(next(frozen.parameters()).device))
    return frozen


def build_torch_optimizer(module: torch.nn.Module, optim: OptimConfig, *, name: str) -> torch.optim.Optimizer:
    """``optim``'s torch optimizer over ``module``'s trainable parameters (``adam``: AdamW, ``sgd``: SGD);
    plain tensors or FSDP2's DTensor shards alike."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{name}: {type(module).__name__} has no trainable parameters")
    if len(optim.betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers (beta1, beta2), got {optim.betas}")
    if optim.optimizer == "adam":
        return torch.optim.AdamW(
            params, lr=optim.lr, betas=tuple(float(b) for b in optim.betas), eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
    return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)


class TorchEngine:
    """A plain ``nn.Module`` with an optimizer and LR schedule (see the module docstring).

    Args:
        module: the causal language model; trained in place when ``optim`` is given, else a
            frozen deep copy of it is kept.
        pg: the role's process groups (TP, PP and CP of size 1; DP over the role's ranks).
        optim: optimizer and LR schedule (``adam``: ``torch.optim.AdamW``, ``sgd``:
            ``torch.optim.SGD``; Megatron's LR schedule); None: a frozen, forward-only engine.
        total_training_steps: optimizer steps of the run (sizes the LR schedule).
        hf_dir: the directory standing for the module (its tokenizer; the export copies it).
        name: the role's name in messages.
    """

    # A plain module: no Megatron shards (the rollout shares the module itself), its own
    # state_dict as the export, padded rows, every column through the head.
    capabilities = EngineCapabilities(megatron_layout=False, hf_checkpoint=False, packed_sequences=False, head_columns=False)

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        pg: "ProcessGroupCollection",
        optim: OptimConfig | None = None,
        total_training_steps: int | None = None,
        hf_dir: str,
        name: str = "model",
    ) -> None:
        for what, group in (("tensor", pg.tp), ("pipeline", pg.pp), ("context", pg.cp)):
            if group.size() != 1:
                raise ValueError(
                    f"{name}: the plain PyTorch engine has no {what} parallelism ({what} parallel size "
                    f"{group.size()}); set it to 1 (only data parallelism, over torchrun's ranks)"
                )
        self.pg = pg
        self.name = name
        self.hf_dir = os.path.abspath(os.path.expanduser(hf_dir))
        self.optim_config = optim
        self.trainable = optim is not None
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        if self.trainable:
            self.module = module.to(self.device)  # in place: the caller's object trains
        else:
            self.module = frozen_copy(module, self.hf_dir).to(self.device)
        self.module.train(self.trainable)
        self.chunks: list[torch.nn.Module] = [self.module]
        self.steps_taken = 0
        self.total_training_steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.model: torch.nn.Module = self.module
        if not self.trainable:
            return
        if pg.dp.size() > 1:
            # Buffers are not trained: no broadcast of them before every forward.
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.module,
                process_group=pg.dp,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )
        self._build_training(
            optim, total_training_steps,
            f"{type(module).__name__} on the plain PyTorch engine, {next(self.module.parameters()).dtype} on "
            f"{self.device}, dp={pg.dp.size()}{' (DistributedDataParallel)' if pg.dp.size() > 1 else ''}",
        )

    def _build_training(self, optim: OptimConfig, total_training_steps: int | None, what: str) -> None:
        """The optimizer over the module's (trainable) parameters and the LR schedule; one log line
        starting with ``what``."""
        from verl.engine.build import build_scheduler

        self.optimizer = build_torch_optimizer(self.module, optim, name=self.name)
        self.total_training_steps = int(total_training_steps or 0)
        self.scheduler = build_scheduler(self.optimizer, optim, self.total_training_steps)
        log_rank0(
            logger,
            logging.INFO,
            "engine ready: %s, %s lr=%g (%s, warm-up %d, decay %d of %d steps), %s",
            what,
            optim.optimizer,
            optim.lr,
            optim.lr_decay_style,
            self.scheduler.lr_warmup_steps,
            self.scheduler.lr_decay_steps,
            self.total_training_steps,
            f"grad-norm clip {optim.clip_grad:g}" if optim.clip_grad > 0 else "no grad-norm clip",
        )

    # -- properties (as MegatronEngine) ---------------------------------------------------

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
        """Always True: one stage."""
        return True

    def current_lr(self) -> float:
        """The learning rate the next step will use."""
        return 0.0 if self.optimizer is None else _step_lr(self.optimizer)

    # -- compute --------------------------------------------------------------------------

    def _outputs(
        self,
        model: torch.nn.Module,
        mb: dict[str, torch.Tensor],
        *,
        output: OutputKind,
        temperature: float,
        with_entropy: bool,
        topk: int | None = None,
        score_ids: str | None = None,
        truncation: SamplingTruncation | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs [b, T] of one micro-batch (verl.models.forward's layout, ``topk`` and
        ``score_ids`` as there), from the columns up to the last real one; ``model`` is the module, or its
        DDP wrapper when training."""
        ids, mask = mb["input_ids"], mb["attention_mask"]
        b, t = ids.shape
        real_cols = mask.any(dim=0).nonzero()
        width = int(real_cols[-1]) + 1 if real_cols.numel() else 1
        logits = module_logits(model, ids[:, :width], mask[:, :width])
        if output == "logits":
            return {"logits": F.pad(logits, (0, 0, 0, t - width)) * mask.unsqueeze(-1).to(logits.dtype)}
        if (topk is not None or score_ids is not None) and output != "logprobs":
            raise ValueError(f"{self.name}: topk and score_ids go with output='logprobs' (got output={output!r})")
        if output != "logprobs":
            raise ValueError(
                f"{self.name}: the plain PyTorch engine computes log-probabilities only (got output={output!r}); a "
                "critic or reward model is a Hugging Face model of a supported family"
            )
        shifted = logits[:, :-1]
        if temperature != 1.0:
            shifted = shifted / temperature
        vocab = dict(vocab_start=0, vocab_size=shifted.shape[-1], group=None)
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            shifted, ids[:, 1:width], with_entropy=with_entropy, truncation=truncation, **vocab
        )
        extra: dict[str, torch.Tensor] = {}  # [b, width - 1, k]
        if topk is not None:
            extra["topk_ids"], extra["topk_logprobs"] = vocab_parallel_topk(shifted, topk, **vocab)
        if score_ids is not None:  # the ids at column t are scored by the logits of column t - 1
            scored = full_width(mb[score_ids], t)[:, 1:width]
            extra["score_logprobs"] = vocab_parallel_gather_logprobs(shifted, scored, **vocab)
        # A token counts when it and the column before it are real: column 0 and each row's
        # first real token (after its left padding) have nothing predicting them.
        prev_real = torch.zeros_like(mask, dtype=torch.bool)
        prev_real[:, 1:] = mask[:, :-1] != 0
        keep = (mask != 0) & prev_real
        out = {"logprobs": F.pad(F.pad(logprobs, (1, 0)), (0, t - width)) * keep}
        if with_entropy:
            out["entropy"] = F.pad(F.pad(entropy, (1, 0)), (0, t - width)) * keep
        for key, value in extra.items():
            out[key] = F.pad(value, (0, 0, 1, t - width)) * keep.unsqueeze(-1).to(value.dtype)
        return out

    def _micro_batches(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None, split: MicroBatchSplit | None
    ) -> MicroBatchSplit:
        if (micro_batch_size is None) == (split is None):
            raise ValueError("TorchEngine: give exactly one of micro_batch_size and split")
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise ValueError(f"batch has no '{key}' tensor (keys: {sorted(batch)})")
        return fixed_split(batch["input_ids"].shape[0], micro_batch_size) if split is None else split

    @staticmethod
    def _rows(batch: Mapping[str, torch.Tensor], index, device: torch.device) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(index, dtype=torch.long)
        return {k: v.index_select(0, idx.to(v.device)).to(device) for k, v in batch.items() if torch.is_tensor(v)}

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
        routing: str | None = None,
        truncation: SamplingTruncation | None = None,
    ) -> ForwardResult:
        """Forward only: per-token outputs ([B, T]) of ``batch`` in micro-batches (as ``MegatronEngine.forward``;
        ``head_columns`` is accepted for the one signature: this engine computes every column; ``routing``
        (router replay) is refused: it is the Megatron engine's)."""
        _no_routing(self.name, routing)
        split = self._micro_batches(batch, micro_batch_size, split)
        self.module.eval()
        try:
            pieces: dict[str, list[torch.Tensor]] = {}
            order = []
            for index in split.parts:
                if len(index) == 0:
                    continue
                out = self._outputs(  # the bare module: no DDP collectives in a forward-only pass
                    self.module, self._rows(batch, index, self.device), output=output, temperature=temperature,
                    with_entropy=with_entropy, topk=topk, score_ids=score_ids, truncation=truncation,
                )
                for k, v in out.items():
                    pieces.setdefault(k, []).append(v.float() if k != "logits" and v.is_floating_point() else v)
                order.append(torch.as_tensor(index, dtype=torch.long))
        finally:
            self.module.train(self.trainable)
        index = torch.cat(order).to(self.device)
        outputs = {}
        for k, parts in pieces.items():
            stacked = torch.cat(parts)
            placed = torch.empty_like(stacked)
            placed[index] = stacked
            outputs[k] = placed
        return ForwardResult(outputs=outputs)

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
        head_columns: int | None = None,  # accepted for the one signature; every column is computed
        topk: int | None = None,
        score_ids: str | None = None,
        routing: str | None = None,
        truncation: SamplingTruncation | None = None,
    ) -> EngineStepResult:
        """One optimizer step on this rank's share of the batch (``MegatronEngine.train_step``'s
        contract): each micro-batch's ``LossShare`` backpropagated, DDP averaging the gradients
        over DP at the last one, the global norm clipped to ``optim.clip_grad``, the step skipped
        (gradients dropped) when the norm is not finite. ``routing`` is refused (as in :meth:`forward`)."""
        _no_routing(self.name, routing)
        if not self.trainable:
            raise ValueError("TorchEngine.train_step: this engine was built without an optimizer (optim=None)")
        split = self._micro_batches(batch, micro_batch_size, split)
        parts = [index for index in split.parts if len(index) > 0]
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        metrics: list[dict[str, torch.Tensor]] = []
        compute = dict(output=output, temperature=temperature, with_entropy=with_entropy, topk=topk,
                       score_ids=score_ids, truncation=truncation)
        for i, index in enumerate(parts):
            mb = self._rows(batch, index, self.device)
            share = self._micro_step(mb, last=i == len(parts) - 1, loss_fn=loss_fn, compute=compute)
            losses.append(share.loss.detach().float())
            metrics.append(
                {k: v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v)) for k, v in share.metrics.items()}
            )
        lr = self.current_lr()
        grad_norm, ok = self._optimizer_step()
        if ok:
            self.scheduler.step(1)
            self.steps_taken += 1
        loss, reduced = reduce_step_metrics(losses, metrics, self.pg, self.device)
        return EngineStepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            update_successful=ok,
            metrics=reduced,
            micro_batches=split.count,
            token_fill=split.fill,
        )

    def _micro_step(
        self, mb: dict[str, torch.Tensor], *, last: bool, loss_fn: LossShareFn, compute: dict[str, Any]
    ) -> LossShare:
        """One micro-batch of :meth:`train_step`: its outputs (``compute``: :meth:`_outputs`' keywords),
        its ``LossShare`` and backward (DDP's gradient all-reduce at the ``last`` one only)."""
        sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
        with sync:
            share = check_loss_share(loss_fn(self._outputs(self.model, mb, **compute), mb))
            share.loss.backward()
        return share

    @torch.no_grad()
    def _optimizer_step(self) -> tuple[float, bool]:
        """verl's rule (``verl.engine.step.optimizer_step``): global L2 norm, skip when not finite, clip."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        # Over FSDP2's DTensor shards the norm is a replicated DTensor: its value is the global norm.
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        if not math.isfinite(norm):
            warn_once(logger, "non-finite gradient norm (%s): optimizer step skipped", norm)
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        if self.optim_config.clip_grad > 0:  # scales by clip / (norm + 1e-6) when that is below 1
            torch.nn.utils.clip_grads_with_norm_(params, self.optim_config.clip_grad, total)
        self.optimizer.step()
        return norm, True

    # -- checkpoints and export -----------------------------------------------------------

    def save(self, ckpt_dir: str) -> None:
        """Write the module, optimizer and schedule (first DP rank) and this rank's RNG states under
        ``ckpt_dir`` (collective over the role)."""
        os.makedirs(ckpt_dir, exist_ok=True)
        if self.dp_rank == 0:
            state = {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "steps_taken": self.steps_taken,
                "module_class": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
                "dp_size": self.dp_size,
            }
            torch.save(state, os.path.join(ckpt_dir, STATE_FILE))
        save_rng_states(ckpt_dir)
        if self.dp_size > 1:
            dist.barrier(group=self.pg.dp)

    def load(self, ckpt_dir: str, *, load_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote (every rank reads the same state; RNG states when the
        world size matches, else a warning)."""
        path = os.path.join(ckpt_dir, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: {ckpt_dir} is not a plain PyTorch engine checkpoint (a Megatron one holds "
                "model/ and optimizer/ folders); resume with the model it was saved from"
            )
        state = torch.load(path, map_location=self.device, weights_only=False)
        mine = f"{type(self.module).__module__}.{type(self.module).__qualname__}"
        if state.get("module_class") != mine:
            raise ValueError(f"{path} holds a {state.get('module_class')}'s state, not a {mine}'s")
        self.module.load_state_dict(state["module"])
        if load_optimizer and self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps_taken = int(state["steps_taken"])
        restore_rng_states(ckpt_dir)

    def export_hf(self, out_dir: str) -> None:
        """The module's weights where the Megatron engine writes a Hugging Face checkpoint: its
        ``state_dict`` as ``model.safetensors`` (shared tensors once), the tokenizer, and
        :data:`MODULE_FILE` naming the class. Not loadable by transformers (the module is not a
        Hugging Face model): ``module.load_state_dict(safetensors.torch.load_file(...))`` is. Written
        by global rank 0, staged and renamed (collective)."""
        from safetensors.torch import save_model

        from verl.utils.outputs import commit_output, staging_dir

        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            stage = staging_dir(out_dir)
            try:
                save_model(self.module, os.path.join(stage, "model.safetensors"))
                for name in os.listdir(self.hf_dir):
                    src = os.path.join(self.hf_dir, name)
                    if os.path.isfile(src) and name not in (MODULE_FILE, INITIAL_WEIGHTS):  # the tokenizer
                        shutil.copy2(src, os.path.join(stage, name))
                with open(os.path.join(stage, MODULE_FILE), "w", encoding="utf-8") as f:
                    json.dump(
                        {"class": f"{type(self.module).__module__}.{type(self.module).__qualname__}", "engine": "torch",
                         "steps_taken": self.steps_taken},
                        f,
                        indent=2,
                    )
                commit_output(stage, out_dir, what="plain module export (TorchEngine.export_hf)")
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def check_loss_share(share: Any) -> LossShare:
    """``share`` when it is a ``LossShare``, else TypeError (verl.models.forward's loss contract)."""
    if not isinstance(share, LossShare):
        raise TypeError(f"loss_fn returned {type(share).__name__}, not a LossShare (verl.models.forward's loss contract)")
    return share


def _no_routing(name: str, routing: str | None) -> None:
    if routing is not None:
        raise ValueError(
            f"{name}: routing={routing!r} (Mixture-of-Experts router replay) is built in the Megatron engine only; "
            "use strategy=megatron or megatron.router_replay.mode=disabled"
        )
