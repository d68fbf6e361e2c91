"""Model objects where the trainer reads a directory: the Python API's ``actor_model=``,
``RolloutOperator(model=)``, ``PPOUpdateOperator(actor=)`` and ``RewardModelScorer(rm_model=)``.

Which engine trains a policy object, logged in one line when the object is first given:

- a Hugging Face model of a family Megatron-core builds (``transformers.PreTrainedModel`` of
  type llama, qwen2, qwen3 or mistral, a ``...ForCausalLM``): the Megatron engine (TP/PP/SP/DP, the
  vLLM rollout through the hybrid engine). Megatron builds its modules from a checkpoint
  directory, so the object is written as one first (its weights and config, with the tokenizer
  beside it), and the trained weights are loaded back into the same object when training ends
  (:func:`write_back`);
- any other ``nn.Module`` with ``forward()`` and ``generate()`` (a user's own model, a
  transformers model of another family): the plain PyTorch engine
  (``verl.engine.torch_engine``: the module itself trains, on one process or under DDP with
  torchrun, and generates with its own ``generate()``). Its directory holds the tokenizer,
  ``verl_module.json`` and the module's weights as given (``model.safetensors``: the frozen
  reference policy starts from them); it stands for the module in the config, in this process.

A reward model object must be a Hugging Face ``...ForSequenceClassification`` of a supported
family (a frozen Megatron engine scores with it), or a vision-language reward model
(``verl.models.vlm_reward``: ``VLMRewardModel``, ``VLMJudge``), written with its processor (given
as ``tokenizer=``) for the reward-model role's ``VLMRewardEngine``.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["ModelSource", "engine_choice", "is_model_object", "is_plain_module", "model_directory", "write_back"]

ModelSource = Any
"""A Hugging Face checkpoint directory (``str``/``os.PathLike``) or a model object (``nn.Module``)."""

_SAVED: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_TEMP_DIRS: list[str] = []


def _remove_temp_dirs() -> None:
    for path in _TEMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_temp_dirs)


def is_model_object(model: Any) -> bool:
    """Whether ``model`` is a module object (not a path)."""
    return isinstance(model, torch.nn.Module)


def engine_choice(model: torch.nn.Module) -> tuple[str, str]:
    """(``"megatron"`` or ``"torch"``, why) for a policy object (the module docstring's rule)."""
    from verl.models.hf_config import SUPPORTED_MODEL_TYPES

    name = type(model).__name__
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    families = "/".join(SUPPORTED_MODEL_TYPES)
    if config is not None and callable(getattr(model, "save_pretrained", None)) and model_type in SUPPORTED_MODEL_TYPES:
        # (a supported family's other heads are refused as policies by _check_object)
        return "megatron", f"a Hugging Face {model_type} {name}, a family Megatron-core builds (TP/PP/SP/DP, vLLM rollout)"
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        why = f"not a Hugging Face model of a family Megatron-core builds ({families})"
    else:
        why = f"a Hugging Face model of type {model_type!r}, which Megatron-core does not build here ({families})"
    return "torch", why + "; one process, or DDP under torchrun; it generates with its own generate()"


def is_plain_module(model: Any) -> bool:
    """Whether a policy object trains on the plain PyTorch engine (not Megatron)."""
    return is_model_object(model) and engine_choice(model)[0] == "torch"


def _check_plain(model: torch.nn.Module, what: str) -> None:
    name = type(model).__name__
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"{what}: {name} has no generate() method; a policy that is not a Hugging Face model of a supported family "
            "trains on the plain PyTorch engine, which samples with the module's own generate(input_ids, "
            "attention_mask=..., max_new_tokens=..., do_sample=..., temperature=..., ...) -> token ids"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{what}: {name} has no trainable parameters")


def _check_object(model: torch.nn.Module, what: str, head: str) -> None:
    from verl.models.hf_config import SUPPORTED_MODEL_TYPES
    from verl.models.vlm_reward import is_vlm_reward

    if head == "reward" and is_vlm_reward(model):
        return

    name = type(model).__name__
    if head == "lm" and engine_choice(model)[0] == "torch":
        _check_plain(model, what)
        return
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"{what}: a {type(model).__name__} is not a Hugging Face model; a reward model is trained on by "
            "Megatron-core, built from a Hugging Face checkpoint. Pass a transformers model of a supported family "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}) or its directory"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{what}: {type(model).__name__} is model_type={model_type!r}; verl's Megatron models cover "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if head == "lm" and not name.endswith("ForCausalLM"):
        raise ValueError(f"{what}: a policy is a ...ForCausalLM (it generates); got {name}")
    if head == "reward":
        if not name.endswith("ForSequenceClassification") or int(getattr(config, "num_labels", 0)) != 1:
            raise ValueError(
                f"{what}: a reward model is a ...ForSequenceClassification with num_labels=1 (one score per "
                f"sequence); got {name} with num_labels={getattr(config, 'num_labels', None)}"
            )


def _tokenizer_of(model: torch.nn.Module, tokenizer: Any, what: str) -> Any:
    from transformers import AutoTokenizer

    from verl.models.vlm_reward import is_vlm_reward

    if is_vlm_reward(model):  # its processor (tokenizer and image processor) is written beside it
        if tokenizer is None:
            raise ValueError(
                f"{what}: a {type(model).__name__} needs its processor: pass tokenizer= (the VLM's processor object "
                "or its directory), which is written beside the model"
            )
        if isinstance(tokenizer, (str, os.PathLike)):
            from verl.data.processor import load_processor

            return load_processor(os.fspath(tokenizer))
        if getattr(tokenizer, "image_processor", None) is None:
            raise TypeError(
                f"{what}: tokenizer= of a {type(model).__name__} takes the VLM's processor (with an image processor), "
                f"got {type(tokenizer).__name__}"
            )
        return tokenizer
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or ""
        if source and os.path.isdir(source):
            return AutoTokenizer.from_pretrained(source)
        raise ValueError(
            f"{what}: a model object needs its tokenizer: pass tokenizer= (a tokenizer object or its directory); "
            f"the model's name_or_path {source!r} is not a local directory to read one from"
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"{what}: tokenizer= takes a Hugging Face tokenizer or its directory, got {type(tokenizer).__name__}")
    return tokenizer


def _save(model: torch.nn.Module, tokenizer: Any, out_dir: str) -> None:
    """``model`` and ``tokenizer`` as a Hugging Face checkpoint in ``out_dir`` (staged, then renamed);
    for a plain module only the tokenizer and ``verl_module.json``."""
    import json

    from verl.engine.torch_engine import INITIAL_WEIGHTS, MODULE_FILE

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    from verl.models.vlm_reward import is_vlm_reward

    try:
        if is_plain_module(model) and not is_vlm_reward(model):
            from safetensors.torch import save_model

            cls = type(model)
            with open(os.path.join(stage, MODULE_FILE), "w", encoding="utf-8") as f:
                json.dump({"class": f"{cls.__module__}.{cls.__qualname__}", "engine": "torch"}, f, indent=2)
            save_model(model, os.path.join(stage, INITIAL_WEIGHTS))  # the reference policy's weights
        else:
            model.save_pretrained(stage, safe_serialization=True)
        tokenizer.save_pretrained(stage)
        try:
            os.rename(stage, out_dir)
        except OSError:
            if not _is_written(out_dir):  # not another rank's finished copy
                raise
            shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _is_written(path: str) -> bool:
    from verl.engine.torch_engine import MODULE_FILE

    return any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", MODULE_FILE))


def model_directory(
    model: ModelSource,
    *,
    what: str,
    tokenizer: Any = None,
    head: str = "lm",
    out_dir: str | None = None,
) -> str:
    """The checkpoint directory the trainer reads for ``model``.

    A path is returned absolute (it must hold a ``config.json``). A model object is written once
    (the same object given to several operators shares one directory): to ``out_dir`` when given
    (kept; reused when it already holds a checkpoint), else to a temporary directory removed at
    exit. Under torchrun (collective: every rank calls it for the same object, in the same order)
    rank 0's object is written and every rank reads that directory. ``what`` names the argument in errors (``"RLTrainer(actor_model=...)"``); ``head``:
    ``"lm"`` for a policy, ``"reward"`` for a reward model.
    """
    if isinstance(model, (str, os.PathLike)):
        path = os.path.abspath(os.path.expanduser(os.fspath(model)))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{what}: {path} is not a Hugging Face checkpoint directory (no config.json)")
        return path
    if not is_model_object(model):
        raise TypeError(f"{what}: takes a Hugging Face model object or its directory, got {type(model).__name__}")
    _check_object(model, what, head)
    saved = _SAVED.get(model)
    if saved is not None and (out_dir is None or os.path.abspath(out_dir) == saved):
        return saved
    tok = _tokenizer_of(model, tokenizer, what)
    # Under torchrun every rank holds its own object; rank 0's is the model (as DDP takes rank 0's
    # weights), written once where every rank reads it (transformers' save_pretrained writes on
    # rank 0 only anyway).
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    writer = not shared or dist.get_rank() == 0
    if out_dir is None:
        target = None
        if writer:
            target = tempfile.mkdtemp(prefix="verl-model-")
            _TEMP_DIRS.append(target)
            os.rmdir(target)  # _save renames the finished copy in
    else:
        target = os.path.abspath(out_dir)
    if shared:
        box = [target]
        dist.broadcast_object_list(box, src=0)
        target = box[0]
    if writer and not _is_written(target):
        _save(model, tok, target)
    if shared:
        dist.barrier()
        if not _is_written(target):
            raise ValueError(
                f"{what}: rank 0 wrote the model object to {target}, which rank {dist.get_rank()} cannot read (a node "
                "without that filesystem?); save it with save_pretrained to a directory every node reads and pass the path"
            )
    if head == "lm":
        from verl.engine.torch_engine import register_module

        engine, why = engine_choice(model)
        if engine == "torch":
            register_module(target, model)
            logger.info("%s: %s trains on the plain PyTorch engine: %s (tokenizer in %s)", what, type(model).__name__, why, target)
        else:
            logger.info(
                "%s: %s trains on the Megatron-core engine: %s (written as a checkpoint to %s; the trained weights go "
                "back into the object at the end)", what, type(model).__name__, why, target,
            )
    _SAVED[model] = target
    return target


def write_back(model: torch.nn.Module, hf_dir: str) -> None:
    """Load the weights of the Hugging Face checkpoint ``hf_dir`` (the trainer's export) into
    ``model`` in place, each cast to the dtype and device of the parameter it replaces.
    Fails naming the keys when the checkpoint does not cover the model (a tied output layer,
    which shares the embedding, is the one key allowed to be absent). A plain module: the plain
    PyTorch engine trained the object itself (nothing to load); FSDP2 trained a sharded copy
    (``verl.roles.engine_role``), whose export (``model.safetensors``, marked ``fsdp2`` in its
    :data:`~verl.engine.torch_engine.MODULE_FILE`) is loaded into the object."""
    from safetensors.torch import load_file

    if is_plain_module(model):
        _write_back_module(model, hf_dir)
        return
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"write_back: {hf_dir} holds no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"write_back: {hf_dir} does not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if tied and callable(getattr(model, "tie_weights", None)):
        model.tie_weights()


def _write_back_module(model: torch.nn.Module, export_dir: str) -> None:
    """The FSDP2 engine's export of a plain module (``export_dir``) into ``model`` in place (the plain
    engine's export is the object's own weights already); the tied names, written once, may be absent."""
    import json

    from safetensors.torch import load_file

    from verl.engine.fsdp import tied_names
    from verl.engine.torch_engine import MODULE_FILE

    marker = os.path.join(export_dir, MODULE_FILE)
    if not os.path.isfile(marker):
        return
    with open(marker, encoding="utf-8") as f:
        if json.load(f).get("engine") != "fsdp2":
            return
    missing, unexpected = model.load_state_dict(load_file(os.path.join(export_dir, "model.safetensors")), strict=False)
    missing = [k for k in missing if k not in tied_names(model)]
    if missing or unexpected:
        raise ValueError(
            f"write_back: {export_dir} does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
