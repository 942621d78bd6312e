"""The wire between the parent and an engine process: commands and events as orjson messages,
one message per engine step for events. Pure functions, any thread; no mlx."""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import orjson

from pipeserve import errors
from pipeserve.adapters.lora import AdapterSet
from pipeserve.core.limits import EngineLimits
from pipeserve.core.events import (AdapterSwap, Event, Failed, Finished, TokenDelta,
                                   answer)
from pipeserve.core.scoring import Score
from pipeserve.core.submission import EngineRequest
from pipeserve.memory import MemoryModel
from pipeserve.request import FinishReason, Request, TokenLogprob

if TYPE_CHECKING:
    from pipeserve.config import ServeConfig
    from pipeserve.model.loader import LoadedModel

OPTS = orjson.OPT_NON_STR_KEYS   # logit_bias is keyed by token id


def dumps(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message, option=OPTS)


def loads(data: bytes) -> dict[str, Any]:
    return orjson.loads(data)


# -- requests (parent → child): EngineRequest's one encoding (pipeserve/core/submission.py) ----
def encode_request(req: Request) -> dict[str, Any]:
    return EngineRequest.of(req).encode()


def decode_request(d: dict[str, Any]) -> Request:
    return EngineRequest.decode(d).to_request()


# -- the child's published limits (child → parent, once ready) ------------------------------
def encode_limits(limits: EngineLimits) -> dict[str, Any]:
    """What the parent cannot derive from the model's files: the engine's own facts."""
    memory = limits.memory
    return {"max_rows": limits.max_rows, "kv_pool_bytes": limits.kv_pool_bytes,
            "memory": dataclasses.asdict(memory) if memory is not None else None,
            "device": limits.device, "dimensions": limits.dimensions,
            "rewinds": limits.rewinds, "adapters": encode_adapters(limits.adapters)}


def decode_limits(d: dict[str, Any], cfg: ServeConfig, loaded: LoadedModel) -> EngineLimits:
    """The parent's limits: its own host-side model (tokenizer, config) and the child's facts."""
    limits = EngineLimits.of(cfg, loaded, max_rows=d["max_rows"],
                             kv_pool_bytes=d["kv_pool_bytes"],
                             memory=MemoryModel(**d["memory"]) if d["memory"] else None,
                             device=d["device"], dimensions=d["dimensions"],
                             rewinds=d.get("rewinds"))
    return dataclasses.replace(limits, adapters=decode_adapters(d.get("adapters")))


def encode_adapters(snapshot: AdapterSet | None) -> dict[str, Any] | None:
    """The child's mounted adapters (EngineLimits.adapters), at ready and after every swap."""
    return snapshot.to_wire() if snapshot is not None else None


def decode_adapters(d: dict[str, Any] | None) -> AdapterSet | None:
    return AdapterSet.from_wire(d) if d is not None else None


# -- events (child → parent) -----------------------------------------------------------------
def encode_error(e: errors.ServeError) -> list[Any]:
    return [type(e).__name__, e.status, e.error_type, e.message, e.param, e.code]


def decode_error(d: list[Any]) -> errors.ServeError:
    """The same class when pipeserve.errors has it (status and type kept either way)."""
    name, status, error_type, message, param, code = d
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ServeError)):
        cls = errors.ServeError
    e = cls.__new__(cls)
    errors.ServeError.__init__(e, message, param=param, code=code)
    e.status, e.error_type = status, error_type
    return e


def encode_event(event: Event) -> list[Any]:
    if isinstance(event, TokenDelta):
        lps = ([[lp.token_id, lp.logprob, lp.top] for lp in event.logprobs]
               if event.logprobs is not None else None)
        return ["t", event.request_id, event.token_ids, lps, event.batch_size_max]
    if isinstance(event, Finished):
        return ["f", event.request_id, event.reason.value, event.num_prompt_tokens,
                event.num_output_tokens, event.num_cached_tokens, event.extras]
    assert isinstance(event, Failed)
    return ["x", event.request_id, encode_error(event.error)]


def encode_step(events: list[Event], waiting: int, running: int) -> dict[str, Any]:
    """One engine step's events as one message, column by column: the rows with new tokens
    (`rid`), how many each got (`n`), each row's most rows in one step so far (`b`), every
    new token id in one flat array (`tok`), each row's logprobs or null (`lp`: null when no
    row asked), then the rows that ended (`end`: finished or failed), and the engine's
    waiting and running counts after the step."""
    rids: list[str] = []
    counts: list[int] = []
    sizes: list[int] = []
    toks: list[int] = []
    lps: list[Any] = []
    ends: list[list[Any]] = []
    for event in events:
        if isinstance(event, TokenDelta):
            rids.append(event.request_id)
            counts.append(len(event.token_ids))
            sizes.append(event.batch_size_max)
            toks.extend(event.token_ids)
            lps.append(None if event.logprobs is None else
                       [[lp.token_id, lp.logprob, lp.top] for lp in event.logprobs])
        else:
            ends.append(encode_event(event))
    return {"op": "ev", "rid": rids, "n": counts, "b": sizes, "tok": toks,
            "lp": lps if any(x is not None for x in lps) else None, "end": ends,
            "w": waiting, "r": running}


def decode_step(msg: dict[str, Any]) -> list[Event]:
    """A step message's events: every row's tokens first, then the rows that ended (a row's
    tokens of the step come before its end, as the engine posted them)."""
    out: list[Event] = []
    toks, lps, at = msg["tok"], msg["lp"], 0
    for i, (rid, n, size) in enumerate(zip(msg["rid"], msg["n"], msg["b"])):
        row_lps = lps[i] if lps is not None else None
        out.append(TokenDelta(rid, toks[at:at + n], None if row_lps is None else [
            TokenLogprob(t, lp, [(a, b) for a, b in top]) for t, lp, top in row_lps], size))
        at += n
    out.extend(decode_event(d) for d in msg["end"])
    return out


def decode_event(d: list[Any]) -> Event:
    kind, rid = d[0], d[1]
    if kind == "t":
        lps = ([TokenLogprob(t, lp, [(a, b) for a, b in top]) for t, lp, top in d[3]]
               if d[3] is not None else None)
        return TokenDelta(rid, d[2], lps, d[4])
    if kind == "f":
        return Finished(rid, FinishReason(d[2]), d[3], d[4], d[5], d[6])
    return Failed(rid, decode_error(d[2]))


# -- command replies (child → parent): a command's answered future as its reply's fields -----
def embed_reply_fields(future: Future[Any]) -> dict[str, Any]:
    """Child process: an answered Embed (pipeserve/embed/engine.py)."""
    error = future.exception()
    if error is not None:
        return {"vecs": None, "error": encode_error(error)}
    return {"vecs": future.result(), "error": None}


def score_reply_fields(future: Future[Any]) -> dict[str, Any]:
    """Child process: an answered Score (pipeserve/core/scoring.py)."""
    error = future.exception()
    if error is not None:
        return {"error": encode_error(error)}
    return {"lps": [None if t is None else [t.token_id, t.logprob, t.top]
                    for t in future.result()]}


def swap_reply_fields(future: Future[Any], snapshot: AdapterSet | None) -> dict[str, Any]:
    """Child process: an answered AdapterSwap (pipeserve/adapters/swap.py) and the set the
    engine published after it (a refused swap publishes too: the parent keeps the newest)."""
    error = future.exception()
    return {"entry": None if error is not None else future.result(),
            "error": encode_error(error) if error is not None else None,
            "adapters": encode_adapters(snapshot)}


def apply_swap_reply(cmd: AdapterSwap, msg: dict[str, Any]) -> None:
    """Parent's pipe reader: a swap reply's entry or error into the command, then its future
    (the caller has published the reply's adapters first: the handler's reply comes after
    the set it names)."""
    if msg.get("error") is not None:
        cmd.error = decode_error(msg["error"])
    elif msg.get("entry") is None:
        done = "mounted" if cmd.mount else "unmounted"
        cmd.error = errors.EngineUnavailable(
            f"the model's engine process stopped before it {done} adapter {cmd.adapter_id!r}; "
            "GET /v1/adapters says what is mounted once it is back")
    else:
        cmd.result = msg["entry"]
    answer(cmd.future, cmd.result, cmd.error)


def apply_score_reply(cmd: Score, msg: dict[str, Any]) -> None:
    """Parent's pipe reader: a reply's fields back into the Score, then its future."""
    if msg.get("error") is not None:
        cmd.error = decode_error(msg["error"])
    elif msg.get("lps") is None:
        cmd.error = errors.EngineUnavailable("the model's engine process stopped before it scored "
                                             "the prompt; retry")
    else:
        cmd.result = [None if t is None else TokenLogprob(t[0], t[1], [(a, b) for a, b in t[2]])
                      for t in msg["lps"]]
    answer(cmd.future, cmd.result, cmd.error)
