#!/usr/bin/env bash
# The CUDA checks in one run, for a lent GPU machine (one H200; about ten minutes in all).
#
#   here, once:        bash tools/gpu_check.sh --wheels      # download what the GPU image lacks into .whl/
#   on the machine:    bash tools/gpu_check.sh [OUT_DIR]     # default $OUT, else /tmp/verl-gpu-check
#
# The device tool's call (the repository root travels; .whl is git-ignored, so it is carried):
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# The GPU image has python3 (3.12) with a CUDA torch, nvcc, cmake, ninja, pytest and
# transformers, and no network; megatron-core and the few pure-Python packages verl needs beside
# them travel as wheels (--wheels, on a machine with the package registry). vLLM does not travel
# (its CUDA wheel is too large), so the rollout here is the transformers engine.
#
# Steps, each with its own time limit, each logged to OUT_DIR/gpu_check.log and summed up in
# OUT_DIR/summary.txt (one line per step: name, exit status, seconds):
#   env          nvidia-smi, torch's CUDA build and device
#   build        verl._C with the CUDA kernels (setup.py build_ext --inplace, nvcc)
#   csrc         the kernels' tests on cpu and cuda (byte copy, shard copy, range copy; the hypothesis
#                property tests on both devices), and the first refusal of verl._C in a fresh
#                interpreter with tensors on each device (the one GPU run's crash)
#   engine       Megatron engine on the GPU, one rank (NCCL): bf16 with fp32 master weights,
#                clipping, the loss contract, packed sequences (use_remove_padding) equal to padded
#   rl-step      tools/bench.py rl-step on the tiny default on the GPU (transformers rollout,
#                trainer.device=cuda): phases, tokens/s, peak memory, MFU per phase against the GPU table
#   rollout      tools/bench.py rollout on the GPU: generation tokens/s and the rollout-vs-trainer
#                (Megatron) logprob agreement
#   fsdp2        the FSDP2 engine on one CUDA rank (NCCL): bf16 compute over fp32 shards,
#                CPUOffloadPolicy, and fsdp_config.param_offload/optimizer_offload against the fp32 run
#                (the offload keys unrun on a GPU yet)
#   fsdp2-critic the FSDP2 critic (critic.strategy=fsdp2) on one CUDA rank against the Megatron critic
#                (unrun yet; the push to a rollout apart, GatheredSend, needs 2 GPUs and is not covered)
#   soak         tools/bench.py soak, 30 short steps with a save every 10 on the GPU: RSS and
#                device memory (allocated, reserved) per step and their drift
#   agent        the agent loop's tests with the transformers engine on the GPU (tool calls, log-probs)
#   moe          Megatron's MoE layers (Qwen3-MoE, Qwen2-MoE) on one CUDA rank without Transformer Engine against
#                transformers; the uneven pipeline split against Megatron's own functions (unrun yet)
#   moe-r3       R3 router replay: the transformers engine's and vLLM's recorded experts on CUDA
#                against a CPU recomputation (vLLM: enable_return_routed_experts, Model Runner V2; unrun yet)
#   async        the streaming rollout on the GPU (trainer.rollout_mode=async, bound 2; one rank, so
#                colocated: generation ahead inside the update window, the CUDA engine's weights
#                synced before the update); tools/bench.py async needs 2 GPUs (NCCL, a rank each)
#   async-partial the same with partial rollout (segments of 8 tokens resumed from their prefix under
#                the new weights, each token's policy version recorded; unrun on a GPU yet). The
#                free-running generator (async_training.free_running: a thread on ranks that only
#                generate) needs the rollout apart, so 2 GPUs (NCCL, a rank each), like bench.py async:
#                not covered on one GPU
#   role-world-threads torch's default-group slots answering per thread (verl.parallel.role_world,
#                which the free-running generator's thread relies on) on the GPU image's torch (unrun yet)
#   lora         LoRA adapters on a bf16 Megatron engine on one CUDA rank (NCCL): fp32 masters of the
#                adapters only, base bit-identical after a step, bf16 vs fp32 LoRA engine (unrun yet)
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ "${1:-}" = "--wheels" ]; then
  # Python 3.12 manylinux wheels of what the GPU image lacks (no dependencies: the image has them).
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    "megatron-core==0.16.1" "math-verify" "latex2sympy2_extended" "antlr4-python3-runtime==4.13.2" \
    "xxhash" "ml_dtypes" || exit 1
  du -sh .whl
  exit 0
fi

out="${1:-${OUT:-/tmp/verl-gpu-check}}"
mkdir -p "$out"
log="$out/gpu_check.log"
summary="$out/summary.txt"
: > "$log"
: > "$summary"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python="${PYTHON:-python3}"

if ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/verl-site .whl/*.whl \
    >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)" | tee -a "$summary"; exit 1; }
  export PYTHONPATH="/tmp/verl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  local start rc
  start=$(date +%s)
  echo "===== $name: $*" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  rc=$?
  printf '%-8s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - start ))" | tee -a "$summary"
}

step env 30 bash -c "nvidia-smi; $python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'"
step build 240 "$python" setup.py -q build_ext --inplace
step csrc 180 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/csrc/test_first_refusal.py \
  tests/csrc/test_copy_shards.py tests/csrc/test_copy_ranges.py
step engine 150 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/trainer/test_engine_bf16.py tests/trainer/test_engine_clipping.py \
  tests/models/test_loss_contract.py tests/trainer/test_engine_remove_padding.py
step rl-step 150 "$python" tools/bench.py rl-step --config grpo_tiny_cpu --inputs /tmp/verl-bench-inputs --steps 3 \
  actor_rollout_ref.rollout.name=hf trainer.device=cuda
step rollout 90 "$python" tools/bench.py rollout --model /tmp/verl-bench-inputs/qwen2-h64-l2-a2 --engine hf
step fsdp2 150 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/trainer/test_engine_fsdp.py \
  -k cuda
step fsdp2-critic 120 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/trainer/test_fsdp_critic.py \
  -k cuda
step soak 180 "$python" tools/bench.py soak --config grpo_tiny_cpu --inputs /tmp/verl-bench-inputs --steps 30 --warmup 10 \
  --window 5 --save-every 10 actor_rollout_ref.rollout.name=hf trainer.device=cuda
# The agent loop (#32) driving the transformers engine on the GPU: real tool calls, engine log-probs
# of every sampled token against a forward pass over the assembled conversation.
step agent 120 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/rollout/test_agent_loop.py -k "hf or transformers"
# Mixture-of-Experts and uneven pipeline stages (#34): the MoE forward on the device (router matmul
# path without TE, SequentialMLP, the all-to-all dispatcher at EP1), the split rules (no device).
step moe 120 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra \
  tests/models/test_moe.py::test_one_rank_on_the_device_matches_transformers \
  tests/models/test_uneven_pipeline.py::test_stage_ranges_equal_megatrons
# R3 router replay (#34): the transformers engine's routing recorded on the device (hooks, KV-cached decode).
step moe-r3 420 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra \
  tests/models/test_router_replay_r3.py -k device
step async 150 "$python" tools/bench.py rl-step --config grpo_tiny_cpu --inputs /tmp/verl-bench-inputs --steps 3 \
  actor_rollout_ref.rollout.name=hf trainer.device=cuda trainer.rollout_mode=async trainer.async_training.max_staleness=2
step async-partial 150 "$python" tools/bench.py rl-step --config grpo_tiny_cpu --inputs /tmp/verl-bench-inputs --steps 3 \
  actor_rollout_ref.rollout.name=hf trainer.device=cuda trainer.rollout_mode=async trainer.async_training.max_staleness=2 \
  trainer.async_training.partial_rollout=true trainer.async_training.partial_rollout_tokens=8
# The free-running generator's thread (#33) runs the rollout's engine in the rollout's world while the main
# thread takes part in the world's collectives: torch's default-group slots per thread, checked on the GPU
# image's torch (gloo ranks, as on CPU: the slots are the same for every backend; NCCL needs a GPU per rank).
step role-world-threads 240 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra \
  tests/parallel/test_role_world.py
# LoRA (#35) on the device: the adapters' hooks, Megatron's bf16 optimizer over the adapters only.
step lora 120 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra tests/trainer/test_engine_lora_bf16.py
# MoE weights into GPU vLLM's fused experts (#34): after update_weights the engine samples exactly what an
# engine started from those weights samples (needs vllm installed; skipped without it). The push writes
# w13/w2 as loaded: right for vLLM's Triton MoE backend, wrong for one that reorders them (FlashInfer).
step moe-vllm 240 "$python" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra -rs tests/rollout/test_vllm_moe.py
echo "summary: $summary, log: $log"
! grep -qv ' rc=0 ' "$summary"
