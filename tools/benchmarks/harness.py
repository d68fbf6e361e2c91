"""The benchmarks' shared harness: the subcommand registry, argument helpers, the made model and
prompts, the RL config of a bench run, the machine record, the world start and the JSON output.

Imported before anything that may import vLLM: it sets the environment that keeps vLLM's log
handlers off stdout, which carries the one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# Before vLLM is imported: its log handlers would write to stdout, which carries the JSON.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from verl.utils.cli import hf_model_dir, positive_int  # after the env

Runner = Callable[[argparse.Namespace], dict[str, Any]]
ParserBuilder = Callable[[argparse.ArgumentParser], Runner]
SUBCOMMANDS: dict[str, tuple[str, ParserBuilder]] = {}


def subcommand(name: str, help: str) -> Callable[[ParserBuilder], ParserBuilder]:
    """Register ``fn(parser) -> runner`` as ``bench.py <name>``."""

    def deco(fn: ParserBuilder) -> ParserBuilder:
        if name in SUBCOMMANDS:
            raise ValueError(f"bench subcommand {name!r} registered twice")
        SUBCOMMANDS[name] = (help, fn)
        return fn

    return deco


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def is_rank_zero() -> bool:
    """Rank 0 of a torchrun world, or a plain process (``RANK`` unset)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def bench_world(**init: Any) -> Iterator[None]:
    """A world started through ``verl.parallel.bootstrap`` (the one place worlds start:
    ``init_distributed(**init)``), torn down on exit with ``destroy_distributed``."""
    from verl.parallel.bootstrap import destroy_distributed, init_distributed

    init_distributed(**init)
    try:
        yield
    finally:
        destroy_distributed()


def bench_inputs(root: str, *, hidden: int, layers: int, heads: int, prompts: int, seed: int = 0) -> dict[str, str]:
    """A tiny Qwen2 (made locally, random weights) and arithmetic prompts under ``root`` (made once,
    reused when present): ``{"model": dir, "train": parquet}``."""
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    model = os.path.join(root, f"qwen2-h{hidden}-l{layers}-a{heads}")
    if not os.path.isfile(os.path.join(model, "config.json")):
        make_tiny_model(model, TinyModelSpec(family="qwen2", hidden=hidden, layers=layers, heads=heads,
                                             kv_heads=heads, seed=seed), overwrite=True)
    train = os.path.join(root, f"arithmetic-2digit-{prompts}.parquet")
    if not os.path.isfile(train):
        records, _ = arithmetic.generate_splits(train=prompts, val=0, digits=2, seed=seed)
        write_parquet(records, train)
    return {"model": model, "train": train}


def made_model_arguments(p: argparse.ArgumentParser, made: str) -> None:
    """``--model`` or the made one's folder and shape (``bench_inputs``)."""
    p.add_argument("--model", type=hf_model_dir, default=None, help="a Hugging Face model directory (default: made)")
    p.add_argument("--inputs", default=None, help=f"folder to make (once) {made} in (default: a temp dir)")
    p.add_argument("--hidden", type=positive_int, default=64, help="made model's hidden size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="made model's layers (default %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="made model's heads (default %(default)s)")



def rl_config(config: str, overrides: list[str], root: str, world: int):
    """The PPO config for a bench run: checkpoints, validation and logging off (they are not part of a
    step), outputs in ``root``; the user's overrides last, so they win."""
    from verl.config import PPOConfig, load_config

    quiet = [
        "trainer.logger=[]", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.save_hf=false", "trainer.resume_mode=disable", "trainer.report_freq=0",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/logs",
        f"trainer.n_gpus_per_node={world}", "trainer.nnodes=1", "data.val_files=null",
    ]
    return load_config(PPOConfig, config_file=config, overrides=[*quiet, *overrides], world_size=world)


def machine() -> dict[str, Any]:
    """What a figure was measured on: CPU model, its matrix-relevant flags, cores, library versions."""
    import platform

    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "load_average": list(os.getloadavg()), "torch": torch.__version__}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
        info["cpu"] = model or info["cpu"]
        info["cpu_flags"] = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                                              "amx_bf16", "amx_tile", "amx_int8"))
    except OSError:
        pass
    for name in ("vllm", "megatron.core", "transformers", "trl"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", None)
        except ImportError:
            info[name] = None
    return info



def write_result(result: dict[str, Any]) -> None:
    """The result as one JSON line on stdout, from rank 0 only (under torchrun every rank has the
    gathered result)."""
    if is_rank_zero():
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
