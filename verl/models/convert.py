"""Checkpoint conversion between Hugging Face and Megatron distributed checkpoints.

The logic behind ``tools/hf2megatron.py`` and ``tools/megatron2hf.py``:

- :func:`hf_to_megatron` starts TP x PP ranks (spawned here, or the ranks of an enclosing
  ``torchrun``); each builds only its model shard, reads only its slices of the safetensors
  files, checks the model against config.json, and writes its part of a reshardable
  ``megatron.core.dist_checkpointing`` checkpoint.
- :func:`check_conversion` loads a written checkpoint at a chosen TP x PP and compares the
  model's logits (or scalar-head outputs) with transformers' on a few padded token sequences;
  ``hf_to_megatron(check=True)`` runs that check on the conversion's own ranks, once every rank
  has written its part (one start of the ranks, not two).
- :func:`megatron_to_hf` streams a checkpoint back into safetensors in one process, one
  layer at a time.

Output always goes to a hidden temporary directory next to the target and is renamed into
place at the end, so an interrupted conversion never leaves a partial checkpoint under the
target name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl.models.builder import DTYPES, HF_DTYPE_NAMES, ModelBuildConfig, transformer_config_from_hf
from verl.models.hf_config import HFModelSpec, parse_hf_config
from verl.models.safetensors_io import SafetensorsReader, SafetensorsWriter, copy_side_files
from verl.models.weight_mapping import HeadKind, hf_param_names
from verl.parallel.bootstrap import init_distributed, run_on_ranks, under_torchrun
from verl.utils.outputs import check_output_dir, commit_output, staging_dir

logger = logging.getLogger(__name__)

_SEQ_CLS_ARCH = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "mixtral": "MixtralForSequenceClassification",
    "qwen2_moe": "Qwen2MoeForSequenceClassification",
}
_CAUSAL_LM_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


@dataclass(kw_only=True)
class ConversionReport:
    """What a conversion did, for the tools to print."""

    out_dir: str
    """Final output directory."""
    num_tensors: int = 0
    """Hugging Face tensors converted."""
    peak_rss_mib_per_rank: list[float] = field(default_factory=list)
    """Peak resident memory of each conversion rank (MiB)."""
    max_abs_diff: float | None = None
    """Largest |logit difference| against transformers when checked."""


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _is_coordinator() -> bool:
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def _share_from_coordinator(value: Any) -> Any:
    """Under torchrun, every rank gets rank 0's ``value``; otherwise ``value`` itself."""
    if not under_torchrun():
        return value
    init_distributed()
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------
# HF -> Megatron.
# ---------------------------------------------------------------------------------------------


def validate_hf_dir(hf_dir: str, *, head: HeadKind = "lm") -> tuple[HFModelSpec, SafetensorsReader]:
    """Parse config.json and check the weights are complete; ValueError naming what is wrong."""
    from verl.models.checkpoint import check_hf_tensors

    if not os.path.isdir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir}: no such directory")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"--hf-dir {hf_dir}: no config.json (not a Hugging Face model directory, or a partial copy)")
    spec = parse_hf_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    check_hf_tensors(reader, spec, head=head)
    return spec, reader


def _convert_rank(hf_dir: str, tmp_dir: str, tp: int, pp: int, build: ModelBuildConfig, progress: bool) -> float:
    from verl.models.builder import build_model_chunks, verify_model_matches_spec
    from verl.models.checkpoint import load_hf_weights, save_checkpoint
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    spec = parse_hf_config(hf_dir)
    chunks = build_model_chunks(spec, build, pg)
    for chunk in chunks:
        verify_model_matches_spec(chunk, pg)
    load_hf_weights(chunks, hf_dir, pg=pg, progress=progress and dist.get_rank() == 0)
    save_checkpoint(chunks, tmp_dir, pg=pg, hf_dir=hf_dir)
    return _peak_rss_mib()


def _convert_and_check_rank(hf_dir: str, tmp_dir: str, tp: int, pp: int, build: ModelBuildConfig, progress: bool,
                            expected_path: str) -> tuple[float, float]:
    """:func:`_convert_rank`, then :func:`_check_rank` on the files the ranks wrote: the model is
    built again from the checkpoint (not the converted model in memory), so the check reads what a
    later load reads. Returns (peak RSS in MiB, max |difference|)."""
    from verl.parallel.megatron_state import destroy_model_parallel

    import gc

    rss = _convert_rank(hf_dir, tmp_dir, tp, pp, build, progress)
    destroy_model_parallel()
    gc.collect()  # the converted model's memory back before the check builds its own
    dist.barrier()  # every rank's part is on disk before any rank reads the checkpoint
    return rss, _check_rank(tmp_dir, expected_path, tp, pp)


def _write_check_reference(hf_dir: str, *, vocab_size: int, max_positions: int, head: HeadKind, round_to: str) -> str:
    """transformers' outputs on :func:`check_batch`, saved for the check's ranks; returns the temporary
    folder that holds them (``expected.pt``), which the caller removes."""
    batch = check_batch(vocab_size, seq_len=min(24, max_positions))
    expected = hf_reference_outputs(hf_dir, batch, head=head, round_to=round_to)
    work = tempfile.mkdtemp(prefix="verl-check-")
    torch.save({**batch, "expected": expected}, os.path.join(work, "expected.pt"))
    return work


def _refuse_unmatched_head_check(hf_dir: str, head: str) -> None:
    if head != "lm" and "score.weight" not in SafetensorsReader(hf_dir):
        raise ValueError(
            f"--check of a {head} head needs score.weight in {hf_dir} (a *ForSequenceClassification "
            "checkpoint); an LM checkpoint gives the head a fresh initialisation there is nothing to compare with"
        )


def hf_to_megatron(
    *,
    hf_dir: str,
    out_dir: str,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "fp32",
    head: HeadKind = "lm",
    vocab_pad_multiple: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    check: bool = False,
) -> ConversionReport:
    """Convert a Hugging Face checkpoint into a Megatron distributed checkpoint at ``out_dir``.

    ``check``: then load the written checkpoint at ``tp`` x ``pp`` on the same ranks and compare its
    outputs with transformers' (:func:`check_conversion`'s comparison); the result is the report's
    ``max_abs_diff``. The checkpoint is kept whatever the difference (the caller judges it).
    """
    from verl.models.megatron_vlm import is_vlm_config

    if is_vlm_config(hf_dir):  # Qwen2.5-VL: the decoder's checkpoint plus the vision tower (verl.models.convert_vlm)
        from verl.models.convert_vlm import vlm_hf_to_megatron

        report = vlm_hf_to_megatron(hf_dir=hf_dir, out_dir=out_dir, tp=tp, pp=pp, dtype=dtype, head=head,
                                    vocab_pad_multiple=vocab_pad_multiple, overwrite=overwrite)
        if check:  # the vision tower's check has its own inputs (images): a second start of the ranks
            report.max_abs_diff = check_conversion(ckpt_dir=out_dir, hf_dir=hf_dir, tp=tp, pp=pp)
        return report
    spec, reader = validate_hf_dir(hf_dir, head=head)
    if check:
        _refuse_unmatched_head_check(hf_dir, head)  # before anything is written
    build_kwargs: dict[str, Any] = {"dtype": dtype, "head": head, "init_weights": False}
    if vocab_pad_multiple is not None:
        build_kwargs["vocab_pad_multiple"] = vocab_pad_multiple
    build = ModelBuildConfig(**build_kwargs)
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp {tp} / --pp {pp}: both must be >= 1")
    transformer_config_from_hf(spec, build, tp_size=tp, pp_size=pp)  # fails early, naming the field
    tmp_dir = work = None
    if _is_coordinator():
        check_output_dir(out_dir, key="--out-dir", inputs={"--hf-dir": hf_dir}, overwrite=overwrite)
        if check:
            work = _write_check_reference(hf_dir, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                                          head=head, round_to=dtype)
        tmp_dir = staging_dir(out_dir)
    tmp_dir, work = _share_from_coordinator((tmp_dir, work))
    diff = None
    try:
        if check:
            results = run_on_ranks(_convert_and_check_rank, tp * pp, os.path.abspath(hf_dir), tmp_dir, tp, pp, build,
                                   progress, os.path.join(work, "expected.pt"))
            results = [r for r in results if r is not None]
            rss = [r for r, _ in results]
            diff = max(d for _, d in results)
        else:
            rss = run_on_ranks(_convert_rank, tp * pp, os.path.abspath(hf_dir), tmp_dir, tp, pp, build, progress)
    except BaseException:
        if _is_coordinator():
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        if _is_coordinator() and work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if _is_coordinator():
        commit_output(tmp_dir, out_dir, what="Megatron checkpoint (tools/hf2megatron.py)")
    if under_torchrun():
        dist.barrier()
    return ConversionReport(
        out_dir=os.path.abspath(out_dir),
        num_tensors=len(reader.names()),
        peak_rss_mib_per_rank=[r for r in rss if r is not None],
        max_abs_diff=diff,
    )


# ---------------------------------------------------------------------------------------------
# Checking a converted checkpoint against transformers.
# ---------------------------------------------------------------------------------------------


def check_batch(vocab_size: int, *, seq_len: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A few token sequences for checks: one full row, one left-padded, one right-padded. [3, T]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (3, seq_len), generator=gen)
    mask = torch.ones(3, seq_len, dtype=torch.long)
    mask[1, : seq_len // 4] = 0
    mask[2, seq_len - seq_len // 6 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def hf_reference_outputs(hf_dir: str, batch: dict[str, torch.Tensor], *, head: HeadKind, round_to: str) -> torch.Tensor:
    """transformers' logits [B, T, V] (or per-token scores [B, T, 1]) in float32.

    Weights are rounded to ``round_to`` and computed in float32, so the comparison measures the
    conversion, not the precision of the stored dtype.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from verl.models.forward import position_ids_from_mask

    cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    model = cls.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(DTYPES[round_to]).float())
        kwargs = dict(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids_from_mask(batch["attention_mask"]),
        )
        if head == "lm":
            return model(**kwargs).logits.float()
        hidden = model.model(**kwargs).last_hidden_state
        return model.score(hidden).float()


def _check_rank(ckpt_dir: str, expected_path: str, tp: int, pp: int) -> float:
    from verl.models.builder import build_model_chunks
    from verl.models.checkpoint import load_checkpoint, read_checkpoint_meta
    from verl.models.forward import forward_backward
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    meta, spec = read_checkpoint_meta(ckpt_dir)
    chunks = build_model_chunks(spec, ModelBuildConfig(dtype="fp32", head=meta.head, init_weights=False), pg)
    load_checkpoint(chunks, ckpt_dir, pg=pg)
    for chunk in chunks:
        # An inference pass, as transformers' side is: in training mode Megatron's MoE layer refuses
        # TP > 1 without sequence parallelism (a training-speed rule), which --check does not need.
        chunk.eval()
    data = torch.load(expected_path)
    batch = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    kind = "logits" if meta.head == "lm" else "values"
    result = forward_backward(chunks, batch, pg=pg, micro_batch_size=1, output=kind, broadcast=False)
    diff = torch.zeros(())
    if pg.pp.rank() == pg.pp.size() - 1:
        mask = batch["attention_mask"].bool()
        expected = data["expected"]
        if kind == "logits":
            actual = result.outputs["logits"].float()  # [B, T, V/TP]
            start = pg.tp.rank() * actual.shape[-1]
            stop = min(start + actual.shape[-1], spec.vocab_size)
            if stop > start:
                diff = (actual[..., : stop - start] - expected[..., start:stop])[mask].abs().max()
        else:
            diff = (result.outputs["values"] - expected.squeeze(-1))[mask].abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def check_conversion(*, ckpt_dir: str, hf_dir: str, tp: int, pp: int) -> float:
    """Max |logit difference| between the checkpoint loaded at TP x PP and transformers on ``hf_dir``."""
    from verl.models.checkpoint import read_checkpoint_meta
    from verl.models.convert_vlm import is_vlm_checkpoint, vlm_check_conversion

    if is_vlm_checkpoint(ckpt_dir):
        return vlm_check_conversion(ckpt_dir=ckpt_dir, hf_dir=hf_dir, tp=tp, pp=pp)

    meta, spec = read_checkpoint_meta(ckpt_dir)
    _refuse_unmatched_head_check(hf_dir, meta.head)
    work = None
    if _is_coordinator():
        work = _write_check_reference(hf_dir, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                                      head=meta.head, round_to=meta.dtype)
    work = _share_from_coordinator(work)
    try:
        diffs = run_on_ranks(_check_rank, tp * pp, os.path.abspath(ckpt_dir), os.path.join(work, "expected.pt"), tp, pp)
    finally:
        if under_torchrun():
            dist.barrier()
        if _is_coordinator():
            shutil.rmtree(work, ignore_errors=True)
    return max(d for d in diffs if d is not None)


# ---------------------------------------------------------------------------------------------
# Megatron -> HF.
# ---------------------------------------------------------------------------------------------


def _check_storage_files(ckpt_dir: str) -> None:
    """Every data file the checkpoint's metadata references must exist (catches partial copies)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        raise ValueError(f"{ckpt_dir}: .metadata is missing — not a complete distributed checkpoint")
    storage = dcp.FileSystemReader(ckpt_dir).read_metadata().storage_data or {}
    files = {getattr(info, "relative_path", None) for info in storage.values()}
    missing = sorted(f for f in files if f and not os.path.isfile(os.path.join(ckpt_dir, f)))
    if missing:
        raise ValueError(f"{ckpt_dir}: data files {', '.join(missing)} are missing (an interrupted copy?)")




def find_megatron_model(path: str) -> str:
    """The Megatron model checkpoint (the folder holding ``verl_model.json``) that ``path`` names.

    Accepts the model folder itself (what tools/hf2megatron.py writes, or ``global_step_N/actor/model``),
    an engine checkpoint (``global_step_N/actor``: its ``model/``) and a trainer checkpoint
    (``global_step_N``: the actor's model, or its only role's). A checkpoint root with
    ``global_step_*`` folders, or a step with several roles and no actor, is a ValueError naming the
    exact folder to pass; anything else is returned as given, for :func:`read_checkpoint_meta` to judge.
    """
    from verl.models.checkpoint import META_FILE
    from verl.utils.checkpoint import MODEL_SUBDIR, TRAINED_MODEL_ROLE, step_of_dir_name

    given = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(given) or os.path.isfile(os.path.join(given, META_FILE)):
        return given
    if os.path.isfile(os.path.join(given, MODEL_SUBDIR, META_FILE)):
        return os.path.join(given, MODEL_SUBDIR)
    names = sorted(os.listdir(given))
    roles = [n for n in names if os.path.isfile(os.path.join(given, n, MODEL_SUBDIR, META_FILE))]
    if roles:
        role = TRAINED_MODEL_ROLE if TRAINED_MODEL_ROLE in roles else roles[0] if len(roles) == 1 else None
        if role is None:
            choices = " or ".join(os.path.join(given, r, MODEL_SUBDIR) for r in roles)
            raise ValueError(f"{given} holds the models of {', '.join(roles)}; pass one of them: {choices}")
        chosen = os.path.join(given, role, MODEL_SUBDIR)
        others = [os.path.join(given, r, MODEL_SUBDIR) for r in roles if r != role]
        logger.info("%s is a training checkpoint: converting its %s model %s%s", given, role, chosen,
                    f" (also there: {', '.join(others)})" if others else "")
        return chosen
    steps = sorted((step, n) for n in names if (step := step_of_dir_name(n)) is not None)
    if steps:
        newest = os.path.join(given, steps[-1][1])
        raise ValueError(
            f"{given} holds the checkpoints of {len(steps)} training step(s); pass one step, e.g. the newest: "
            f"--megatron-dir {newest} (its {TRAINED_MODEL_ROLE} model, {os.path.join(newest, TRAINED_MODEL_ROLE, MODEL_SUBDIR)})"
        )
    return given


def megatron_to_hf(
    *,
    megatron_dir: str,
    out_dir: str,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = True,
) -> ConversionReport:
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) from a verl Megatron checkpoint.

    ``megatron_dir`` may also be a training checkpoint (:func:`find_megatron_model`). ``dtype`` None
    keeps the stored dtype (the round trip HF -> Megatron -> HF is then bit-exact).
    """
    from verl.models.checkpoint import HF_SUBDIR, iter_checkpoint_hf_weights, read_checkpoint_meta
    from verl.utils.checkpoint import validate_enclosing_checkpoint

    megatron_dir = find_megatron_model(megatron_dir)

    validate_enclosing_checkpoint(megatron_dir)  # inside a trainer checkpoint: its checksums hold
    from verl.models.convert_vlm import is_vlm_checkpoint, vlm_megatron_to_hf

    if is_vlm_checkpoint(megatron_dir):
        return vlm_megatron_to_hf(megatron_dir=megatron_dir, out_dir=out_dir, dtype=dtype, overwrite=overwrite,
                                  max_shard_bytes=max_shard_bytes)
    meta, spec = read_checkpoint_meta(megatron_dir)
    _check_storage_files(megatron_dir)
    out_dtype = dtype or meta.dtype
    if out_dtype not in DTYPES:
        raise ValueError(f"--dtype {out_dtype!r}; use one of {sorted(DTYPES)}")
    check_output_dir(out_dir, key="--out-dir", inputs={"--megatron-dir": megatron_dir}, overwrite=overwrite)
    tmp_dir = staging_dir(out_dir)
    try:
        writer = SafetensorsWriter(tmp_dir, max_shard_bytes=max_shard_bytes)
        items = iter_checkpoint_hf_weights(megatron_dir)
        total = len(hf_param_names(spec, head=meta.head))
        if progress:
            from tqdm import tqdm

            items = tqdm(items, total=total, desc="megatron -> HF", unit="tensor")
        count = 0
        for name, tensor in items:
            writer.add(name, tensor.to(DTYPES[out_dtype]))
            del tensor
            count += 1
        writer.finish()
        copy_side_files(os.path.join(megatron_dir, HF_SUBDIR), tmp_dir, include_config=False)
        config = dict(spec.raw)
        config["dtype"] = HF_DTYPE_NAMES[out_dtype]
        if "torch_dtype" in config:
            config["torch_dtype"] = HF_DTYPE_NAMES[out_dtype]
        if meta.head == "lm":
            config.setdefault("architectures", [_CAUSAL_LM_ARCH[spec.model_type]])
        else:
            config["architectures"] = [_SEQ_CLS_ARCH[spec.model_type]]
            config["num_labels"] = 1
            config["id2label"] = {"0": "LABEL_0"}
            config["label2id"] = {"LABEL_0": 0}
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    commit_output(tmp_dir, out_dir, what="Hugging Face checkpoint (tools/megatron2hf.py)")
    return ConversionReport(out_dir=os.path.abspath(out_dir), num_tensors=count, peak_rss_mib_per_rank=[_peak_rss_mib()])


@contextlib.contextmanager
def quiet_megatron_warnings():
    """Silence the warnings Megatron and torch.distributed.checkpoint print on every run (tools only).

    They concern apex/Transformer Engine being absent and deprecations inside those libraries,
    nothing a user of the tools can act on.
    """
    import warnings

    saved = os.environ.get("PYTHONWARNINGS")
    # Spawned ranks start a fresh interpreter: they read the filters from the environment.
    os.environ["PYTHONWARNINGS"] = "ignore::FutureWarning,ignore::UserWarning"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved
