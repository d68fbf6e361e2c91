"""Megatron-core GPT models built from Hugging Face configs (Llama, Qwen2, Mistral families).

- :mod:`verl.models.hf_config` — parse/validate config.json (``parse_hf_config``).
- :mod:`verl.models.builder` — ``ModelBuildConfig``, ``build_model_chunks``.
- :mod:`verl.models.heads` — ``ScalarHead`` (critic values, reward scores).
- :mod:`verl.models.weight_mapping` — the HF <-> Megatron weight layout, in one place.
- :mod:`verl.models.checkpoint` — HF loading, HF export iterators, distributed checkpoints.
- :mod:`verl.models.forward` — micro-batched logprobs / entropy / values through the pipeline.
- :mod:`verl.models.vocab_parallel` — logprob and entropy from vocabulary-parallel logits.
- :mod:`verl.models.convert` — the conversion tools' logic (hf2megatron / megatron2hf).

Submodules import Megatron-core lazily where they can, so ``import verl.models`` stays cheap.
"""
