"""verl: reinforcement-learning post-training for LLMs on Megatron-core and vLLM."""

__version__ = "0.1.0"
