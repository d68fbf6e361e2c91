"""Reward models on a vision-language model (VLM): a scalar head, or a generative judge.

transformers has no ``*ForSequenceClassification`` for the Qwen-VL families, so
:class:`VLMRewardModel` is one: the VLM's decoder (vision tower, merger and language model,
``model.model`` of a ``*ForConditionalGeneration``) with a linear score head ``[hidden] -> 1``
(no bias, initialised as verl's other scalar heads) on every position; a sequence's reward is
the head at its last real token. :class:`VLMJudge` asks the VLM itself: the question
``question`` is appended after each sequence and the reward is
``log p(yes) - log p(no)`` of the judge's next token (the first token of each word).

Both read ``input_ids`` / ``attention_mask`` [B, T] and, for sequences with images,
``pixel_values`` [N, C*t*p*p] and ``image_grid_thw`` [I, 3] of every image in row order (what
the model's processor builds); positions (mrope) come from the VLM from those. A directory
written by ``save_pretrained`` holds the VLM as transformers saves it, the processor, and
:data:`REWARD_INFO_FILE` (the kind, the judge's words, the score head's file).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

__all__ = [
    "REWARD_INFO_FILE",
    "VLMJudge",
    "VLMRewardModel",
    "is_vlm_reward",
    "is_vlm_reward_dir",
    "load_vlm_reward",
]

REWARD_INFO_FILE = "verl_vlm_reward.json"
"""Beside a VLM reward model's weights: ``{"kind": "scalar_head" | "judge", ...}``."""
_SCORE_FILE = "score_head.safetensors"


def _decoder(vlm: nn.Module) -> nn.Module:
    """The VLM's decoder without the LM head (``model.model`` of a ``*ForConditionalGeneration``)."""
    inner = getattr(vlm, "model", None)
    if inner is None or getattr(getattr(vlm, "config", None), "vision_config", None) is None:
        raise ValueError(
            f"a VLM reward model wraps a transformers vision-language *ForConditionalGeneration (with .model and a "
            f"vision_config), got {type(vlm).__name__}"
        )
    return inner


def _hidden_size(vlm: nn.Module) -> int:
    cfg = vlm.config
    text = getattr(cfg, "text_config", None) or cfg
    return int(text.hidden_size)


def _image_kwargs(pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> dict[str, Any]:
    if pixel_values is None:
        return {}
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}


class VLMRewardModel(nn.Module):
    """A scalar reward head on a VLM (module docstring).

    Args:
        vlm: a transformers vision-language ``*ForConditionalGeneration`` (Qwen2.5-VL, Qwen3-VL ...).
        score: the head's weight [1, hidden]; None: verl's scalar-head initialisation.
    """

    kind = "scalar_head"

    def __init__(self, vlm: nn.Module, *, score: torch.Tensor | None = None) -> None:
        super().__init__()
        from verl.models.heads import scalar_head_init

        _decoder(vlm)
        self.vlm = vlm
        self.config = vlm.config
        hidden = _hidden_size(vlm)
        dtype = next(vlm.parameters()).dtype
        self.score = nn.Linear(hidden, 1, bias=False, dtype=dtype)
        init = score if score is not None else scalar_head_init(hidden, getattr(self.config, "initializer_range", 0.02))
        if tuple(init.shape) != (1, hidden):
            raise ValueError(f"VLMRewardModel: score weight of shape {tuple(init.shape)}, expected (1, {hidden})")
        with torch.no_grad():
            self.score.weight.copy_(init)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head on every position: values [B, T] (float32); a row's reward is the value at its
        last real token (``verl.models.forward.last_token_values``)."""
        out = _decoder(self.vlm)(
            input_ids=input_ids, attention_mask=attention_mask, **_image_kwargs(pixel_values, image_grid_thw)
        )
        return self.score(out.last_hidden_state).squeeze(-1).float()  # [B, T]

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "score_file": _SCORE_FILE}

    def save_pretrained(self, out_dir: str, **kwargs: Any) -> None:
        """The VLM (transformers' layout), the head and :data:`REWARD_INFO_FILE` into ``out_dir``."""
        from safetensors.torch import save_file

        self.vlm.save_pretrained(out_dir, **kwargs)
        save_file({"score.weight": self.score.weight.detach().float().contiguous()}, os.path.join(out_dir, _SCORE_FILE))
        _write_info(out_dir, self.info())


class VLMJudge(nn.Module):
    """A generative judge: the VLM's ``log p(yes) - log p(no)`` after ``question`` (module docstring).

    Args:
        vlm: a transformers vision-language ``*ForConditionalGeneration``.
        tokenizer: the VLM's tokenizer (the policy's: the judge reads the policy's token ids).
        question: text appended after each sequence (prompt and response) before the judge's answer.
        yes, no: the two answers; each is scored by its first token, and the two must differ there.
    """

    kind = "judge"

    def __init__(
        self,
        vlm: nn.Module,
        tokenizer: Any,
        *,
        question: str = "\nIs the answer above correct? Answer Yes or No.\n",
        yes: str = "Yes",
        no: str = "No",
    ) -> None:
        super().__init__()
        _decoder(vlm)
        self.vlm = vlm
        self.config = vlm.config
        self.question, self.yes, self.no = question, yes, no
        self.question_ids = list(tokenizer.encode(question, add_special_tokens=False))
        if not self.question_ids:
            raise ValueError("VLMJudge(question=...): the question is empty after tokenization")
        self.yes_id = _first_token(tokenizer, yes, "yes")
        self.no_id = _first_token(tokenizer, no, "no")
        if self.yes_id == self.no_id:
            raise ValueError(
                f"VLMJudge: yes={yes!r} and no={no!r} start with the same token ({self.yes_id}); choose answers whose "
                "first tokens differ"
            )
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's judgement [B] (float32): its real tokens, then the question, left-padded into
        one batch; ``log p(yes) - log p(no)`` of the next token."""
        question = torch.tensor(self.question_ids, dtype=input_ids.dtype, device=input_ids.device)
        rows = [torch.cat([ids[mask.bool()], question]) for ids, mask in zip(input_ids, attention_mask)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.zeros((len(rows), width), dtype=attention_mask.dtype, device=attention_mask.device)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = r
            mask[i, width - len(r):] = 1
        logits = self.vlm(input_ids=ids, attention_mask=mask, **_image_kwargs(pixel_values, image_grid_thw)).logits
        logp = torch.log_softmax(logits[:, -1].float(), dim=-1)  # [B, V]
        return logp[:, self.yes_id] - logp[:, self.no_id]

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "question": self.question, "yes": self.yes, "no": self.no}

    def save_pretrained(self, out_dir: str, **kwargs: Any) -> None:
        """The VLM (transformers' layout) and :data:`REWARD_INFO_FILE` into ``out_dir``."""
        self.vlm.save_pretrained(out_dir, **kwargs)
        _write_info(out_dir, self.info())


def _first_token(tokenizer: Any, word: str, name: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if not ids:
        raise ValueError(f"VLMJudge({name}={word!r}): the word is empty after tokenization")
    return int(ids[0])


def _write_info(out_dir: str, info: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, REWARD_INFO_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)


def is_vlm_reward(model: Any) -> bool:
    """Whether ``model`` is a :class:`VLMRewardModel` or :class:`VLMJudge`."""
    return isinstance(model, (VLMRewardModel, VLMJudge))


def is_vlm_reward_dir(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` holds a VLM reward model saved by ``save_pretrained`` (its :data:`REWARD_INFO_FILE`)."""
    return bool(path) and os.path.isfile(os.path.join(os.path.expanduser(os.fspath(path)), REWARD_INFO_FILE))


def load_vlm_reward(path: str, *, dtype: torch.dtype = torch.float32, tokenizer: Any = None,
                    trust_remote_code: bool = False) -> VLMRewardModel | VLMJudge:
    """The VLM reward model saved in ``path`` (frozen, in eval mode); ValueError naming the file at fault."""
    from transformers import AutoModelForImageTextToText

    path = os.path.abspath(os.path.expanduser(path))
    info_path = os.path.join(path, REWARD_INFO_FILE)
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{info_path} cannot be read ({exc}); write the reward model again with save_pretrained"
        ) from None
    kind = info.get("kind")
    if kind not in ("scalar_head", "judge"):
        raise ValueError(f"{info_path}: kind={kind!r}; it must be 'scalar_head' or 'judge'")
    vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    if kind == "scalar_head":
        from safetensors.torch import load_file

        head_path = os.path.join(path, info.get("score_file", _SCORE_FILE))
        if not os.path.isfile(head_path):
            raise ValueError(f"{head_path}: the score head's weights are missing; write the reward model again")
        model: VLMRewardModel | VLMJudge = VLMRewardModel(vlm, score=load_file(head_path)["score.weight"])
    else:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = VLMJudge(vlm, tokenizer, question=info["question"], yes=info["yes"], no=info["no"])
    model.eval().requires_grad_(False)
    return model
