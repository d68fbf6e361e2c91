"""Model objects where the trainer reads a directory: the Python API's ``actor_model=``,
``RolloutOperator(model=)``, ``PPOUpdateOperator(actor=)`` and ``RewardModelScorer(rm_model=)``.

verl trains through Megatron-core, which builds its modules from a Hugging Face checkpoint
directory. A Hugging Face model *object* of a supported family (``transformers.PreTrainedModel``
of type llama, qwen2 or mistral) is therefore written as such a directory first (its weights
and config, with the tokenizer given beside it), and the trained weights are loaded back into
the same object when training ends (:func:`write_back`). Any other ``nn.Module`` is refused with
the reason: there is no plain-PyTorch engine, every role is a Megatron one.
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

__all__ = ["ModelSource", "is_model_object", "model_directory", "write_back"]

ModelSource = Any
"""A Hugging Face checkpoint directory (``str``/``os.PathLike``) or a ``transformers.PreTrainedModel``."""

_SAVED: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_TEMP_DIRS: list[str] = []


def _remove_temp_dirs() -> None:
    for path in _TEMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_temp_dirs)


def is_model_object(model: Any) -> bool:
    """Whether ``model`` is a module object (not a path)."""
    return isinstance(model, torch.nn.Module)


def _check_object(model: torch.nn.Module, what: str, head: str) -> None:
    from verl.models.hf_config import SUPPORTED_MODEL_TYPES

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"{what}: a {type(model).__name__} is not a Hugging Face model; verl trains every role through "
            "Megatron-core, built from a Hugging Face checkpoint, and has no engine for other nn.Modules. Pass a "
            f"transformers model of a supported family ({', '.join(SUPPORTED_MODEL_TYPES)}) or its directory"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{what}: {type(model).__name__} is model_type={model_type!r}; verl's Megatron models cover "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    name = type(model).__name__
    if head == "reward":
        if not name.endswith("ForSequenceClassification") or int(getattr(config, "num_labels", 0)) != 1:
            raise ValueError(
                f"{what}: a reward model is a ...ForSequenceClassification with num_labels=1 (one score per "
                f"sequence); got {name} with num_labels={getattr(config, 'num_labels', None)}"
            )
    elif not name.endswith("ForCausalLM"):
        raise ValueError(f"{what}: a policy is a ...ForCausalLM (it generates); got {name}")


def _tokenizer_of(model: torch.nn.Module, tokenizer: Any, what: str) -> Any:
    from transformers import AutoTokenizer

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
    """``model`` and ``tokenizer`` as a Hugging Face checkpoint in ``out_dir`` (staged, then renamed)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        model.save_pretrained(stage, safe_serialization=True)
        tokenizer.save_pretrained(stage)
        try:
            os.rename(stage, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, "config.json")):  # not another rank's finished copy
                raise
            shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


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
    exit. ``what`` names the argument in errors (``"RLTrainer(actor_model=...)"``); ``head``:
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
    if out_dir is None:
        target = tempfile.mkdtemp(prefix="verl-model-")
        _TEMP_DIRS.append(target)
        os.rmdir(target)  # _save renames the finished copy in
    else:
        target = os.path.abspath(out_dir)
    if not os.path.isfile(os.path.join(target, "config.json")):
        _save(model, tok, target)
        logger.info("%s: %s written as a Hugging Face checkpoint to %s for the Megatron engine", what, type(model).__name__, target)
    _SAVED[model] = target
    return target


def write_back(model: torch.nn.Module, hf_dir: str) -> None:
    """Load the weights of the Hugging Face checkpoint ``hf_dir`` (the trainer's export) into
    ``model`` in place, each cast to the dtype and device of the parameter it replaces.
    Fails naming the keys when the checkpoint does not cover the model (a tied output layer,
    which shares the embedding, is the one key allowed to be absent)."""
    from safetensors.torch import load_file

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
