"""Make a tiny, randomly initialised Hugging Face model and tokenizer offline.

    python tools/make_tiny_model.py --family qwen2 --out /tmp/tiny-qwen2

The defaults (hidden 64, 2 layers, 2 heads of size 32, 1 KV head, float32) load in
transformers and in the CPU build of vLLM. The same arguments and seed write identical files.
"""

from __future__ import annotations

import argparse
import logging

from verl.data.tiny_model import FAMILIES, TinyModelSpec, make_tiny_model
from verl.utils.cli import user_errors
from verl.utils.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    defaults = TinyModelSpec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, required=True, help="model architecture")
    p.add_argument("--out", required=True, help="output directory (created if missing; an existing one must be empty)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out, replacing the files of the same names")
    p.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size (default %(default)s)")
    p.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers (default %(default)s)")
    p.add_argument(
        "--heads",
        type=int,
        default=defaults.heads,
        help="attention heads; hidden/heads must be 32, 64, 80, ... for CPU vLLM (default %(default)s)",
    )
    p.add_argument(
        "--kv-heads",
        type=int,
        default=defaults.kv_heads,
        help="key/value heads, must divide --heads (default %(default)s)",
    )
    p.add_argument(
        "--head-dim",
        type=int,
        default=defaults.head_dim,
        help="per-head width, 0 for hidden/heads (Qwen3 sets it apart from the hidden size; default %(default)s)",
    )
    p.add_argument(
        "--intermediate",
        type=int,
        default=defaults.intermediate,
        help="MLP size, 0 for 4*hidden (default %(default)s)",
    )
    p.add_argument("--experts", type=int, default=defaults.experts,
                   help="qwen3_moe, mixtral, qwen2_moe: routed experts per layer (default %(default)s)")
    p.add_argument("--experts-per-token", type=int, default=defaults.experts_per_token,
                   help="qwen3_moe, mixtral, qwen2_moe: experts each token is routed to (default %(default)s)")
    p.add_argument(
        "--vocab",
        type=int,
        default=defaults.vocab,
        help="maximum tokenizer vocabulary; BPE stops earlier when the corpus runs out of merges "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-position",
        type=int,
        default=defaults.max_position,
        help="max_position_embeddings (default %(default)s)",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and the LM head")
    p.add_argument(
        "--corpus-lines",
        type=int,
        default=defaults.corpus_lines,
        help="lines of generated text to train the tokenizer on (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed for corpus and weights (default %(default)s)"
    )
    args = p.parse_args(argv)
    setup_logging(logging.INFO)
    spec = TinyModelSpec(
        family=args.family,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        experts=args.experts,
        experts_per_token=args.experts_per_token,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position=args.max_position,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
        corpus_lines=args.corpus_lines,
    )
    with user_errors(p.prog):
        make_tiny_model(args.out, spec, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
