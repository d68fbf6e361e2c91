"""Helper run in a subprocess by test_tiny_model.py: greedy generation with the CPU vLLM build.

Usage: python vllm_generate.py MODEL_DIR OUT_JSON. Writes the prompt ids, generated ids and
their logprobs.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model_dir, out_path = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 37+45?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    (request,) = llm.generate([{"prompt_token_ids": prompt_ids}], params)
    sample = request.outputs[0]
    token_ids = list(sample.token_ids)
    logprobs = [step[t].logprob for step, t in zip(sample.logprobs, token_ids, strict=True)]
    with open(out_path, "w") as f:
        json.dump({"prompt_ids": prompt_ids, "token_ids": token_ids, "logprobs": logprobs}, f)


if __name__ == "__main__":
    main()
