"""``RoleEngine``: a role's ``MegatronEngine`` on the role's own process groups, fed whole batches.

Every Megatron role (actor, critic, reference, reward model) composes one. A policy that is a
plain ``nn.Module`` given to the Python API (its ``model.path`` stands for the module:
``verl.engine.torch_engine.registered_module``) gets a ``TorchEngine`` instead, with the same
calls. It

- builds the engine inside ``megatron_state.activate_role(pg)`` and runs every call there, so
  colocated roles with different layouts (actor TP=2 beside a critic at TP=1) each see their
  own groups where Megatron still reads its globals;
- takes the whole step batch, gives each data-parallel rank its share (:mod:`verl.roles.dispatch`)
  and hands the results back whole on every rank;
- slices the per-token outputs to the response: ``logprobs[:, t]`` / ``entropy[:, t]`` belong to
  the token at ``t`` (the last ``R`` columns), a value head's ``values[:, t]`` is the value of
  the state *before* token ``t + 1``, so a response token's value sits one column to its left
  (columns ``P-1 .. P+R-2``, as the reference verl slices them);
- runs the PPO mini-batch loop of :meth:`train`: the global batch split into global
  mini-batches (in order, or shuffled with a seed), each mini-batch sharded over DP and given
  to ``MegatronEngine.train_step`` with the loss function the role builds for it;
- cuts each rank's rows into micro-batches of a fixed row count, or, given a token budget
  (``max_token_len``: the reference verl's ``use_dynamic_bsz`` with ``*_max_token_len_per_gpu``),
  into the fewest micro-batches of at most that many real tokens, the same count on every
  rank of the role (:mod:`verl.models.micro_batches`); the loss contract makes both give the
  same loss and gradient;
- survives running out of memory: an out-of-memory error in a micro-batch halves that call's
  micro-batch size (down to 1), or its token budget (down to the call's longest sequence); it
  stays lowered for the rest of the run, warns once with the new value and redoes the call. A training mini-batch is redone from its start (the engine
  zeroes the gradients first), so it equals the same mini-batch run at the smaller size.
  Every rank of the role must meet the error in the same call (the usual case: the same
  shapes everywhere); a rank that alone fails leaves the others in a collective until
  ``trainer.collective_timeout_s`` names it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from verl.algos import GlobalBatchInfo
from verl.engine import EngineStepResult, LossShareFn, MegatronEngine
from verl.engine.torch_engine import TorchEngine, registered_module
from verl.models.router_replay import ROUTED_EXPERTS
from verl.parallel import megatron_state
from verl.protocol import Batch
from verl.protocol.images import image_columns
from verl.roles.dispatch import collect, shard

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.config.schema import FSDPConfig, MegatronConfig, ModelConfig, OptimConfig
    from verl.engine.fsdp import FSDPEngine
    from verl.models.forward import OutputKind
    from verl.models.vocab_parallel import SamplingTruncation
    from verl.models.weight_mapping import HeadKind

__all__ = ["LossBuilder", "RoleEngine", "response_slice", "token_budget"]

T = TypeVar("T")

LossBuilder = Callable[[GlobalBatchInfo, int], LossShareFn]
"""``make_loss(info, num_micro_batches) -> loss_fn`` for one mini-batch: ``info`` holds the
mini-batch's global token/sequence counts over DP, ``num_micro_batches`` the micro-batches
each rank runs (metrics that are shares of the loss are multiplied by it before the engine
averages them over micro-batches, so they read as the mini-batch's value)."""


def token_budget(use_dynamic_bsz: bool, max_token_len: int | None, *, flag: str, key: str) -> int | None:
    """The token budget a role's calls take (None: fixed micro-batch sizes); ``flag`` and ``key``
    name the config fields in the error when the flag is on without a budget."""
    if not use_dynamic_bsz:
        return None
    if max_token_len is None:
        raise ValueError(
            f"{flag}=true needs {key}: the real tokens one micro-batch may hold on one rank (at least "
            f"the longest sequence, prompt length + response length); set it, or {flag}=false"
        )
    return max_token_len


def response_slice(name: str, full: torch.Tensor, response_length: int) -> torch.Tensor:
    """The response columns of a per-token output ``full`` [B, P+R] -> [B, R] (module docstring)."""
    if name == "values":
        return full[:, -response_length - 1 : -1]
    return full[:, -response_length:]


def _fsdp_engine(model: "ModelConfig", module: torch.nn.Module | None, *, pg, fsdp, optim, head, name,
                 total_training_steps, freeze_vision_tower: bool = False) -> "FSDPEngine":
    """A role's ``FSDPEngine`` (strategy=fsdp2): the Python API's module or the Hugging Face causal LM
    at ``model.path``. The module is never sharded itself: it stays whole for its rollout
    (``verl.roles.rollout``: its ``generate()`` cannot run on shards), so a trained role shards a copy
    (the rollout's replica takes its weights before each generation) and a frozen one a copy with
    the initial weights."""
    from verl.config.schema import FSDPConfig
    from verl.engine.fsdp import FSDPEngine, load_hf_causal_lm, load_hf_value_model, resolve_fsdp_dtypes
    from verl.engine.torch_engine import frozen_copy

    if head != "lm" and module is not None:
        raise ValueError(
            f"{name}: strategy=fsdp2 runs a {head} head on a Hugging Face model (its *ForSequenceClassification), "
            f"not on the plain nn.Module {type(module).__name__}; give a model directory, or strategy=megatron"
        )
    fsdp = fsdp if fsdp is not None else FSDPConfig()
    if module is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dtype = resolve_fsdp_dtypes(fsdp, device)[0]
        if head == "lm":
            module = load_hf_causal_lm(model, dtype=dtype)
        else:
            module = load_hf_value_model(model, dtype=dtype, key=f"{name}.model.path")
    elif optim is None:
        module = frozen_copy(module, model.path)
    else:
        module = copy.deepcopy(module)
    return FSDPEngine(
        module, pg=pg, fsdp=fsdp, optim=optim, total_training_steps=total_training_steps, hf_dir=model.path,
        name=name, gradient_checkpointing=model.enable_gradient_checkpointing and optim is not None, head=head,
        freeze_vision_tower=freeze_vision_tower,
    )


class RoleEngine:
    """One role's ``MegatronEngine`` with whole-batch ``forward`` and ``train`` (module docstring).

    Args:
        model, megatron, optim, total_training_steps, head, max_sequence_length: as ``MegatronEngine``.
        pg: the role's ``ProcessGroupCollection`` (from ``Topology.build_groups``).
        balance: reorder rows so the data-parallel ranks get similar token counts (``trainer.balance_batch``).
        name: the role's name in messages (``actor``, ``critic`` ...).
        strategy: ``megatron`` (``MegatronEngine``, or ``TorchEngine`` for the Python API's module) or
            ``fsdp2`` (``verl.engine.fsdp.FSDPEngine`` with ``fsdp``, the role's ``fsdp_config``).
        freeze_vision_tower: a vision-language model's vision encoder takes no gradient (fsdp2, or megatron
            with a Qwen2.5-VL).

    A batch's images (``verl.protocol.images``: ``mm_pixel_values``, ``mm_image_grid_thw``) go to the
    engine with its rows in every forward and update.
    """

    def __init__(
        self,
        *,
        model: "ModelConfig",
        megatron: "MegatronConfig",
        pg: "ProcessGroupCollection",
        optim: "OptimConfig | None" = None,
        total_training_steps: int | None = None,
        head: "HeadKind" = "lm",
        max_sequence_length: int | None = None,
        balance: bool = False,
        name: str = "model",
        strategy: str = "megatron",
        fsdp: "FSDPConfig | None" = None,
        freeze_vision_tower: bool = False,
    ) -> None:
        self.pg = pg
        self.balance = balance
        self.name = name
        # Micro-batch sizes lowered after an out-of-memory error, per kind of call.
        self.micro_batch_cap: dict[str, int] = {}
        module = registered_module(model.path)
        if freeze_vision_tower and module is not None and strategy != "fsdp2":
            raise ValueError(
                f"{name}: freeze_vision_tower=true with a plain {type(module).__name__} module: the plain PyTorch "
                "engine trains the module whole; set it to false, or use strategy=fsdp2"
            )
        if model.lora_rank > 0 and (strategy != "megatron" or module is not None):
            where = f"strategy={strategy}" if strategy != "megatron" else f"a plain {type(module).__name__} module"
            raise ValueError(
                f"{name}: model.lora_rank={model.lora_rank} — LoRA adapters are built on verl's Megatron models "
                f"(verl.models.lora), not with {where}; use strategy=megatron with a Hugging Face model, or lora_rank=0"
            )
        with self.active():
            if strategy == "fsdp2":  # torch FSDP2 over the role's DP ranks (verl.engine.fsdp)
                self.engine = _fsdp_engine(model, module, pg=pg, fsdp=fsdp, optim=optim, head=head, name=name,
                                           total_training_steps=total_training_steps,
                                           freeze_vision_tower=freeze_vision_tower)
            elif module is not None:  # a plain nn.Module from the Python API (verl.engine.torch_engine)
                if head != "lm":
                    raise ValueError(
                        f"{name}: {type(module).__name__} is a plain nn.Module, which the plain PyTorch engine trains as a "
                        f"policy only; a {head} head (critic, reward model) needs a Hugging Face model of a supported "
                        "family: give that, or a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)"
                    )
                self.engine = TorchEngine(
                    module, pg=pg, optim=optim, total_training_steps=total_training_steps, hf_dir=model.path, name=name
                )
            else:
                self.engine = MegatronEngine(
                    model=model,
                    megatron=megatron,
                    pg=pg,
                    optim=optim,
                    total_training_steps=total_training_steps,
                    head=head,
                    max_sequence_length=max_sequence_length,
                    freeze_vision_tower=freeze_vision_tower,
                )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Megatron's global groups point at this role's groups inside the block."""
        with megatron_state.activate_role(self.pg):
            yield

    def _fitting(
        self, kind: str, micro_batch_size: int, run: Callable[[int], "T"], *, floor: int = 1, unit: str = "micro-batch size"
    ) -> "T":
        """``run(size)`` at ``micro_batch_size`` (or the lower size an earlier out-of-memory error
        left for ``kind``, but at least ``floor``), halving the size on an out-of-memory error
        until it is ``floor``. ``unit`` names the size in the warning."""
        size = max(floor, min(micro_batch_size, self.micro_batch_cap.get(kind, micro_batch_size)))
        while True:
            try:
                return run(size)
            except torch.OutOfMemoryError:
                if size <= floor:
                    raise
                smaller = max(floor, size // 2)
                self.micro_batch_cap[kind] = smaller
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                logger.warning(
                    "%s %s: out of memory at %s %d; now %d for the rest of the run (set the role's %s "
                    "to %d to start there)",
                    self.name,
                    kind,
                    unit,
                    size,
                    smaller,
                    unit,
                    smaller,
                )
                size = smaller

    def _split(self, mask: torch.Tensor, max_token_len: int, what: str):
        """This rank's rows (``attention_mask`` [b, T]) cut by a token budget, agreed over the role."""
        from verl.models.micro_batches import token_split

        # The interleaved pipeline schedule runs micro-batches in groups of the pipeline size.
        multiple = self.pg.pp.size() if len(self.engine.chunks) > 1 else 1
        return token_split(mask, max_token_len, pg=self.pg, multiple_of=multiple, what=what)

    def _fit(self, kind: str, micro_batch_size: int, max_token_len: int | None, mask: torch.Tensor, run):
        """``run(micro_batch_size=..., split=...)`` under :meth:`_fitting`: rows, or a token budget."""
        if max_token_len is None:
            return self._fitting(kind, micro_batch_size, lambda size: run(size, None))
        what = f"the {self.name}'s token budget for {kind}"
        # A context-parallel rank holds 1/CP of every micro-batch's tokens: the budget per rank
        # (``*_max_token_len_per_gpu``) is CP times that many tokens of whole rows (as the reference verl).
        max_token_len *= self.pg.cp.size()
        # Out of memory, the budget halves, but never below this call's longest row (which must fit).
        longest = int(mask.sum(-1).max()) if mask.numel() else 1
        return self._fitting(
            f"{kind} tokens",
            max_token_len,
            lambda budget: run(None, self._split(mask, budget, what)),
            floor=max(1, min(longest, max_token_len)),
            unit="token budget",
        )

    def forward(
        self,
        batch: Batch,
        *,
        output: "OutputKind",
        micro_batch_size: int,
        response_length: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        full: bool = False,
        max_token_len: int | None = None,
        topk: int | None = None,
        routing: str | None = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs of the response columns for every row of ``batch``: ``logprobs``
        (and ``entropy``) or ``values``, each [B, R] float32, identical on every rank.
        ``full=True`` returns every column ([B, P+R]) instead. ``max_token_len`` (None: micro-batches
        of ``micro_batch_size`` rows) cuts micro-batches by real tokens instead. ``topk``: also
        ``topk_ids`` (int64) and ``topk_logprobs``, [B, R, topk] (``verl.models.forward``). ``routing='record'``:
        also ``routed_experts`` [B, P+R, layers, k] (every column: prompt tokens are routed too);
        ``routing='replay'``: the batch's ``routed_experts`` decide every token's experts, and
        ``router_replay/agreement`` (a 0-dim tensor) is the batch's share of (real token, MoE layer) sets
        the free choice would have kept. ``truncation``: the rollout's top-k / top-p, replayed in the
        log-probabilities (``verl.models.vocab_parallel``)."""
        with self.active():  # the role's groups (in its own world, for a role apart) answer inside it
            return self._forward(batch, output=output, micro_batch_size=micro_batch_size,
                                 response_length=response_length, temperature=temperature,
                                 with_entropy=with_entropy, full=full, max_token_len=max_token_len, topk=topk,
                                 routing=routing, truncation=truncation)

    def _forward(self, batch: Batch, *, output, micro_batch_size, response_length, temperature, with_entropy,
                 full, max_token_len, topk=None, routing=None, truncation=None) -> dict[str, torch.Tensor]:
        keys = ["input_ids", "attention_mask", *([ROUTED_EXPERTS] if routing == "replay" else []),
                *image_columns(batch)]
        piece = shard(batch.select(keys), self.pg.dp, balance=self.balance)

        def run(size: int | None, split):
            with self.active():
                return self.engine.forward(
                    piece.rows.tensors,
                    micro_batch_size=size,
                    split=split,
                    output=output,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    # Only the response columns are returned: the log-softmax skips the prompts.
                    head_columns=response_length if output == "logprobs" and not full else None,
                    topk=topk,
                    routing=routing,
                    truncation=truncation,
                )

        kind = f"forward ({output})"
        result = self._fit(kind, micro_batch_size, max_token_len, piece.rows["attention_mask"], run)
        local = Batch.from_dict(
            {
                k: (v if full or k == ROUTED_EXPERTS else response_slice(k, v, response_length)).to(
                    torch.float32 if v.is_floating_point() else v.dtype
                ).cpu()
                for k, v in result.outputs.items()
            }
        )
        out = dict(collect(local, self.pg.dp, piece).tensors)
        if routing == "replay" and result.metrics:  # router_replay.AGREEMENT over the whole batch
            from verl.models.router_replay import AGREEMENT, AGREEMENT_COUNTS
            from verl.protocol.collectives import comm_device

            counts = torch.tensor([float(result.metrics[0][k]) for k in AGREEMENT_COUNTS], dtype=torch.float64,
                                  device=comm_device(self.pg.dp))
            dist.all_reduce(counts, group=self.pg.dp)
            out[AGREEMENT] = (counts[0] / counts[1].clamp(min=1.0)).cpu()
        return out

    def train(
        self,
        batch: Batch,
        *,
        keys: Sequence[str],
        mini_batch_rows: int,
        micro_batch_size: int,
        epochs: int,
        make_loss: LossBuilder,
        shuffle_seed: int | None = None,
        output: "OutputKind" = "logprobs",
        temperature: float = 1.0,
        with_entropy: bool = False,
        max_token_len: int | None = None,
        score_ids: str | None = None,
        routing: str | None = None,
        truncation: "SamplingTruncation | None" = None,
    ) -> list[EngineStepResult]:
        """PPO updates: ``epochs`` passes over ``batch`` in global mini-batches of ``mini_batch_rows``
        rows (the last one shorter when the rows do not divide), one optimizer step each; returns
        every step's result (identical on every rank).

        ``keys`` are the tensors the loss reads besides ``input_ids``/``attention_mask``
        (``response_mask`` among them: it counts the loss's tokens). ``shuffle_seed`` (None: in
        order) permutes the rows before each pass with a generator seeded by it and the pass.
        ``max_token_len`` (None: micro-batches of ``micro_batch_size`` rows) cuts each mini-batch's
        micro-batches by real tokens instead. ``score_ids``: one of ``keys``, [B, R, k] token ids of the
        response columns whose log-probabilities the loss reads as ``outputs["score_logprobs"]``
        ([b, P+R, k]; ``verl.models.forward``). ``routing='replay'``: the experts of ``routed_experts`` (one of
        ``keys``) decide every token's experts (``verl.models.router_replay``). ``truncation``: as :meth:`forward`.
        """
        with self.active():  # the role's groups (in its own world, for a role apart) answer inside it
            return self._train(batch, keys=keys, mini_batch_rows=mini_batch_rows, micro_batch_size=micro_batch_size,
                               epochs=epochs, make_loss=make_loss, shuffle_seed=shuffle_seed, output=output,
                               temperature=temperature, with_entropy=with_entropy, max_token_len=max_token_len,
                               score_ids=score_ids, routing=routing, truncation=truncation)

    def _train(self, batch: Batch, *, keys, mini_batch_rows, micro_batch_size, epochs, make_loss, shuffle_seed,
               output, temperature, with_entropy, max_token_len, score_ids=None, routing=None,
               truncation=None) -> list[EngineStepResult]:
        needed = ["input_ids", "attention_mask", *dict.fromkeys([*keys, *image_columns(batch)])]
        rows = batch.select(needed)
        results = []
        for epoch in range(epochs):
            ordered = rows
            if shuffle_seed is not None:
                gen = torch.Generator().manual_seed(int(shuffle_seed) * 1_000_003 + epoch)
                ordered = rows.reorder(torch.randperm(len(rows), generator=gen))
            # A batch a DataStream filter shortened ends in a short mini-batch (its own optimizer
            # step); the config keeps every other batch a whole number of mini-batches.
            for mini in ordered.split(mini_batch_rows, allow_uneven=True):
                piece = shard(mini, self.pg.dp, balance=self.balance)
                local = piece.rows.tensors
                mask = local["response_mask"]  # [b, R]
                info = GlobalBatchInfo.from_masks([mask.float()], group=self.pg.dp)

                def run(size: int | None, split, local=local, info=info, rows=mask.shape[0], width=mask.shape[1]):
                    count = split.count if split is not None else -(-rows // size)
                    with self.active():
                        return self.engine.train_step(
                            local,
                            micro_batch_size=size,
                            split=split,
                            loss_fn=make_loss(info, count),
                            output=output,
                            temperature=temperature,
                            with_entropy=with_entropy,
                            # The loss reads the response columns (response_mask's width) only.
                            head_columns=width if output == "logprobs" else None,
                            score_ids=score_ids,
                            routing=routing,
                            truncation=truncation,
                        )

                results.append(self._fit("update", micro_batch_size, max_token_len, local["attention_mask"], run))
        return results

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, ckpt_dir: str) -> None:
        """``MegatronEngine.save`` (collective)."""
        with self.active():
            self.engine.save(ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        """``MegatronEngine.load`` with the optimizer (collective)."""
        with self.active():
            self.engine.load(ckpt_dir)


def step_metrics(
    prefix: str, results: Sequence[EngineStepResult], names: Mapping[str, str]
) -> dict[str, float]:
    """The reference verl's update metrics from several optimizer steps: ``{prefix}/grad_norm``,
    ``{prefix}/lr`` (of the last step) and each ``loss_fn`` metric renamed by ``names`` (its
    key -> the logged key), each averaged over the steps; under a token budget also
    ``{prefix}/micro_batches`` (per rank and step) and ``{prefix}/mb_token_fill`` (real tokens
    over micro-batches x budget)."""
    if not results:
        return {}
    out = {
        f"{prefix}/grad_norm": float(np.mean([r.grad_norm for r in results])),
        f"{prefix}/lr": results[-1].lr,
    }
    for key, shown in names.items():
        values = [r.metrics[key] for r in results if key in r.metrics]
        if values:
            out[shown] = float(np.mean(values))
    fills = [r.token_fill for r in results if r.token_fill is not None]
    if fills:  # a token budget: how many micro-batches it made and how full they were
        out[f"{prefix}/micro_batches"] = float(np.mean([r.micro_batches for r in results]))
        out[f"{prefix}/mb_token_fill"] = float(np.mean(fills))
    skipped = sum(not r.update_successful for r in results)
    if skipped:
        out[f"{prefix}/num_skipped_updates"] = float(skipped)
    return out
