"""Hot-swap: `POST /v1/adapters` mounts a subdirectory of
model.adapter_dir and `DELETE /v1/adapters/{id}` unmounts one, at runtime. Handlers only build
an AdapterSwap command and wait on it (`request`); the engine thread runs it between steps
(`AdapterSwap.run` → `run`), the one place the AdapterSet's stacked A/B grow and shrink.

Unmounting is refused (409, naming how many) while a running or waiting request uses the
adapter. An unmounted adapter keeps its slot, "retired", while a request uses it or for
RETIRE_S after its unmount — a request a handler accepted just before the unmount (its id was
checked, its Submit not yet drained) still runs with it — and its matrices go at the next
mount or unmount after that."""
from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from pipeserve.adapters.lora import (
    FILES,
    NONE,
    Adapter,
    AdapterSet,
    MultiLoRALinear,
    _convert_and_revert,
    _read_config,
    check_id,
    resolve,
)
from pipeserve.core.client import reply_of
from pipeserve.core.events import answer
from pipeserve.errors import (
    ConfigError,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    ServeError,
)
from pipeserve.model import blas
from pipeserve.model.config import ComputeDType

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.core.events import AdapterSwap
    from pipeserve.core.scheduler import Scheduler
    from pipeserve.model.loader import LoadedModel


class Engine(Protocol):
    """What the swap reads of the engine (pipeserve/core/engine.py, which runs the swap and
    passes itself): named here, so the engine and this module do not import each other."""

    cfg: ServeConfig
    loaded: LoadedModel | None
    scheduler: Scheduler
    state: Enum

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def command(self, cmd: Any) -> Future[Any]: ...


RETIRE_S = 60.0   # an unmounted adapter's slot outlives its unmount this long (see above)
WAIT_S = 600.0    # the most a handler waits for the engine to run its command


class AdapterConflict(ServeError):
    """The adapter cannot be mounted or unmounted in the server's current state (409)."""

    status = 409
    error_type = "invalid_request_error"


async def request(engine: Engine, cmd: AdapterSwap) -> dict[str, object]:
    """Event loop: hand `cmd` to the engine and await its reply, the mounted or unmounted
    adapter's /v1/adapters entry (the engine runs it between steps, STYLE §5)."""
    if not engine.wait_ready(0) or engine.limits is None:   # (ready: returns at once)
        raise EngineUnavailable(f"engine is {engine.state.value}; retry when /health answers 200")
    return await reply_of(engine.command(cmd), WAIT_S, "run the adapter command")


# -- engine thread --------------------------------------------------------------------------
def run(engine: Engine, cmd: AdapterSwap) -> None:
    """Engine thread, between steps: mount or unmount, then reply. Never raises: a failure
    is the command's `error` (a ServeError its handler raises), the engine goes on."""
    try:
        entry = (_mount if cmd.mount else _unmount)(engine, cmd.adapter_id)
        cmd.result = {**entry.describe(), "default": False}
    except ServeError as e:
        cmd.error = e
    except Exception as e:  # the boundary: the handler answers 500, the loop lives
        import logging
        logging.getLogger(__name__).exception("adapter %s failed", "mount" if cmd.mount
                                              else "unmount")
        cmd.error = ServeError(f"adapter {cmd.adapter_id!r}: internal error "
                               f"({type(e).__name__}); the server log has the details")
    finally:
        engine.publish()   # handlers read the new set from the limits before the reply
        answer(cmd.future, cmd.result, cmd.error)


def _users(engine: Engine, shared: AdapterSet, adapter_id: str) -> int:
    sched = engine.scheduler
    return sum(1 for r in [*sched.running, *sched.waiting] if adapter_id in shared.members(r.adapter))


def _set_of(engine: Engine) -> AdapterSet:
    loaded = engine.loaded
    assert loaded is not None
    return loaded.adapters if loaded.adapters is not None else AdapterSet.of(loaded.model)


def _mount(engine: Engine, adapter_id: str) -> Adapter:
    cfg = engine.cfg.model
    if cfg.adapter_dir is None:
        raise InvalidRequest("this server has no model.adapter_dir: adapters are mounted only "
                             "from that directory (relaunch with model.adapter_dir=<dir>)",
                             param="id", code="adapter_dir_unset")
    path = _checked_path(cfg.adapter_dir, adapter_id)
    shared = _set_of(engine)
    if adapter_id in shared.adapters:
        raise AdapterConflict(f"id {adapter_id!r} is already mounted; DELETE /v1/adapters/"
                              f"{adapter_id} first to mount it again", param="id",
                              code="adapter_mounted")
    if adapter_id in shared.retired:   # unmounted a moment ago: its old slot must go first
        busy = _users(engine, shared, adapter_id)
        if busy:
            raise AdapterConflict(f"id {adapter_id!r} was unmounted and {busy} running or "
                                  "waiting request(s) still use it; retry once they finish",
                                  param="id", code="adapter_busy")
        del shared.retired[adapter_id]
    if shared.merged:
        raise InvalidRequest(f"id {adapter_id!r}: the launch adapter {shared.default!r} is a "
                             "DoRA adapter merged into every row; no other adapter can be "
                             "mounted beside it", param="id", code="adapter_dora")
    raw = _fail_400(adapter_id, lambda: _read_config(adapter_id, path))
    if raw.get("fine_tune_type") == "dora":
        raise InvalidRequest(f"id {adapter_id!r} is a DoRA adapter; DoRA can be mounted only "
                             "alone, at launch (model.adapter=<id>): its magnitude rescales "
                             "the base output, so its rows cannot share a batch",
                             param="id", code="adapter_dora")
    model = engine.loaded.model   # type: ignore[union-attr]
    multi = _unwrap(model)
    try:
        adapter, weights = _fail_400(
            adapter_id, lambda: _convert_and_revert(model, cfg.adapter_dir, adapter_id))
    except BaseException:
        _restore(model, multi)
        raise
    _restack(engine, shared, multi, (adapter, weights))
    return adapter


def _unmount(engine: Engine, adapter_id: str) -> Adapter:
    shared = _set_of(engine)
    if adapter_id not in shared.adapters:
        raise NotFound(f"adapter {adapter_id!r} is not mounted; mounted: "
                       f"{', '.join(shared.ids) or 'none'}", param="id", code="adapter_not_found")
    if adapter_id == shared.default:
        raise AdapterConflict(f"adapter {adapter_id!r} is the launch default (model.adapter): "
                              "requests naming none run with it, so it cannot be unmounted",
                              param="id", code="adapter_default")
    busy = _users(engine, shared, adapter_id)
    if busy:
        raise AdapterConflict(f"adapter {adapter_id!r} is in use by {busy} running or waiting "
                              "request(s); retry once they finish", param="id",
                              code="adapter_busy")
    adapter = shared.adapters[adapter_id]
    shared.adapters = {k: a for k, a in shared.adapters.items() if k != adapter_id}
    shared.retired[adapter_id] = (adapter, time.monotonic())
    model = engine.loaded.model   # type: ignore[union-attr]
    _restack(engine, shared, _unwrap(model), None)
    return adapter


def _checked_path(adapter_dir: str, adapter_id: str) -> Path:
    """The launch checks (`resolve`), as HTTP statuses: not an id, or a path out of the
    directory → 400; no such subdirectory → 404; a directory without the two files → 400."""
    try:
        check_id(adapter_id)
    except ConfigError as e:
        raise InvalidRequest(str(e).replace("model.adapter '", "id '", 1), param="id",
                             code="adapter_id_invalid") from e
    root = Path(adapter_dir).expanduser().resolve()
    if not (root / adapter_id).exists():
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise NotFound(f"id {adapter_id!r} is not in model.adapter_dir {root} (adapters there: "
                       f"{', '.join(known) or 'none'})", param="id", code="adapter_not_found")
    return _fail_400(adapter_id, lambda: resolve(adapter_dir, adapter_id))


def _fail_400(adapter_id: str, fn: Any) -> Any:
    try:
        return fn()
    except ConfigError as e:
        msg = str(e).replace(f"model.adapter '{adapter_id}'", f"id '{adapter_id}'")
        raise InvalidRequest(msg, param="id", code="adapter_invalid") from e


def _unwrap(model: Any) -> dict[str, MultiLoRALinear]:
    """Put every MultiLoRALinear's base layer back, so mlx-lm's conversion sees the model as
    at launch; returns them by path (`_restack` or `_restore` puts them back)."""
    from mlx.utils import tree_unflatten

    multi = {k: m for k, m in model.named_modules() if isinstance(m, MultiLoRALinear)}
    if multi:
        model.update_modules(tree_unflatten([(k, m.linear) for k, m in multi.items()]))
    return multi


def _restore(model: Any, multi: dict[str, MultiLoRALinear]) -> None:
    """After a refused mount: undo any layer mlx-lm converted, put the MultiLoRALinear back."""
    from mlx.utils import tree_unflatten

    back = [(k, getattr(m, "linear", getattr(m, "embedding", None)))
            for k, m in model.named_modules()
            if hasattr(m, "lora_a") and not isinstance(m, MultiLoRALinear) and k not in multi]
    model.update_modules(tree_unflatten(back + list(multi.items())))
    model.eval()


def _stack_dtype(engine: Engine, multi: dict[str, MultiLoRALinear], file_dtype: Any) -> Any:
    """The dtype a launch mount ends in: the stacks' own, else what the loader's cast
    (`pipeserve.model.loader._cast_weights`) makes of the file's tensors."""
    import mlx.core as mx

    if multi:
        return next(iter(multi.values())).lora_a.dtype
    choice = engine.cfg.model.compute_dtype
    if choice is ComputeDType.auto:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        return mx.float32 if on_cpu and blas.loaded else file_dtype
    return file_dtype if choice is ComputeDType.checkpoint else getattr(mx, choice.value)


def _restack(engine: Engine, shared: AdapterSet, multi: dict[str, MultiLoRALinear],
             new: tuple[Adapter, dict[str, Any]] | None) -> None:
    """Rebuild every MultiLoRALinear (the model's layers are its base ones, `_unwrap`) for the
    adapters kept — the mounted ones, the retired ones still needed — plus `new`, and renumber
    the set's slots; a layer no kept adapter adapts goes back to its base layer."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    now = time.monotonic()
    in_use = {m for r in [*engine.scheduler.running, *engine.scheduler.waiting]
              for m in shared.members(r.adapter)}
    shared.retired = {k: v for k, v in shared.retired.items()
                      if k in in_use or now - v[1] < RETIRE_S}
    old_slots = dict(shared.slots)
    keep = [*shared.adapters.values(), *(a for a, _ in shared.retired.values())]
    order = keep + ([new[0]] if new else [])
    per_layer: dict[str, dict[int, tuple[Any, Any]]] = {}
    for k, m in multi.items():
        for slot, a in enumerate(keep, start=1):
            old = old_slots[a.id]
            if old in m.covers:
                per_layer.setdefault(k, {})[slot] = (m.lora_a[old], m.lora_b[old])
    if new:
        for name, w in new[1].items():
            layer, leaf = name.rsplit(".", 1)
            pair = per_layer.setdefault(layer, {}).get(len(order), (None, None))
            per_layer[layer][len(order)] = (w, pair[1]) if leaf == "lora_a" else (pair[0], w)
    file_dtype = next(iter(new[1].values())).dtype if new else mx.float32
    dtype = _stack_dtype(engine, multi, file_dtype)
    model = engine.loaded.model   # type: ignore[union-attr]
    modules = dict(model.named_modules())
    layers: list[tuple[str, Any]] = [(k, m.linear) for k, m in multi.items()
                                     if k not in per_layer]
    for layer, slots in per_layer.items():
        some_a, some_b = next(iter(slots.values()))
        n_in, n_out = some_a.shape[0], some_b.shape[1]
        r_max = max(a.shape[1] for a, _ in slots.values())
        zero_a, zero_b = mx.zeros((n_in, r_max), dtype), mx.zeros((r_max, n_out), dtype)
        a_rows, b_rows = [zero_a], [zero_b]
        for s in range(1, len(order) + 1):
            if s in slots:
                a, b = slots[s]
                a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, r_max - a.shape[1])]))
                b_rows.append(mx.pad(b.astype(dtype), [(0, r_max - b.shape[0]), (0, 0)]))
            else:
                a_rows.append(zero_a)
                b_rows.append(zero_b)
        base = multi[layer].linear if layer in multi else modules[layer]
        stacked_a, stacked_b = mx.stack(a_rows), mx.stack(b_rows)
        mx.eval(stacked_a, stacked_b)
        layers.append((layer, MultiLoRALinear(base, stacked_a, stacked_b, frozenset(slots),
                                              shared)))
    if layers:
        model.update_modules(tree_unflatten(layers))
    model.eval()
    shared.renumber(order)
    if engine.loaded.adapters is None and shared.adapters:   # type: ignore[union-attr]
        engine.loaded.adapters = shared   # type: ignore[union-attr]  # handlers see it now


__all__ = ["FILES", "NONE", "AdapterConflict", "request", "run"]
