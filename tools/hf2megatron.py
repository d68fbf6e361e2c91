#!/usr/bin/env python
"""Convert a Hugging Face checkpoint (Llama, Qwen2, Qwen3, Mistral; MoE: Qwen3-MoE, Mixtral, Qwen2-MoE)
into a Megatron distributed checkpoint.

    python tools/hf2megatron.py --hf-dir HF_DIR --out-dir CKPT_DIR --tp 2 --pp 2 [--dtype bf16] [--check]

The checkpoint is reshardable: one written at --tp 2 --pp 1 loads at TP=1, PP=2 (or any layout
whose sizes divide the model). Runs --tp x --pp ranks itself, or uses the ranks of an enclosing
`torchrun --nproc-per-node <tp*pp>`. The logic lives in verl.models.convert.
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_TOLERANCE = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from verl.utils.cli import non_negative_float, positive_int

    parser = argparse.ArgumentParser(
        prog="hf2megatron",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + *.safetensors; tokenizer files are copied along)")
    parser.add_argument("--out-dir", required=True, help="where the Megatron checkpoint goes; written to a hidden temporary sibling and renamed at the end")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size used to write (and to --check) (default 1)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size used to write (and to --check) (default 1)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the stored tensors (default fp32)")
    parser.add_argument("--head", choices=["lm", "value", "reward"], default="lm",
                        help="lm: actor/reference model; value: critic; reward: reward model. value/reward take score.weight "
                             "from a *ForSequenceClassification checkpoint, or start a fresh head from an LM (default lm)")
    parser.add_argument("--vocab-pad-multiple", type=positive_int, default=None,
                        help="pad the vocabulary to a multiple of this times --tp (default: vLLM's padding, a multiple of 64 "
                             "and of --tp, so rollout engines at the same TP hold the same rows; padded rows are zero and never used)")
    parser.add_argument("--check", action="store_true",
                        help="after writing, load the checkpoint at --tp x --pp and compare logits with transformers on a few "
                             "token sequences; prints max_abs_diff=<float> and exits 1 above --tolerance")
    parser.add_argument("--tolerance", type=non_negative_float, default=DEFAULT_TOLERANCE,
                        help=f"--check threshold on the max absolute logit difference, float32 compute on both sides with weights "
                             f"rounded to --dtype (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--overwrite", action="store_true", help="replace --out-dir if verl wrote it (only once the new checkpoint is complete); a folder verl did not write is never replaced")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verl.models.convert import hf_to_megatron, quiet_megatron_warnings
    from verl.parallel.bootstrap import under_torchrun
    from verl.utils.cli import user_errors
    from verl.utils.logging import global_rank, setup_logging
    from verl.utils.progress import bar_allowed

    setup_logging(logging.WARNING)
    show = not under_torchrun() or global_rank() == 0
    with quiet_megatron_warnings(), user_errors("hf2megatron"):
        report = hf_to_megatron(
            hf_dir=args.hf_dir,
            out_dir=args.out_dir,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            head=args.head,
            vocab_pad_multiple=args.vocab_pad_multiple,
            overwrite=args.overwrite,
            progress=not args.no_progress and bar_allowed(),  # a bar on a terminal only, never in a log
            check=args.check,  # on the conversion's own ranks, after every rank has written its part
        )
        if show:
            rss = report.peak_rss_mib_per_rank
            print(f"wrote {report.out_dir} ({report.num_tensors} HF tensors, tp={args.tp} pp={args.pp}, {args.dtype})")
            if rss:
                print(f"peak_rss_mib_per_rank={','.join(f'{r:.0f}' for r in rss)} max={max(rss):.0f} sum={sum(rss):.0f}")
    if not args.check:
        return 0
    diff = report.max_abs_diff
    if show:
        print(f"max_abs_diff={diff:.6g}")
        if diff > args.tolerance:
            print(f"check FAILED: max_abs_diff {diff:.6g} > tolerance {args.tolerance:g}", file=sys.stderr)
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
