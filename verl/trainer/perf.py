"""Model FLOPs of the step's phases and how close they run to the device's peak: ``perf/tflops/<phase>``
and ``perf/mfu/<phase>`` for ``gen``, ``old_log_prob``, ``ref``, ``values``, ``update_critic``,
``update_actor`` and the whole ``step``.

What is counted (the model FLOPs of the computation asked for, from the model's config and the
batch's real tokens; padding, recomputation under gradient checkpointing and non-matmul work
(norms, rotary, softmax, the optimizer) are not):

- a matmul of ``[t, in] x [in, out]`` is ``2 t in out`` FLOPs (one multiply and one add);
- per token and layer, the linears: q, k, v and o by their head counts (grouped-query attention's
  smaller k/v), the SwiGLU MLP's gate, up and down; a Mixture-of-Experts layer counts its router
  (``hidden x num_experts``), the ``top-k`` experts a token is sent to (not all ``n``) and the
  shared expert with its gate where the model has one;
- attention's two matmuls (``Q K^T`` and ``P V``), causal: the token at position ``p`` (1-based)
  scores the ``p`` keys at and before it (``min(p, window)`` with a sliding window), so a sequence
  of ``L`` tokens costs ``2 * 2 * layers * heads * head_dim * sum_p min(p, window)``, i.e.
  ``2 * layers * heads * head_dim * L (L + 1)`` without a window: the triangle a causal kernel
  computes, not the full square an unfused one multiplies and then masks;
- the vocabulary head (``hidden x vocab``, tied or not) on the rows it is computed for: in the
  training passes every real token (the engines' output layer runs on the whole row; the log-softmax
  is what ``head_columns`` narrows), in generation one row per generated token;
- generation: the prompt's prefill and one decode step per generated token but the last (whose
  successor is never sampled), i.e. a forward over ``prompt + response - 1`` tokens, per sample
  (an engine that shares a prompt's prefill among its ``n`` samples does less than this); the
  engine runs the merged weights (no adapter matmuls);
- backward = 2 x forward for a matmul whose weight trains (the input's gradient and the weight's),
  so a full update is 3 x forward; under LoRA (``model.lora_rank > 0``) the frozen base weights get no
  weight gradient (base linears and head: forward + input gradient = 2 x forward), the first layer's
  q/k/v projections read the frozen embeddings and get no input gradient either, attention's matmuls
  are 3 x forward and the adapters (``A``: ``in x r``, ``B``: ``r x out`` per targeted module) 3 x
  their forward;
- ``update_actor``/``update_critic``: one forward and backward per ``ppo_epochs``; ``old_log_prob``,
  ``ref``: one forward (the reference without adapters); ``values``: the critic's forward with its
  one-column value head.

``perf/tflops/<phase>`` is the phase's model FLOPs over its seconds (``timing_s/<phase>``, the step's
``PhaseTimer``: ``gen`` includes the weight push it opens with) per device (the run's world size),
in TFLOP/s; ``perf/mfu/<phase>`` is that over the device's peak in the phase's dtype (a fraction).
For the step, which mixes dtypes (an fp32 rollout beside a bf16 update), ``perf/mfu/step`` is the
seconds the counted phases would take at peak over the step's seconds: ``sum_p F_p / peak_p / T``.

The peak: on a GPU the vendor's dense (no sparsity) figure for its name and dtype
(:data:`GPU_PEAKS`); on a CPU a matmul rate measured once per machine on the threads torch uses
(:func:`cpu_matmul_peak`), cached under the user's cache directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from verl.utils.logging import global_rank, warn_once

logger = logging.getLogger(__name__)

__all__ = [
    "GPU_PEAKS",
    "DevicePeak",
    "ModelShape",
    "PassTerms",
    "StepFlops",
    "batch_lengths",
    "cache_dir",
    "cpu_matmul_peak",
    "device_peak",
    "generation_terms",
    "gpu_peak",
    "prepare_step_perf",
    "step_perf_metrics",
    "training_flops",
    "training_terms",
]

# ----------------------------------------------------------------------------------------------
# counting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the count reads of a decoder-only model (``HFModelSpec`` fields, LoRA's rank and targets)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """Dense SwiGLU inner width (unused for a Mixture-of-Experts model)."""
    vocab: int
    num_experts: int = 0
    """Routed experts per layer; 0: dense."""
    topk: int = 0
    """Experts each token goes through."""
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    """The shared expert's inner width (Qwen2-MoE); 0: none."""
    window: int | None = None
    """Sliding attention window (Mistral); None: full causal."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    """Hugging Face module names the adapters are on (q_proj ... down_proj)."""

    @classmethod
    def from_spec(cls, spec: Any, lora: Any = None) -> ModelShape:
        """From a ``verl.models.hf_config.HFModelSpec`` and a ``verl.models.lora.LoRASpec`` (or None)."""
        return cls(
            hidden=spec.hidden_size, layers=spec.num_layers, heads=spec.num_attention_heads,
            kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate=spec.intermediate_size,
            vocab=spec.vocab_size, num_experts=spec.num_experts, topk=spec.moe_topk,
            moe_intermediate=spec.moe_intermediate_size, shared_intermediate=spec.shared_expert_intermediate_size,
            window=spec.sliding_window,
            lora_rank=lora.rank if lora is not None else 0,
            lora_targets=tuple(lora.target_modules) if lora is not None else (),
        )

    def modules(self) -> dict[str, tuple[int, int, int]]:
        """Each linear of one layer as ``name: (in, out, times)``, ``times`` the copies a token goes
        through (the top-k routed experts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = {"q_proj": (h, q, 1), "k_proj": (h, kv, 1), "v_proj": (h, kv, 1), "o_proj": (q, h, 1)}
        if self.num_experts:
            m, k = self.moe_intermediate, self.topk
            out.update({"router": (h, self.num_experts, 1), "gate_proj": (h, m, k), "up_proj": (h, m, k),
                        "down_proj": (m, h, k)})
            if self.shared_intermediate:
                s = self.shared_intermediate
                out.update({"shared_gate_proj": (h, s, 1), "shared_up_proj": (h, s, 1), "shared_down_proj": (s, h, 1),
                            "shared_expert_gate": (h, 1, 1)})
        else:
            i = self.intermediate
            out.update({"gate_proj": (h, i, 1), "up_proj": (h, i, 1), "down_proj": (i, h, 1)})
        return out

    def linear_per_token(self) -> int:
        """Forward FLOPs of one token through every layer's linears (``2 in out`` each)."""
        return self.layers * sum(2 * i * o * t for i, o, t in self.modules().values())

    def adapters_per_token(self) -> int:
        """Forward FLOPs of one token through every layer's LoRA adapters (``2 r (in + out)`` each)."""
        if not self.lora_rank:
            return 0
        mods = self.modules()
        return self.layers * sum(2 * self.lora_rank * (mods[n][0] + mods[n][1]) * mods[n][2] for n in self.lora_targets)

    def first_qkv_per_token(self) -> int:
        """Forward FLOPs of one token through the first layer's q/k/v projections."""
        mods = self.modules()
        return sum(2 * mods[n][0] * mods[n][1] for n in ("q_proj", "k_proj", "v_proj"))

    def attention_keys(self, length: int) -> int:
        """``sum_{p=1..length} min(p, window)``: the keys the causal attention of a ``length``-token
        sequence scores, over its tokens."""
        if length <= 0:
            return 0
        w = self.window
        if w is None or length <= w:
            return length * (length + 1) // 2
        return w * (w + 1) // 2 + (length - w) * w


@dataclasses.dataclass(frozen=True)
class PassTerms:
    """One forward pass over a set of sequences, term by term (FLOPs)."""

    linear: float
    """The base weights' linears."""
    attention: float
    """``Q K^T`` and ``P V``."""
    head: float
    """The vocabulary (or value) head."""
    adapters: float
    """LoRA's ``A`` and ``B``."""
    first_qkv: float
    """The first layer's q/k/v projections (part of ``linear``): LoRA skips their input gradient."""

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.head + self.adapters


def _terms(shape: ModelShape, lengths: list[int], head_rows: int, head_out: int, adapters: bool) -> PassTerms:
    tokens = sum(lengths)
    keys = sum(shape.attention_keys(n) for n in lengths)
    return PassTerms(
        linear=float(tokens * shape.linear_per_token()),
        attention=float(4 * shape.layers * shape.heads * shape.head_dim * keys),
        head=float(2 * head_rows * shape.hidden * head_out),
        adapters=float(tokens * shape.adapters_per_token()) if adapters else 0.0,
        first_qkv=float(tokens * shape.first_qkv_per_token()),
    )


def training_terms(shape: ModelShape, lengths: list[int], *, head_out: int | None = None,
                   adapters: bool = True) -> PassTerms:
    """A training-side forward (log-probs, values, the update's forward) over sequences of ``lengths``
    real tokens: the head on every token, ``head_out`` columns (the vocabulary unless given)."""
    return _terms(shape, lengths, sum(lengths), shape.vocab if head_out is None else head_out, adapters)


def generation_terms(shape: ModelShape, prompts: list[int], responses: list[int]) -> PassTerms:
    """Generating ``responses[i]`` tokens after ``prompts[i]``: a forward over ``prompt + response - 1``
    tokens, the head on ``response`` rows, no adapters (the engine runs merged weights)."""
    lengths = [p + r - 1 if r > 0 else 0 for p, r in zip(prompts, responses)]
    return _terms(shape, lengths, sum(responses), shape.vocab, False)


def training_flops(shape: ModelShape, terms: PassTerms) -> float:
    """Forward and backward of ``terms``: 3 x forward, or under LoRA (``shape.lora_rank``) the frozen
    base's forward and input gradient without the first layer's q/k/v input gradient, attention and
    the adapters 3 x (module docstring)."""
    if not shape.lora_rank:
        return 3 * terms.forward
    return 2 * terms.linear - terms.first_qkv + 3 * terms.attention + 2 * terms.head + 3 * terms.adapters


# ----------------------------------------------------------------------------------------------
# the device's peak

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}

# name pattern (searched in torch.cuda.get_device_name, first match wins) -> (label, {dtype: dense TFLOP/s}).
# Vendors' datasheets, dense (the sparsity figures halved); fp32 is the non-tensor-core rate, tf32 the
# tensor-core rate torch uses for float32 matmuls when torch.backends.cuda.matmul.allow_tf32 is set.
GPU_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"GB200|B200", "B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100.*NVL", "H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H200.*NVL", "H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", "H200 SXM", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    (r"H100|H800", "H100 SXM", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    (r"A100|A800", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """One device's peak matmul rate per dtype and where it comes from."""

    device: str
    tflops: Mapping[str, float]
    """``bf16``/``fp16``/``fp32`` -> TFLOP/s of one device."""
    source: str

    def of(self, dtype: str) -> float | None:
        return self.tflops.get(_DTYPES.get(dtype, dtype))


def gpu_peak(name: str, *, tf32: bool = False) -> DevicePeak | None:
    """The table's entry for a GPU called ``name`` (None when none matches); ``tf32``: float32 matmuls
    run on the tensor cores (``torch.backends.cuda.matmul.allow_tf32``)."""
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            rates = {k: v for k, v in peaks.items() if k != "tf32"}
            if tf32:
                rates["fp32"] = peaks["tf32"]
            return DevicePeak(name, rates, f"{label} datasheet, dense{' (fp32 as tf32)' if tf32 else ''}")
    return None


def cache_dir() -> str:
    """Where verl caches per-machine measurements: ``$VERL_CACHE_DIR``, else ``$XDG_CACHE_HOME/verl``,
    else ``~/.cache/verl``."""
    if os.environ.get("VERL_CACHE_DIR"):
        return os.environ["VERL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "verl")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


# The measurement: the best of REPEATS timed [M x K] x [K x N] matmuls after a warm-up, per dtype.
MATMUL_SHAPE = (1024, 1024, 1024)
REPEATS = 5
CPU_PEAK_FILE = "cpu_matmul_peak.json"


def _measure(dtype: torch.dtype, shape: tuple[int, int, int], repeats: int) -> float:
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up: the kernel's first call picks and packs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9  # GFLOP/s


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """One process at a time (the ranks of a run share the cores the measurement needs)."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("%s cannot be read (%s): the CPU's matmul rate is measured again and the file rewritten",
                       path, exc)
        return {}
    if not isinstance(data, dict):
        logger.warning("%s holds no JSON object: the CPU's matmul rate is measured again and the file rewritten", path)
        return {}
    return data


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) and entry[k] > 0 for k in ("bf16_gflops", "fp32_gflops", "cores")
    ) and all(k in entry for k in ("cpu", "threads", "shape", "repeats", "torch", "measured_at", "load"))


def cpu_matmul_peak(*, threads: int | None = None, path: str | None = None) -> dict[str, Any]:
    """This CPU's matmul rate on ``threads`` torch threads (default: ``torch.get_num_threads()``):
    ``{"bf16_gflops", "fp32_gflops", "cpu", "threads", "shape", "repeats", "torch", "measured_at", "load",
    "cores", "path", "measured"}`` (``load``: the 1-minute load average as it was measured). Measured once
    per CPU model and thread count (the best of :data:`REPEATS` ``MATMUL_SHAPE`` matmuls per dtype, on the
    calling thread's torch settings) and cached in ``path``
    (default ``<cache_dir()>/cpu_matmul_peak.json``); an unreadable file or entry is measured again.
    ``measured``: whether this call measured. Delete the file to measure again."""
    threads = threads or torch.get_num_threads()
    path = path or os.path.join(cache_dir(), CPU_PEAK_FILE)
    key = f"{cpu_model()} | {threads} threads"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_locked(path))
        except OSError as exc:  # the folder cannot be made or the lock file opened: this process's measurement only
            warn_once(logger, "%s cannot be used (%s): the CPU's matmul rate is measured in this process only; set "
                      "VERL_CACHE_DIR to a writable folder to keep it", path, exc)
            if key not in _UNCACHED:
                _UNCACHED[key] = _measure_entry(threads)
            return {**_UNCACHED[key], "path": path, "measured": True}
        cache = _read_cache(path)
        entry = cache.get(key)
        if _valid(entry):
            return {**entry, "path": path, "measured": False}
        if entry is not None:
            logger.warning("%s: the entry for %r is not a measurement; measuring again", path, key)
        entry = cache[key] = _measure_entry(threads)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(cache, f, indent=1)
            os.replace(tmp, path)
        except OSError as exc:
            warn_once(logger, "%s cannot be written (%s): the CPU's matmul rate is measured again by the next run",
                      path, exc)
        return {**entry, "path": path, "measured": True}


_UNCACHED: dict[str, dict[str, Any]] = {}  # measurements where the cache file cannot be used


def _measure_entry(threads: int) -> dict[str, Any]:
    """One measurement on ``threads`` torch threads (the thread setting is restored after it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        entry: dict[str, Any] = {
            "bf16_gflops": _measure(torch.bfloat16, MATMUL_SHAPE, REPEATS),
            "fp32_gflops": _measure(torch.float32, MATMUL_SHAPE, REPEATS),
        }
    finally:
        torch.set_num_threads(before)
    entry.update(cpu=cpu_model(), threads=threads, shape=list(MATMUL_SHAPE), repeats=REPEATS,
                 torch=torch.__version__, measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 # other work on the cores lowers the rate: said with it (os.getloadavg: 1-minute mean)
                 load=round(os.getloadavg()[0], 2), cores=os.cpu_count() or 1)
    return entry


def device_peak(device: str | torch.device | None = None) -> DevicePeak | None:
    """The peak of the device the run computes on: a GPU by its name in :data:`GPU_PEAKS` (None, with a
    warning, for one the table lacks), a CPU by :func:`cpu_matmul_peak`. Logs what it uses, once."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, tf32=bool(torch.backends.cuda.matmul.allow_tf32))
        if peak is None:
            warn_once(logger, "no peak FLOP/s known for GPU %r: perf/mfu/* is left out (perf/tflops/* is kept); "
                      "add it to verl.trainer.perf.GPU_PEAKS", name)
        return peak
    m = cpu_matmul_peak()
    how = (f"best of {m['repeats']} [{m['shape'][0]}x{m['shape'][1]}]x[{m['shape'][1]}x{m['shape'][2]}] matmuls "
           f"on {m['threads']} torch thread(s), {m['cpu']}, torch {m['torch']}, {m['measured_at'][:19]}, "
           f"load average {m['load']} on {m['cores']} cores")
    if m["load"] > m["cores"]:
        warn_once(logger, "the CPU's matmul rate in %s was measured while the machine was busy (load average %s on "
                  "%s cores): it may be low and the MFU high; delete the file to measure again on a quiet machine",
                  m["path"], m["load"], m["cores"])
    return DevicePeak(m["cpu"], {"bf16": m["bf16_gflops"] / 1e3, "fp32": m["fp32_gflops"] / 1e3},
                      f"measured: {how}; {'written to' if m['measured'] else 'read from'} {m['path']} "
                      "(delete it to measure again)")


# ----------------------------------------------------------------------------------------------
# the step's metrics


def _dtype_name(dtype: str, cuda: bool) -> str:
    """A config dtype (``auto``, ``bfloat16``, ...) as ``bf16``/``fp16``/``fp32``; auto: bf16 on GPU, fp32 on CPU."""
    if dtype == "auto":
        return "bf16" if cuda else "fp32"
    return _DTYPES[dtype]


def _train_dtype(role: Any, cuda: bool) -> str:
    if role.strategy == "fsdp2":
        return _dtype_name(role.fsdp_config.mixed_precision.param_dtype, cuda)
    return _dtype_name(role.megatron.dtype, cuda)


def _model_shape(model: Any, megatron: Any, key: str) -> ModelShape:
    from verl.engine.build import load_model_spec, lora_spec

    return ModelShape.from_spec(load_model_spec(model, key=f"{key}.path"), lora_spec(model, megatron, key=key))


class StepFlops:
    """The model FLOPs of a PPO/GRPO step's phases on a batch, for one run's config."""

    def __init__(self, cfg: Any, *, cuda: bool | None = None) -> None:
        if cuda is None:
            cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        self.device = "cuda" if cuda else "cpu"
        arr = cfg.actor_rollout_ref
        self.actor = _model_shape(arr.model, arr.actor.megatron, "actor_rollout_ref.model")
        self.policy = dataclasses.replace(self.actor, lora_rank=0, lora_targets=())  # no adapters
        self.actor_epochs = arr.actor.ppo_epochs
        # trainer.rollout_mode one_step_off/async: a batch is generated beside the steps before the one that
        # trains it, not inside its gen phase; the step still counts one batch's generation (one per step).
        self.streaming = cfg.trainer.rollout_mode != "sync"
        self.dtypes = {"gen": _dtype_name(arr.rollout.dtype, cuda), "old_log_prob": _train_dtype(arr.actor, cuda),
                       "ref": _train_dtype(arr.ref, cuda), "update_actor": _train_dtype(arr.actor, cuda)}
        self.critic: ModelShape | None = None
        if cfg.use_critic:
            self.critic = _model_shape(cfg.critic.model, cfg.critic.megatron, "critic.model")
            self.critic_epochs = cfg.critic.ppo_epochs
            self.dtypes["values"] = self.dtypes["update_critic"] = _train_dtype(cfg.critic, cuda)

    def phase_flops(self, prompts: list[int], responses: list[int]) -> dict[str, float]:
        """Model FLOPs of each phase a step may run on sequences of ``prompts[i]`` + ``responses[i]`` real tokens."""
        lengths = [p + r for p, r in zip(prompts, responses)]
        actor = training_terms(self.actor, lengths)
        out = {
            "gen": generation_terms(self.policy, prompts, responses).forward,
            "old_log_prob": actor.forward,
            "ref": training_terms(self.policy, lengths).forward,
            "update_actor": self.actor_epochs * training_flops(self.actor, actor),
        }
        if self.critic is not None:
            critic = training_terms(self.critic, lengths, head_out=1)
            out["values"] = critic.forward
            out["update_critic"] = self.critic_epochs * training_flops(self.critic, critic)
        return out

    def metrics(self, prompts: list[int], responses: list[int], seconds: Mapping[str, float],
                peak: DevicePeak | None, devices: int) -> dict[str, float]:
        """``perf/tflops/<phase>`` and (with a peak) ``perf/mfu/<phase>`` of the phases timed in ``seconds``
        (``PhaseTimer.seconds``), and of the step over ``seconds["step"]``; ``devices``: the ranks the
        FLOPs are shared by. A streaming rollout's generation has no phase of its own here and counts in the step."""
        out: dict[str, float] = {}
        total, at_peak, known = 0.0, 0.0, True
        for phase, flops in self.phase_flops(prompts, responses).items():
            sec = seconds.get(phase, 0.0)
            ahead = phase == "gen" and self.streaming
            if sec <= 0 and not ahead:
                continue
            rate = peak.of(self.dtypes[phase]) if peak is not None else None
            if not ahead:
                out[f"perf/tflops/{phase}"] = flops / sec / devices / 1e12
                if rate:
                    out[f"perf/mfu/{phase}"] = flops / sec / devices / (rate * 1e12)
            if rate:
                at_peak += flops / devices / (rate * 1e12)
            else:
                known = False
            total += flops
        step = seconds.get("step", 0.0)
        if total and step > 0:
            out["perf/tflops/step"] = total / step / devices / 1e12
            if known and peak is not None:
                out["perf/mfu/step"] = at_peak / step
        return out


def batch_lengths(batch: Any) -> tuple[list[int], list[int]] | None:
    """Each row's real prompt and response tokens (``attention_mask`` [B, T] over ``responses`` [B, R]'s
    last ``R`` columns), or None when the batch lacks them."""
    if "attention_mask" not in batch or "responses" not in batch:
        return None
    mask = batch["attention_mask"]
    width = batch["responses"].shape[1]
    responses = mask[:, mask.shape[1] - width:].sum(-1)
    prompts = mask[:, : mask.shape[1] - width].sum(-1)
    return [int(v) for v in prompts], [int(v) for v in responses]


_RUNS: weakref.WeakKeyDictionary[Any, tuple[StepFlops | None, DevicePeak | None]] = weakref.WeakKeyDictionary()


def _for_run(pieces: Any) -> tuple[StepFlops | None, DevicePeak | None]:
    if pieces in _RUNS:
        return _RUNS[pieces]
    try:
        counter: StepFlops | None = StepFlops(pieces.cfg)
    except ValueError as exc:  # a model verl's config parser does not read (an nn.Module, an fsdp2-only family)
        warn_once(logger, "perf/tflops/* and perf/mfu/* are left out: the model's FLOPs are not counted (%s)", exc)
        counter = None
    peak = device_peak(counter.device) if counter is not None else None
    if peak is not None and global_rank() == 0:
        logger.info("MFU: peak of one device (%s): %s TFLOP/s; %s", peak.device,
                    ", ".join(f"{k} {v:.4g}" for k, v in peak.tflops.items()), peak.source)
    _RUNS[pieces] = (counter, peak)
    return counter, peak


def prepare_step_perf(pieces: Any) -> None:
    """The run's FLOP counter and device peak, made before its first step begins: on a CPU the peak is
    a matmul benchmark (:func:`cpu_matmul_peak`, once per machine), which must not run inside a step's
    timings or beside a streaming rollout's generator thread (it took the cores from it)."""
    from verl.config import PPOConfig

    if isinstance(getattr(pieces, "cfg", None), PPOConfig):
        _for_run(pieces)


def step_perf_metrics(pieces: Any, batch: Any, seconds: Mapping[str, float]) -> dict[str, float]:
    """The step's ``perf/tflops/*`` and ``perf/mfu/*`` (module docstring) for a ``StepPieces`` run of a
    PPO config; empty for a step of other pieces, a batch without ``responses``, or a model it cannot count."""
    from verl.config import PPOConfig

    if batch is None or not isinstance(getattr(pieces, "cfg", None), PPOConfig):
        return {}
    lengths = batch_lengths(batch)
    if lengths is None:
        return {}
    counter, peak = _for_run(pieces)
    if counter is None:
        return {}
    return counter.metrics(*lengths, seconds, peak, pieces.world_size)
