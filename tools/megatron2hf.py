#!/usr/bin/env python
"""Convert a verl Megatron distributed checkpoint back into a Hugging Face checkpoint.

    python tools/megatron2hf.py --megatron-dir CKPT_DIR --out-dir HF_DIR [--dtype bf16]

Writes safetensors shards, config.json and the tokenizer/generation files stored with the
checkpoint, loadable by AutoModelForCausalLM.from_pretrained (critic and reward checkpoints
become *ForSequenceClassification with one label). Runs in one process and reads one layer at
a time. Without --dtype the stored dtype is kept, so HF -> Megatron -> HF is bit-exact. The
logic lives in verl.models.convert.
"""

from __future__ import annotations

import argparse
import logging
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--megatron-dir", required=True, help="checkpoint written by tools/hf2megatron.py or by verl training")
    parser.add_argument("--out-dir", required=True, help="where the Hugging Face model goes; written to a hidden temporary sibling and renamed at the end")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="dtype of the written tensors (default: the checkpoint's)")
    parser.add_argument("--max-shard-gib", type=float, default=2.0, help="largest safetensors file in GiB (default 2)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out-dir if it exists (only once the new model is complete)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verl.models.convert import megatron_to_hf, quiet_megatron_warnings
    from verl.utils.logging import setup_logging

    setup_logging(logging.WARNING)
    with quiet_megatron_warnings():
        try:
            report = megatron_to_hf(
                megatron_dir=args.megatron_dir,
                out_dir=args.out_dir,
                dtype=args.dtype,
                overwrite=args.overwrite,
                max_shard_bytes=int(args.max_shard_gib * 1024**3),
                progress=not args.no_progress,
            )
        except ValueError as exc:
            print(f"megatron2hf: error: {exc}", file=sys.stderr)
            return 2
    print(f"wrote {report.out_dir} ({report.num_tensors} tensors), peak_rss_mib={report.peak_rss_mib_per_rank[0]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
