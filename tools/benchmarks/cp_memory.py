"""``bench.py cp-memory``: activation bytes per rank of one training micro-batch at context parallel 1 and 2.

Builds a small Megatron actor with verl's builder (``MegatronEngine``; a llama of ``--hidden``,
``--layers``, ``--heads`` made locally) on 2 gloo ranks, once at CP 1 (data parallel 2, each rank the
whole micro-batch) and once at CP 2 (the micro-batch's sequences split over the two ranks), and runs
one training step of ``--rows`` sequences of ``--seq-len`` tokens under
``verl.planning.activations.SavedTensorMeter``: the peak bytes autograd holds for backward on a rank.
Reports both peaks and their ratio (CP 2 / CP 1). Not 0.5: without Transformer Engine each CP rank
gathers the whole sequence's keys and values (``verl.models.cp_attention``) and keeps its unfused
attention's ``[S/CP, S]`` scores, and the log-probabilities are gathered over CP for the loss.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from typing import Any

from tools.benchmarks.harness import Runner, subcommand

logger = logging.getLogger("tools.benchmarks.cp_memory")

MIB = 2**20


def cp_activation_peaks(model_dir: str, *, seq_len: int, rows: int, pack: bool = False) -> dict[str, Any]:
    """Peak saved-for-backward bytes per rank at CP 1 and CP 2 on 2 ranks, and their ratio."""
    from verl.planning.activations import measure_step_activations
    from verl.testing.distributed import run_distributed

    out: dict[str, Any] = {}
    for cp in (1, 2):
        ranks = run_distributed(measure_step_activations, 2, model_dir, cp=cp, seq_len=seq_len, rows=rows, pack=pack,
                                timeout=1800)
        out[f"cp{cp}"] = {"peak_bytes": max(r["peak_bytes"] for r in ranks),
                          "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
                          "left_bytes": max(r["left_bytes"] for r in ranks), "loss": ranks[0]["loss"],
                          "tokens_per_rank": ranks[0]["tokens_on_rank"]}
    out["ratio"] = out["cp2"]["peak_bytes"] / out["cp1"]["peak_bytes"]
    return out


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def _cp_memory(args: argparse.Namespace) -> dict[str, Any]:
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
    out: dict[str, Any] = {"bench": "cp-memory", "model": {"family": "llama", **shape}, "seq_len": args.seq_len,
                           "rows": args.rows, "packed": args.packed, "dtype": "float32", "ranks": 2,
                           "machine": _cpu_name()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(os.path.join(tmp, "model"), TinyModelSpec(
            family="llama", **shape, max_position=max(1024, args.seq_len), corpus_lines=300, seed=1))
        out.update(cp_activation_peaks(model_dir, seq_len=args.seq_len, rows=args.rows, pack=args.packed))
    logger.info("cp-memory: %d x %d tokens, activations per rank CP1 %.1f MiB, CP2 %.1f MiB (x%.3f)",
                args.rows, args.seq_len, out["cp1"]["peak_bytes"] / MIB, out["cp2"]["peak_bytes"] / MIB, out["ratio"])
    return out


@subcommand("cp-memory", "activation bytes per rank of one micro-batch at context parallel 1 and 2 (2 gloo ranks)")
def _cp_memory_cmd(p: argparse.ArgumentParser) -> Runner:
    p.description = __doc__
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default %(default)s)")
    p.add_argument("--rows", type=int, default=1, help="sequences in the micro-batch (default %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    p.add_argument("--packed", action="store_true", help="packed sequences (model.use_remove_padding=true)")
    return _cp_memory
