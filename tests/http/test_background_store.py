"""Background responses on disk as a restart reads them: a checkpoint written after a later
one never replaces it; a finished response past its retention is deleted at launch and an
open one never is; one process holds a response at a time; and the checkpointed output a
resumed prompt continues is cut at a stop token and leaves a token to generate, and a
constrained request starts over."""
from __future__ import annotations

import time
from pathlib import Path

from pipeserve.grammar.constraint import Constraint, ConstraintKind
from pipeserve.http.api.background_resume import continuation
from pipeserve.http.api.background_store import BackgroundStore
from pipeserve.request import PromptInput, Request, SamplingParams


def record(rid: str, status: str, ids: list[int], ended: float | None = None) -> dict:
    return {"id": rid, "body": {}, "status": status, "created_at": 1, "output_ids": ids,
            "response": {"id": rid}, "conversation": [], "finished_at": ended}


def test_a_late_older_write_and_retention(tmp_path: Path) -> None:
    store = BackgroundStore(tmp_path)
    store.save(record("resp_a", "in_progress", [1, 2, 3]), rev=2)
    store.save(record("resp_a", "in_progress", [1]), rev=1)   # landed after the newer one
    assert store.get("resp_a")["output_ids"] == [1, 2, 3]
    store.save(record("resp_old", "completed", [5], ended=time.time() - 100), rev=1)
    store.save(record("resp_new", "completed", [5], ended=time.time()), rev=1)
    store.save(record("resp_open", "queued", []), rev=1)
    kept = [r["id"] for r in store.expire(ttl_s=50)]
    assert sorted(kept) == ["resp_a", "resp_new", "resp_open"]
    assert store.get("resp_old") is None and store.get("resp_../x") is None
    assert store.delete("resp_new") and not store.delete("resp_new")
    store.save(record("resp_new", "completed", [5]), rev=9)   # a write still in flight
    assert store.get("resp_new") is None


def test_one_process_holds_a_response(tmp_path: Path) -> None:
    store = BackgroundStore(tmp_path)
    held = store.claim("resp_a")
    assert held is not None and store.claim("resp_a") is None
    held.close()
    again = store.claim("resp_a")
    assert again is not None
    again.close()


def request(max_tokens: int, constraint: Constraint | None = None) -> Request:
    return Request(request_id="resp_x", endpoint="responses", inputs=PromptInput(text="x"),
                   prompt_ids=[7, 8], sampling=SamplingParams(max_tokens=max_tokens),
                   stop_token_ids=frozenset({2}), constraint=constraint)


def test_continuation() -> None:
    req = request(10)
    assert continuation(req, [4, 5, 2, 6]) == [4, 5]   # the run ended at the stop token
    assert req.prompt_ids == [7, 8, 4, 5] and req.sampling.max_tokens == 8
    req = request(3)
    assert continuation(req, [4, 5, 6]) == [4, 5] and req.sampling.max_tokens == 1
    req = request(10, Constraint(ConstraintKind.JSON_SCHEMA, "{}", "text.format"))
    assert continuation(req, [4, 5]) == [] and req.prompt_ids == [7, 8]
