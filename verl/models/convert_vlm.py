"""HF <-> Megatron conversion of a Qwen2.5-VL (``verl.models.megatron_vlm``), behind the same
``hf_to_megatron`` / ``check_conversion`` / ``megatron_to_hf`` of :mod:`verl.models.convert` (and so
``tools/hf2megatron.py`` / ``tools/megatron2hf.py``), which hand a vision-language directory here.

The checkpoint is the language model's own verl Megatron checkpoint (a reshardable distributed
checkpoint, ``verl_model.json``, ``hf/`` with the decoder's config and the tokenizer; any TP x PP,
the decoder's layers split over the stages as for text models) plus ``vision/``: the vision
encoder's ``visual.*`` tensors as they are (``model.safetensors``, whole: the tower is replicated
over TP and lives on the first pipeline stage), the model's own ``config.json`` and its image
processor's files.
Back to Hugging Face, the decoder's tensors come out under the hub's names (``model.layers.*``,
``lm_head.weight``), the tower's unchanged, with the original config: a round trip is bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from verl.models.builder import DTYPES, HF_DTYPE_NAMES, ModelBuildConfig, transformer_config_from_hf
from verl.models.megatron_vlm import VISION_PREFIX, check_vlm_layout, parse_vlm_config
from verl.models.safetensors_io import SafetensorsReader, SafetensorsWriter, copy_side_files
from verl.parallel.bootstrap import run_on_ranks, under_torchrun
from verl.utils.outputs import check_output_dir, commit_output, staging_dir

__all__ = ["VISION_SUBDIR", "is_vlm_checkpoint", "vlm_check_conversion", "vlm_hf_to_megatron", "vlm_megatron_to_hf"]

VISION_SUBDIR = "vision"
"""Where a VLM checkpoint keeps the vision encoder's tensors, the model's config and its image processor."""
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def is_vlm_checkpoint(ckpt_dir: str) -> bool:
    """Whether ``ckpt_dir`` is a Megatron checkpoint of a vision-language model (it has ``vision/config.json``)."""
    return os.path.isfile(os.path.join(ckpt_dir, VISION_SUBDIR, "config.json"))


def _convert_rank(hf_dir: str, tmp_dir: str, tp: int, pp: int, build: ModelBuildConfig) -> float:
    from verl.models.builder import verify_model_matches_spec
    from verl.models.checkpoint import save_checkpoint
    from verl.models.convert import _peak_rss_mib
    from verl.models.megatron_vlm import build_megatron_vlm
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = build_megatron_vlm(hf_dir, build, pg)
    verify_model_matches_spec(model.language_model, pg)
    save_checkpoint([model.language_model], tmp_dir, pg=pg, hf_dir=hf_dir)
    return _peak_rss_mib()


def _write_vision(hf_dir: str, out: str) -> int:
    """``vision/``: the tower's tensors as stored, the model's config, its image processor's files."""
    os.makedirs(out, exist_ok=True)
    reader = SafetensorsReader(hf_dir)
    writer = SafetensorsWriter(out)
    names = [n for n in reader.names() if n.startswith(VISION_PREFIX)]
    for name in names:
        writer.add(name, reader.read(name))
    writer.finish()
    for name in ("config.json", *IMAGE_PROCESSOR_FILES):
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out, name))
    return len(names)


def vlm_hf_to_megatron(*, hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str, head: str,
                       vocab_pad_multiple: int | None, overwrite: bool):
    """``verl.models.convert.hf_to_megatron`` of a Qwen2.5-VL directory (module docstring)."""
    from verl.models.convert import ConversionReport, _is_coordinator, _share_from_coordinator

    build_kwargs = {"dtype": dtype, "head": head, "init_weights": False}
    if vocab_pad_multiple is not None:
        build_kwargs["vocab_pad_multiple"] = vocab_pad_multiple
    build = ModelBuildConfig(**build_kwargs)
    spec = parse_vlm_config(hf_dir)  # names the field at fault before any rank starts
    check_vlm_layout(build, tp_size=tp, pp_size=pp)
    transformer_config_from_hf(spec.text, build, tp_size=tp, pp_size=pp)
    tmp_dir = None
    if _is_coordinator():
        check_output_dir(out_dir, key="--out-dir", inputs={"--hf-dir": hf_dir}, overwrite=overwrite)
        tmp_dir = staging_dir(out_dir)
    tmp_dir = _share_from_coordinator(tmp_dir)
    try:
        rss = run_on_ranks(_convert_rank, tp * pp, os.path.abspath(hf_dir), tmp_dir, tp, pp, build)
        if _is_coordinator():
            _write_vision(hf_dir, os.path.join(tmp_dir, VISION_SUBDIR))
    except BaseException:
        if _is_coordinator():
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if _is_coordinator():
        commit_output(tmp_dir, out_dir, what="Megatron checkpoint of a vision-language model (tools/hf2megatron.py)")
    if under_torchrun():
        dist.barrier()
    return ConversionReport(
        out_dir=os.path.abspath(out_dir), num_tensors=len(SafetensorsReader(hf_dir).names()),
        peak_rss_mib_per_rank=[r for r in rss if r is not None],
    )


def check_batch(hf_config, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three rows for --check: text only, left-padded with a 4 x 4-patch image, right-padded with a
    2 x 6 and a 2 x 2 image (random pixels: the check compares two implementations, not images)."""
    vc = hf_config.vision_config
    merge = vc.spatial_merge_size
    grids = torch.tensor([[1, 2 * merge, 2 * merge], [1, merge, 3 * merge], [1, merge, merge]])
    gen = torch.Generator().manual_seed(seed)
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(int(grids.prod(-1).sum()), dim, generator=gen)
    vocab = hf_config.text_config.vocab_size
    special = {hf_config.image_token_id, hf_config.vision_start_token_id, hf_config.vision_end_token_id,
               getattr(hf_config, "video_token_id", -1)}

    def text(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (4 * n,), generator=gen).tolist()
        return [i for i in ids if i not in special][:n]

    def span(k: int) -> list[int]:
        n = int(grids[k].prod()) // merge**2
        return [hf_config.vision_start_token_id] + [hf_config.image_token_id] * n + [hf_config.vision_end_token_id]

    rows = [text(3) + span(0) + text(4), text(2) + span(1) + text(2) + span(2) + text(2)]
    width = max(len(r) for r in rows) + 3
    rows.insert(0, text(width))
    pads = [(0, 0), (width - len(rows[1]), 0), (0, width - len(rows[2]))]
    ids = torch.tensor([[0] * a + r + [0] * b for r, (a, b) in zip(rows, pads)])
    mask = torch.tensor([[0] * a + [1] * len(r) + [0] * b for r, (a, b) in zip(rows, pads)])
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grids}


CHECK_ROW_IMAGES = ([], [0], [1, 2])
"""The images of each row of :func:`check_batch`, as indices into its ``image_grid_thw``."""


def row_image_columns(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                      row_images: tuple[list[int], ...]) -> dict[str, torch.Tensor]:
    """A batch's images ([patches, D], [images, 3]) as the per-row ``mm_*`` columns that
    :func:`verl.models.forward.forward_backward` hands the model (``verl.protocol.images``)."""
    from verl.protocol.images import pad_row_images

    patches = image_grid_thw.prod(-1).tolist()
    starts = [sum(patches[:k]) for k in range(len(patches) + 1)]
    width = max(1, max(sum(patches[k] for k in row) for row in row_images))
    most = max(1, max(len(row) for row in row_images))
    cols = []
    for row in row_images:
        pv = torch.cat([pixel_values[starts[k]:starts[k + 1]] for k in row]) if row else None
        cols.append(pad_row_images(pv, image_grid_thw[row] if row else None, patches=width, images=most,
                                   dim=pixel_values.shape[1]))
    return {k: torch.stack([c[k] for c in cols]) for k in cols[0]}


def _hf_logits(hf_dir: str, batch: dict[str, torch.Tensor], round_to: str) -> torch.Tensor:
    """transformers' float32 logits [B, T, V], weights rounded to ``round_to`` (the checkpoint's dtype)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.visual."):  # the tower is carried as stored (fp32 here)
                p.copy_(p.to(DTYPES[round_to]).float())
        return model(input_ids=ids, attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                     image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(ids == model.config.image_token_id).int(),
                     ).logits.float()


def _check_rank(ckpt_dir: str, expected_path: str, tp: int, pp: int) -> float:
    from verl.models.checkpoint import load_checkpoint
    from verl.models.forward import forward_backward
    from verl.models.megatron_vlm import build_megatron_vlm, load_vision_weights
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    vision_dir = os.path.join(ckpt_dir, VISION_SUBDIR)
    model = build_megatron_vlm(vision_dir, ModelBuildConfig(dtype="fp32", init_weights=False), pg, load_weights=False)
    load_checkpoint([model.language_model], ckpt_dir, pg=pg)
    load_vision_weights(model, SafetensorsReader(vision_dir))
    model.eval()
    data = torch.load(expected_path)
    rows = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"],
            **row_image_columns(data["pixel_values"], data["image_grid_thw"], CHECK_ROW_IMAGES)}
    # Through the pipeline schedule (any PP), one row a micro-batch; the logits are on the last stage.
    result = forward_backward([model], rows, pg=pg, micro_batch_size=1, output="logits", broadcast=False)
    diff = torch.zeros(())
    if pg.pp.rank() == pg.pp.size() - 1:
        actual = result.outputs["logits"]  # [B, T, V/TP]
        expected, mask = data["expected"], data["attention_mask"].bool()
        start = pg.tp.rank() * actual.shape[-1]
        stop = min(start + actual.shape[-1], expected.shape[-1])
        if stop > start:
            diff = (actual[..., : stop - start] - expected[..., start:stop])[mask].abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def vlm_check_conversion(*, ckpt_dir: str, hf_dir: str, tp: int, pp: int) -> float:
    """Max |logit difference| between the VLM checkpoint loaded at TP ``tp`` x PP ``pp`` and
    transformers on ``hf_dir``, on :func:`check_batch` (images of three sizes)."""
    from transformers import AutoConfig

    from verl.models.checkpoint import read_checkpoint_meta
    from verl.models.convert import _is_coordinator, _share_from_coordinator

    check_vlm_layout(ModelBuildConfig(), tp_size=tp, pp_size=pp)
    meta, spec = read_checkpoint_meta(ckpt_dir)
    transformer_config_from_hf(spec, ModelBuildConfig(), tp_size=tp, pp_size=pp)
    work = None
    if _is_coordinator():
        batch = check_batch(AutoConfig.from_pretrained(os.path.join(ckpt_dir, VISION_SUBDIR)))
        expected = _hf_logits(hf_dir, batch, meta.dtype)
        work = tempfile.mkdtemp(prefix="verl-check-vlm-")
        torch.save({**batch, "expected": expected}, os.path.join(work, "expected.pt"))
    work = _share_from_coordinator(work)
    try:
        diffs = run_on_ranks(_check_rank, tp * pp, os.path.abspath(ckpt_dir), os.path.join(work, "expected.pt"), tp, pp)
    finally:
        if under_torchrun():
            dist.barrier()
        if _is_coordinator():
            shutil.rmtree(work, ignore_errors=True)
    return max(d for d in diffs if d is not None)


def vlm_megatron_to_hf(*, megatron_dir: str, out_dir: str, dtype: str | None, overwrite: bool, max_shard_bytes: int):
    """``verl.models.convert.megatron_to_hf`` of a VLM checkpoint: the decoder's tensors under the hub's
    names, the tower's as stored (``dtype`` casts both), the model's own config and processor files."""
    from verl.models.checkpoint import HF_SUBDIR, iter_checkpoint_hf_weights, read_checkpoint_meta
    from verl.models.convert import ConversionReport, _check_storage_files, _peak_rss_mib

    meta, _ = read_checkpoint_meta(megatron_dir)
    _check_storage_files(megatron_dir)
    vision_dir = os.path.join(megatron_dir, VISION_SUBDIR)
    parse_vlm_config(vision_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}; use one of {sorted(DTYPES)}")
    check_output_dir(out_dir, key="--out-dir", inputs={"--megatron-dir": megatron_dir}, overwrite=overwrite)
    tmp_dir = staging_dir(out_dir)
    count = 0
    try:
        writer = SafetensorsWriter(tmp_dir, max_shard_bytes=max_shard_bytes)
        for name, tensor in iter_checkpoint_hf_weights(megatron_dir):
            writer.add(name, tensor if dtype is None else tensor.to(DTYPES[dtype]))
            count += 1
        reader = SafetensorsReader(vision_dir)
        for name in reader.names():
            tensor = reader.read(name)
            writer.add(name, tensor if dtype is None else tensor.to(DTYPES[dtype]))
            count += 1
        writer.finish()
        copy_side_files(os.path.join(megatron_dir, HF_SUBDIR), tmp_dir, include_config=False)
        for name in IMAGE_PROCESSOR_FILES:
            if os.path.isfile(os.path.join(vision_dir, name)):
                shutil.copy2(os.path.join(vision_dir, name), os.path.join(tmp_dir, name))
        with open(os.path.join(vision_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if dtype is not None:
            config["dtype"] = HF_DTYPE_NAMES[dtype]
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    commit_output(tmp_dir, out_dir, what="Hugging Face checkpoint of a vision-language model (tools/megatron2hf.py)")
    return ConversionReport(out_dir=os.path.abspath(out_dir), num_tensors=count, peak_rss_mib_per_rank=[_peak_rss_mib()])
