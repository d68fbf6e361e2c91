"""Qwen2.5-VL on Megatron-core: the language model as verl's GPTModel with multimodal rotary
positions (mrope), the transformers vision encoder beside it.

- The language model is :func:`verl.models.builder.build_gpt_model` of the checkpoint's
  ``text_config`` (a Qwen2 decoder: q/k/v biases, SwiGLU, RMSNorm) with
  ``position_embedding_type="mrope"`` and the config's ``mrope_section``: Megatron's
  ``MultimodalRotaryEmbedding`` takes position ids [3, B, S] (temporal, height, width) and gives
  each share of the rotary half-dimension the matching row, as transformers does.
- The vision encoder is transformers' own Qwen2.5-VL vision tower, on the first pipeline stage only
  and there whole on every tensor-parallel rank (replicated: each TP rank computes the same features
  and, since the decoder's first layer all-reduces its input gradient over TP, or sequence
  parallel's scatter all-gathers it, receives the same gradient). ``freeze_vision_tower`` stops its
  gradients.
- Before the decoder, the tower's merged features replace the word embeddings at the image tokens
  (``image_token_id``), row after row in token order, as transformers' ``masked_scatter`` does. The
  word embeddings are taken whole (the embedding's own sequence-parallel scatter is turned off) and
  split over sequence parallel after the features are in.
- The 3D positions are transformers' ``Qwen2_5_VLModel.get_rope_index``, called with a stand-in
  ``self`` that carries the checkpoint's config (it reads nothing else of the model). Every pipeline
  stage computes them from the micro-batch's ids and image grids (no tower needed; every stage holds
  the micro-batch), so the rotary embedding of each stage's layers sees the same 3D positions.

Layouts (:mod:`verl.models.forward` runs the model through Megatron's schedule):

- rows: a padded batch is packed as :mod:`verl.models.forward` packs it (each row's real tokens
  first, pads after; Megatron's attention is plain causal), and outputs come back in the batch's layout;
- pipeline parallel: the decoder's layers split over stages as for text models (uneven splits
  included); the first stage runs the tower and the embedding, the others take the hidden states;
- packed sequences (THD, ``use_remove_padding``): a micro-batch's rows are one row of their real
  tokens; each sequence (``cu_seqlens``) gets the 3D positions of its row alone, laid out per packed
  token ([3, 1, S]), and Megatron's rotary code then takes each sequence's frequencies at its own
  offset in the packed row (its exact per-token mapping when the frequencies cover the whole packed
  row, megatron-core 0.16.1 ``_apply_rotary_pos_emb_thd``) instead of restarting at 0;
- sequence parallel with TP > 1.

Not supported (refused in one line by :func:`check_vlm_layout`, before anything is built): virtual
pipeline stages, context parallel > 1, value/reward heads, and vision-language families other than
Qwen2.5-VL (Qwen2-VL, Qwen3-VL...). Checkpoints: Hugging Face safetensors in the
hub's layout (``model.layers.*``, ``lm_head.weight``, ``visual.*``), read through verl's weight
mapping; HF <-> Megatron conversion: ``verl.models.convert_vlm``. The Megatron training engine
builds it from a Qwen2.5-VL directory (``verl.engine.build.build_vlm_chunk``: TP and DP; its own
refusals in ``check_vlm_engine``).
"""

from __future__ import annotations

import functools
import logging
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl.models.builder import ModelBuildConfig, build_gpt_model
from verl.models.forward import pack_left, unpack
from verl.models.hf_config import HFModelSpec, parse_hf_config
from verl.utils.logging import log_rank0
from verl.utils.paths import load_json_object

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from verl.models.safetensors_io import SafetensorsReader

logger = logging.getLogger(__name__)

__all__ = [
    "MegatronVLM", "VLMSpec", "build_megatron_vlm", "check_vlm_layout", "is_vlm_config", "load_vision_weights",
    "load_vlm_hf_weights", "parse_vlm_config",
]

SUPPORTED_VLM_TYPES = ("qwen2_5_vl",)
VISION_PREFIX = "visual."
"""Where the hub's Qwen2.5-VL checkpoints keep the vision encoder's tensors."""


@dataclass(frozen=True, kw_only=True)
class VLMSpec:
    """A Qwen2.5-VL checkpoint as verl builds it on Megatron."""

    text: HFModelSpec
    """The language model (parsed as the Qwen2 decoder it is)."""
    mrope_section: tuple[int, int, int]
    """Temporal, height and width shares of the rotary half-dimension."""
    image_token_id: int
    """The placeholder token the vision features replace."""
    hf_config: Any
    """The transformers config (``Qwen2_5_VLConfig``): the vision tower and ``get_rope_index`` read it."""


def is_vlm_config(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json is a vision-language model's (it has a ``vision_config``)."""
    path = os.path.join(model_dir, "config.json")
    return os.path.isfile(path) and isinstance(load_json_object(path).get("vision_config"), dict)


def parse_vlm_config(model_dir: str) -> VLMSpec:
    """Validate a Qwen2.5-VL model directory's ``config.json``; ValueError naming the field otherwise."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir}: no config.json; pass a Hugging Face model directory")
    raw = load_json_object(path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_VLM_TYPES:
        raise ValueError(
            f"{path}: field 'model_type' is {model_type!r}; verl's Megatron vision-language models support "
            f"{', '.join(SUPPORTED_VLM_TYPES)} (Qwen2-VL and Qwen3-VL: use the FSDP2 engine, docs/vlm.md)"
        )
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}: field 'text_config' is missing; re-save the model with transformers >= 4.57")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    field_name = "text_config.rope_parameters.mrope_section" if "rope_parameters" in text else "text_config.rope_scaling.mrope_section"
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(x, int) and x > 0 for x in section)):
        raise ValueError(f"{path}: field '{field_name}' is {section!r}; Qwen2.5-VL needs three positive integers")
    if "image_token_id" not in raw:
        raise ValueError(f"{path}: field 'image_token_id' is missing; the image placeholder's id is needed")
    # The decoder is Qwen2's (q/k/v biases); tie_word_embeddings lives at the top level.
    decoder = {**text, "model_type": "qwen2", "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}
    spec = parse_hf_config(decoder, source=f"{path} text_config")
    if sum(section) != spec.head_dim // 2:
        raise ValueError(f"{path}: field '{field_name}' {section} sums to {sum(section)}, not head_dim / 2 = {spec.head_dim // 2}")
    from transformers import AutoConfig

    return VLMSpec(
        text=spec, mrope_section=tuple(section), image_token_id=int(raw["image_token_id"]),
        hf_config=AutoConfig.from_pretrained(model_dir),
    )


def check_vlm_layout(cfg: ModelBuildConfig, *, tp_size: int, pp_size: int, cp_size: int = 1,
                     vpp_size: int | None = None) -> None:
    """Refuse, in one line, what the Megatron VLM does not do (before any model is built)."""
    problems = []
    if vpp_size is not None:
        problems.append(
            f"virtual pipeline stages ({vpp_size} per rank, with pipeline parallel {pp_size}): leave "
            "virtual_pipeline_model_parallel_size unset"
        )
    if cp_size > 1:
        problems.append(f"context parallel {cp_size}: use context_parallel_size=1")
    if cfg.head != "lm":
        problems.append(f"head={cfg.head!r} (a critic or reward model of a VLM): only the LM head ('lm')")
    if problems:
        raise ValueError("the Megatron Qwen2.5-VL does not support " + "; ".join(problems))


def _rope_index(hf_config: Any):
    """transformers' ``Qwen2_5_VLModel.get_rope_index`` bound to a stand-in model that holds ``hf_config``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    # get_vision_position_ids reads nothing of self; get_rope_index reads self.config only.
    holder = types.SimpleNamespace(
        config=hf_config, get_vision_position_ids=functools.partial(Qwen2_5_VLModel.get_vision_position_ids, None)
    )
    return functools.partial(Qwen2_5_VLModel.get_rope_index, holder)


class MegatronVLM(torch.nn.Module):
    """Qwen2.5-VL: ``language_model`` (verl's GPTModel with mrope, this pipeline stage's layers) and
    ``vision`` (transformers' tower; None off the first pipeline stage)."""

    def __init__(self, spec: VLMSpec, language_model: torch.nn.Module, vision: torch.nn.Module | None) -> None:
        super().__init__()
        self.language_model = language_model
        self.vision = vision
        self.verl_vlm_spec = spec
        self._rope_index = _rope_index(spec.hf_config)
        self._merge = spec.hf_config.vision_config.spatial_merge_size
        # What verl.models.forward and Megatron's DDP, schedule and finalize_model_grads read of a model chunk.
        self.config = language_model.config
        self.verl_spec = language_model.verl_spec
        self.verl_build = language_model.verl_build
        self.verl_padded_vocab = language_model.verl_padded_vocab
        self.model_type = language_model.model_type
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
        assert self.pre_process == (vision is not None), "the vision tower belongs on the first pipeline stage only"
        if self.pre_process:
            # The image features go into the whole sequence's embeddings; sequence parallel splits them
            # after (forward), so the embedding must neither reduce-scatter nor scatter by itself.
            embedding = language_model.embedding
            embedding.reduce_scatter_embeddings = False
            embedding.word_embeddings.reduce_scatter_embeddings = False
            embedding.scatter_to_sequence_parallel = False

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word embedding the first and last stages share when the embeddings are tied (Megatron's
        ``finalize_model_grads`` all-reduces its gradient over them)."""
        return self.language_model.shared_embedding_or_output_weight()

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  image_grid_thw: torch.Tensor | None, packed_seq_params: Any = None) -> torch.Tensor:
        """The 3D rotary positions [3, B, T] of a padded batch (0 at pads), as transformers computes them.

        With ``packed_seq_params`` (THD: ``input_ids`` [1, S], the sequences' boundaries in its
        ``cu_seqlens_q``, ``S`` its last entry): each sequence's positions are those of its row alone
        ([3, 1, S]; the padding's sequences get 0)."""
        if packed_seq_params is None:
            return self._row_positions(input_ids, attention_mask, image_grid_thw)
        cu = packed_seq_params.cu_seqlens_q.long()  # [k + 1]
        width = input_ids.shape[1]
        if input_ids.shape[0] != 1 or int(cu[-1]) != width:
            raise ValueError(
                f"packed sequences: input_ids {tuple(input_ids.shape)} is not one row of "
                f"cu_seqlens' {int(cu[-1])} tokens"
            )
        lengths = cu[1:] - cu[:-1]  # [k]
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=width)
        offset = torch.arange(width, device=cu.device) - cu[:-1][segment]  # [S]: each token's place in its sequence
        rows, longest = len(lengths), int(lengths.max())
        ids = input_ids.new_zeros(rows, longest).index_put((segment, offset), input_ids[0])  # [k, L]
        mask = attention_mask.new_zeros(rows, longest).index_put((segment, offset), attention_mask[0])
        return self._row_positions(ids, mask, image_grid_thw)[:, segment, offset].unsqueeze(1)  # [3, 1, S]

    def _row_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        image = (input_ids == self.verl_vlm_spec.image_token_id).int()  # [B, T]
        real = attention_mask.bool().any(-1)  # rows without any token (a micro-batch's filler): all 0
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
        if bool(real.any()):
            positions[:, real], _ = self._rope_index(
                input_ids[real], mm_token_type_ids=image[real] * attention_mask[real].int(),
                image_grid_thw=image_grid_thw, attention_mask=attention_mask[real],
            )
        return positions

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower's merged features of every image, in order: [image tokens, hidden]."""
        out = self.vision(pixel_values.to(next(self.vision.parameters()).dtype), grid_thw=image_grid_thw)
        return out.pooler_output

    def embed(self, input_ids: torch.Tensor, slots: torch.Tensor, pixel_values: torch.Tensor | None,
              image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """The decoder's input on the first stage: word embeddings with the image features at ``slots``
        ([b, S] bool), [S, b, H] ([S / TP, b, H] under sequence parallel)."""
        from megatron.core import tensor_parallel

        embedding = self.language_model.embedding
        embeds = embedding(input_ids=input_ids, position_ids=None)  # [S, b, H], whole (__init__)
        if image_grid_thw is not None and len(image_grid_thw):
            features = self.image_features(pixel_values, image_grid_thw)  # [image tokens, H]
            embeds = embeds.transpose(0, 1).masked_scatter(slots.unsqueeze(-1), features.to(embeds.dtype))
            embeds = embeds.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            # This rank's slice of the sequence; the backward all-gathers, so every TP rank's tower
            # receives the whole gradient, as without sequence parallel.
            embeds = tensor_parallel.scatter_to_sequence_parallel_region(embeds, group=embedding.tp_group)
        return embeds

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, rows_mask: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """Logits [b, S, V/TP] (this rank's vocabulary slice; off the last pipeline stage, the hidden
        states [S, b, H]) of rows packed left, as :func:`verl.models.forward.forward_backward` runs a
        model: ``input_ids`` [b, S] with each row's real tokens first, ``rows_mask`` [b, S] 1 at them;
        or with ``packed_seq_params`` (THD), one row [1, S] of the sequences' real tokens. The
        one-dimensional ``position_ids`` and the ``attention_mask`` of Megatron's call are not used
        (the positions are 3D; attention is causal).

        ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3]: the rows' images in row
        order (transformers' layout, ``verl.protocol.images.model_image_inputs``). Every stage reads
        the grids (the positions); only the first runs the tower on the pixels.
        """
        slots = (input_ids == self.verl_vlm_spec.image_token_id) & rows_mask.bool()  # [b, S]
        n_tokens = int(slots.sum())
        # Checked from the grids alone, so every pipeline stage refuses the same micro-batch.
        has_images = image_grid_thw is not None and len(image_grid_thw) > 0
        n_features = int(image_grid_thw.prod(-1).sum()) // self._merge**2 if has_images else 0
        if n_features != n_tokens:
            if not has_images:
                raise ValueError(
                    f"the rows hold {n_tokens} image tokens but no images (mm_pixel_values / mm_image_grid_thw): "
                    "a step dropped the batch's image columns"
                )
            raise ValueError(
                f"the rows hold {n_tokens} image tokens but their images give {n_features} features "
                "(image_grid_thw does not match the prompts' <|image_pad|> tokens)"
            )
        positions = self.positions(input_ids, rows_mask, image_grid_thw, packed_seq_params)  # [3, b, S]
        embeds = self.embed(input_ids, slots, pixel_values, image_grid_thw) if self.pre_process else None
        return self.language_model(
            input_ids, positions, None, decoder_input=embeds, packed_seq_params=packed_seq_params
        )

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor | None = None,
               image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V/TP] of a padded batch ([B, T] ids and mask; 0 at pads), images as in :meth:`forward`.
        One pipeline stage only (with several, :func:`verl.models.forward.forward_backward` runs the stages)."""
        if not (self.pre_process and self.post_process):
            raise ValueError(
                "MegatronVLM.logits runs one pipeline stage; with several use verl.models.forward.forward_backward"
            )
        packed, order = pack_left(input_ids, attention_mask, input_ids.shape[1])  # [B, T] each
        rows_mask = attention_mask.gather(1, order)
        out = self.forward(packed, rows_mask=rows_mask, pixel_values=pixel_values, image_grid_thw=image_grid_thw)
        return unpack(out, order) * attention_mask.unsqueeze(-1).to(out.dtype)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Megatron's schedule hands a pipeline stage its input here (the first stage: None)."""
        self.language_model.set_input_tensor(tensor)


def load_vision_weights(model: MegatronVLM, reader: "SafetensorsReader") -> None:
    """Copy the ``visual.*`` tensors of ``reader``'s checkpoint into the vision tower, as they are
    (nothing off the first pipeline stage, which holds no tower)."""
    if model.vision is None:
        return
    names = [n for n in reader.names() if n.startswith(VISION_PREFIX)]
    state = {n[len(VISION_PREFIX):]: reader.read(n) for n in names}
    missing, unexpected = model.vision.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{reader.model_dir}: the vision encoder's tensors do not match the config's vision_config "
            f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}); re-save the checkpoint"
        )
    bad = [n for n, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{reader.model_dir}: vision tensor '{VISION_PREFIX}{bad[0]}' holds NaN/inf; restore the checkpoint")


def load_vlm_hf_weights(model: MegatronVLM, model_dir: str, *, pg: "ProcessGroupCollection") -> None:
    """Fill ``model`` from a Hugging Face Qwen2.5-VL checkpoint: the decoder through verl's weight
    mapping (only this TP rank's slices of this stage's layers are read), the vision tower's
    ``visual.*`` tensors as they are (first stage)."""
    from verl.models.checkpoint import load_hf_weights
    from verl.models.safetensors_io import SafetensorsReader

    reader = SafetensorsReader(model_dir)
    load_hf_weights([model.language_model], reader, pg=pg)
    load_vision_weights(model, reader)


def build_megatron_vlm(model_dir: str, cfg: ModelBuildConfig, pg: "ProcessGroupCollection", *,
                       freeze_vision_tower: bool = False, load_weights: bool = True) -> MegatronVLM:
    """The Megatron Qwen2.5-VL of ``model_dir`` on this rank: its TP shard of this pipeline stage's
    decoder layers, and on the first stage the whole tower."""
    spec = parse_vlm_config(model_dir)
    check_vlm_layout(cfg, tp_size=pg.tp.size(), pp_size=pg.pp.size(), cp_size=pg.cp.size())
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    lm = build_gpt_model(spec.text, cfg, pg, mrope_section=list(spec.mrope_section))
    vision = None
    if lm.pre_process:
        vision_config = spec.hf_config.vision_config
        vision = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config, dtype=cfg.torch_dtype)
        vision = vision.to(next(lm.parameters()).device)
    model = MegatronVLM(spec, lm, vision)
    if load_weights:
        load_vlm_hf_weights(model, model_dir, pg=pg)
    if freeze_vision_tower and vision is not None:
        vision.requires_grad_(False)
    log_rank0(
        logger, logging.INFO, "built Qwen2.5-VL on Megatron: mrope %s, vision tower %s, tp=%d pp=%d%s",
        list(spec.mrope_section),
        "on the first pipeline stage" if vision is None else
        f"{sum(p.numel() for p in vision.parameters())} parameters ({'frozen' if freeze_vision_tower else 'trained'})",
        pg.tp.size(), pg.pp.size(), " +sp" if cfg.sequence_parallel and pg.tp.size() > 1 else "", group=pg.tp,
    )
    return model
