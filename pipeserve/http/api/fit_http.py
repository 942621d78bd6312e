"""GET /v1/models/{id}/fit: will the model fit — the memory model admission uses, as JSON. A
loaded model answers with its engine's published memory model; a pool member that is not loaded
(a listed model, or one of pool.model_dir) is sized from its files without reading a weight
(`pipeserve/model/fit.py`), in the executor, one estimate at a time. Event loop."""
from __future__ import annotations

import asyncio
import threading

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.config import ServeConfig
from pipeserve.core.limits import EngineLimits
from pipeserve.errors import ConfigError, EngineUnavailable, InvalidRequest
from pipeserve.http.api.http import json_response
from pipeserve.http.api.models_http import find_model
from pipeserve.model.fit import Fit, estimate

_ESTIMATING = threading.Lock()   # estimates build lazy models: one at a time, off the loop


def _loaded_fit(limits: EngineLimits) -> Fit | None:
    """The engine's own memory model (None for an encoder, which has none)."""
    if limits.memory is None:
        return None
    model = limits.model
    return Fit(limits.memory, str(model.config.get("model_type", "model")), model.compute_dtype,
               "the loaded model")


def _estimate(cfg: ServeConfig) -> Fit:
    with _ESTIMATING:
        return estimate(cfg)


def _target(app: Sanic, model_id: str) -> tuple[ServeConfig, EngineLimits | None]:
    """The model's config, and its engine's limits when it is loaded. A one-model server's
    engine thread owns MLX: until it has loaded, no estimate runs beside it."""
    pool = app.ctx.pool
    if pool is None:
        limits = app.ctx.engine.limits
        if limits is None:
            raise EngineUnavailable(f"model {model_id!r} is loading; its fit is answered once "
                                    "it has loaded", code="model_loading")
        return app.ctx.cfg, limits
    m = pool.members[model_id]
    return m.cfg, m.engine.limits if m.ready and m.engine is not None else None


async def handle_fit(app: Sanic, http: sanic.Request, model_id: str) -> HTTPResponse:
    """200 with the estimate and `loaded`; 404 for an unknown id; 400 for an encoder."""
    found = find_model(app, model_id)
    base = found.get("parent", model_id)   # `base:adapter`: the base model's memory
    cfg, limits = _target(app, base)
    if cfg.model.encoder:
        raise InvalidRequest(f"model {model_id!r} is an embedding model ({cfg.model.task.value}): "
                             "fit sizes the KV cache of a generation model", param="model")
    if limits is not None:
        fit = _loaded_fit(limits)
        if fit is None:
            raise InvalidRequest(f"model {model_id!r} publishes no memory model", param="model")
    else:
        try:
            fit = await asyncio.get_running_loop().run_in_executor(None, _estimate, cfg)
        except (ConfigError, OSError) as e:
            raise InvalidRequest(f"model {model_id!r} cannot be sized: {e}", param="model",
                                 code="model_not_sizable") from e
    return json_response({"object": "model.fit", "id": model_id, "loaded": limits is not None,
                         **fit.body()})
