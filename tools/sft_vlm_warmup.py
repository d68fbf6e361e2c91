"""Supervised warm-up of a vision-language model on an RL prompt file, in one process.

    python tools/sft_vlm_warmup.py --model DIR --data train.parquet --out DIR [--val test.parquet] [--steps 60]
    python tools/sft_vlm_warmup.py --eval-only --model DIR --val test.parquet   # a trained model's accuracy

Trains the model (vision encoder included) on each prompt with its images followed by the row's
reference response (``extra_info.answer``) and end of sequence; the loss is on the response only.
Writes the model, tokenizer and image processor to ``--out`` and, with ``--val``, prints the greedy
and the sampled (temperature 1) accuracy of each validation file by its rule scorer. The prompts
are read as the RL trainer reads them (``RLPromptDataset`` with the model's processor), so the
warm-up sees exactly the RL prompts' tokens and pixels. (``verl.trainer.main_sft`` trains a VLM too: docs/vlm.md, "SFT of a VLM".)
"""

import argparse
import logging
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from verl.utils.cli import positive_int, user_errors  # noqa: E402
from verl.utils.logging import setup_logging  # noqa: E402

logger = logging.getLogger("tools.sft_vlm_warmup")


def _collate(items, tokenizer, answers=None):
    """Left-padded ids [B, T], attention mask [B, T], labels [B, T] (answers given) and the images' inputs."""
    from verl.protocol.images import model_image_inputs

    seqs, labels = [], []
    for i, item in enumerate(items):
        prompt = list(item["raw_prompt_ids"])
        answer = [] if answers is None else tokenizer(answers[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    target = torch.tensor([[-100] * (width - len(s)) + s for s in labels])
    images = model_image_inputs({k: torch.stack([item[k] for item in items]) for k in ("mm_pixel_values", "mm_image_grid_thw")})
    return ids, mask, target, images


@torch.no_grad()
def accuracy(model, dataset, tokenizer, *, sample: bool, batch: int = 64, seed: int = 0) -> float:
    """Mean rule score of one response per prompt of ``dataset`` (greedy, or sampled at temperature 1)."""
    from verl.rewards import default_compute_score

    model.eval()
    torch.manual_seed(seed)
    scores = []
    for start in range(0, len(dataset), batch):
        items = [dataset[i] for i in range(start, min(start + batch, len(dataset)))]
        ids, mask, _, images = _collate(items, tokenizer)
        out = model.generate(input_ids=ids, attention_mask=mask, **images, max_new_tokens=4, do_sample=sample,
                             temperature=1.0 if sample else None, top_p=None, top_k=None,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for item, row in zip(items, out[:, ids.shape[1]:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            score = default_compute_score(item["data_source"], text, item["reward_model"]["ground_truth"])
            scores.append(float(score["score"] if isinstance(score, dict) else score))
    model.train()
    return sum(scores) / len(scores)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="vision-language model directory (config, weights, processor)")
    p.add_argument("--data", help="RL prompt file with images and extra_info.answer (required unless --eval-only)")
    p.add_argument("--out", help="where the warmed-up model is written (required unless --eval-only)")
    p.add_argument("--eval-only", action="store_true",
                   help="train nothing: print the accuracy of --model on each --val file (e.g. a main_sft export)")
    p.add_argument("--val", action="append", default=[], help="validation file(s) whose accuracy is printed")
    p.add_argument("--steps", type=positive_int, default=60, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=32, help="prompts per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate, constant (default %(default)s)")
    p.add_argument("--max-prompt-length", type=positive_int, default=64, help="prompt token budget (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches (default %(default)s)")
    args = p.parse_args(argv)
    if not args.eval_only and (args.data is None or args.out is None):
        p.error("--data and --out are required (or --eval-only to score --model on the --val files)")
    setup_logging()
    with user_errors(p.prog):
        from transformers import AutoModelForImageTextToText

        from verl.data.rl_dataset import RLPromptDataset
        from verl.data.vlm import ImagePromptEncoder, is_vlm_dir

        if not is_vlm_dir(args.model):
            raise ValueError(f"--model {args.model}: not a vision-language model directory (config.json with a "
                             "vision_config and preprocessor_config.json)")
        encoder = ImagePromptEncoder.from_pretrained(args.model)
        tokenizer = encoder.tokenizer
        if args.eval_only:
            model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
            for path in args.val:
                val = RLPromptDataset(path, tokenizer, processor=encoder, max_prompt_length=args.max_prompt_length)
                print(f"== SFT model on {os.path.basename(path)}: greedy accuracy "
                      f"{accuracy(model, val, tokenizer, sample=False):.3f}, sampled (temperature 1) "
                      f"{accuracy(model, val, tokenizer, sample=True):.3f}", flush=True)
            return
        data = RLPromptDataset(args.data, tokenizer, processor=encoder, max_prompt_length=args.max_prompt_length)
        answers = [str((data[i]["extra_info"] or {}).get("answer", "")) for i in range(len(data))]
        if not all(answers):
            raise ValueError(f"--data {args.data}: rows without extra_info.answer (the reference response); add it")
        vals = [RLPromptDataset(v, tokenizer, processor=encoder, max_prompt_length=args.max_prompt_length) for v in args.val]
        torch.manual_seed(args.seed)
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
        model.train()
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        rng = random.Random(args.seed)
        started = time.time()
        for step in range(1, args.steps + 1):
            rows = [rng.randrange(len(data)) for _ in range(args.batch)]
            ids, mask, labels, images = _collate([data[i] for i in rows], tokenizer, [answers[i] for i in rows])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, **images).loss
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            if step == 1 or step % 20 == 0 or step == args.steps:
                logger.info("sft step %d/%d: loss %.4f (%.1f s)", step, args.steps, loss.item(), time.time() - started)
        for path, val in zip(args.val, vals):
            print(f"== SFT model on {os.path.basename(path)}: greedy accuracy {accuracy(model, val, tokenizer, sample=False):.3f}, "
                  f"sampled (temperature 1) {accuracy(model, val, tokenizer, sample=True):.3f}", flush=True)
        os.makedirs(args.out, exist_ok=True)
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        encoder.image_processor.save_pretrained(args.out)
        print(f"== SFT model: {os.path.abspath(args.out)} ({args.steps} steps, {time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
