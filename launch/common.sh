# Sourced by the launchers in launch/ (each file is valid bash and valid Python): the bash half's
# one job, `verl_launch FILE ARGS...`, starts torchrun (`python -m verl.trainer.torchrun`) on FILE itself, so `bash launch/X.sh k=v`
# and `torchrun ... launch/X.sh k=v` run the same thing. With --dry-run (or --help) among ARGS it
# runs FILE once with Python instead (the memory plan needs no cluster).
#
# The cluster shape, from the environment (defaults: one node):
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE (default: the launcher's)
# or, under `srun` (one task per node), from Slurm: SLURM_NNODES, SLURM_NODEID and the first host
# of SLURM_JOB_NODELIST (`scontrol show hostnames`). More than one node uses torchrun's c10d
# rendezvous at MASTER_ADDR:MASTER_PORT (RDZV_ID names the job: default SLURM_JOB_ID or "verl").
#
# NCCL settings, each kept when already set:
#   NCCL_DEBUG=WARN                      errors and warnings only
#   NCCL_IB_TIMEOUT=22                   InfiniBand retry timeout exponent (4.096 us x 2^22, ~17 s):
#                                        large all-gathers across nodes outlast the default
#   NCCL_IB_RETRY_CNT=7                  retries before an InfiniBand error is fatal
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1    a failed collective aborts the job instead of hanging it
#   CUDA_DEVICE_MAX_CONNECTIONS=1        Megatron's requirement for overlapping TP communication
#                                        with compute (sequence parallel)
# Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your fabric when NCCL's own choice is wrong.

verl_launch() {
  local script="$1"
  shift
  local root
  root="$(cd "$(dirname "$script")/.." && pwd)"
  local python="${PYTHON:-$root/.venv/bin/python}"
  [ -x "$python" ] || python="$(command -v python3)"
  local arg
  for arg in "$@"; do
    if [ "$arg" = "--dry-run" ] || [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
      exec "$python" "$script" "$@"
    fi
  done
  if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${NNODES:-}" ]; then
    NNODES="${SLURM_NNODES:-1}"
    NODE_RANK="${SLURM_NODEID:-0}"
    if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
      # The whole list, then its first line: `| head -n 1` could kill scontrol with SIGPIPE,
      # which pipefail would turn into a failed launch.
      local hosts
      hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
      MASTER_ADDR="${hosts%%$'\n'*}"
    fi
  fi
  local nnodes="${NNODES:-1}" node_rank="${NODE_RANK:-0}"
  local addr="${MASTER_ADDR:-127.0.0.1}" port="${MASTER_PORT:-29500}"
  local nproc="${NPROC_PER_NODE:-${VERL_DEFAULT_NPROC:-8}}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}" NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-7}"
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
  local -a run=(--nproc_per_node "$nproc")
  if [ "$nnodes" = 1 ]; then
    run+=(--standalone)
  else
    run+=(--nnodes "$nnodes" --node_rank "$node_rank" --rdzv_backend c10d
          --rdzv_endpoint "$addr:$port" --rdzv_id "${RDZV_ID:-${SLURM_JOB_ID:-verl}}")
  fi
  echo "== torchrun ${run[*]} $script $*" >&2
  # verl's torchrun (verl/trainer/torchrun.py): the workers get TORCH_ELASTIC_SHUTDOWN_TIMEOUT
  # (default 600 s) to save after a SIGTERM, a stop ends with 128 + the signal's number and no
  # traceback, and the workers die with it. exec: a signal or kill -9 to this script reaches it.
  exec "$python" -m verl.trainer.torchrun "${run[@]}" "$script" "$@"
}
