"""The engine a worker runs, chosen by ``TAILCUT_ENGINE__KIND``: ``vllm``, ``sim`` (SIMULATOR) or ``null``.

vLLM is imported only when it is chosen: ``sim`` and ``null`` workers start in about a second and
never load torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tailcut.logs import log_event
from tailcut.models import max_model_len as model_max_len
from workers.engines.base import Engine
from workers.engines.costmodel import PROFILES, kv_capacity_tokens
from workers.engines.filler import filler_token
from workers.engines.null import NullEngine
from workers.engines.sim import SimEngine
from workers.engines.sim_live import RealtimeSimEngine
from workers.engines.steplog import StepLog
from workers.settings import GPU_BLOCK_SIZE, EngineSettings

log = logging.getLogger("tailcut.engine")


def start_engine(settings: EngineSettings, model_dir: Path, max_model_len: int | None) -> Engine:
    """Start the configured engine for the model in ``model_dir``. Call inside a running event loop.

    ``max_model_len``: the context length the API was given (``TAILCUT_MAX_MODEL_LEN``), default the
    model's own. The model-free engines still read the model folder: its tokenizer gives them a real
    output token, its config the context length.
    """
    if settings.kind == "vllm":
        from workers.engines.vllm_engine import VllmEngine

        return VllmEngine.start(model_dir, settings, max_model_len=max_model_len)
    context = max_model_len or model_max_len(model_dir)
    filler = filler_token(model_dir)
    engine: NullEngine | RealtimeSimEngine
    if settings.kind == "null":
        engine = NullEngine(max_model_len=context, filler=filler, step_ms=settings.null_step_ms)
    else:
        sim = SimEngine(
            PROFILES[settings.sim_profile],
            kv_capacity_tokens=settings.sim_kv_capacity_tokens or kv_capacity_tokens(),
            block_size=settings.block_size or GPU_BLOCK_SIZE,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            prefix_cache=settings.enable_prefix_caching,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            # vLLM's priority scheduling: equal priorities run in arrival order, so the `fifo`
            # policy (priority 0 for all) is first come, first served.
            policy="priority",
            output_token_id=filler.token_id,
        )
        engine = RealtimeSimEngine(
            sim,
            max_model_len=context,
            filler=filler,
            time_scale=settings.sim_time_scale,
            step_log=StepLog(settings.sim_step_log) if settings.sim_step_log is not None else None,
        )
    log_event(
        log,
        "engine_started",
        kind=settings.kind,
        engine=repr(engine),
        model=model_dir.name,
        max_model_len=context,
        filler_token_id=filler.token_id,
    )
    return engine
