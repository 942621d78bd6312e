"""What a client set explicitly, as each protocol's parser reads it: one frozen `Requested`
whose `given()` is what admission merges over the defaults (stop a list, logit_bias a dict in
the order sent, unset fields absent). No model."""
from __future__ import annotations

import dataclasses

import pytest

from pipeserve.http.api.anthropic_request import parse as parse_messages
from pipeserve.http.api.openai_chat import parse_chat
from pipeserve.http.api.openai_completions import parse_completion
from pipeserve.request import Requested

CHAT = [{"role": "user", "content": "hi"}]


def test_chat_fields_reach_admission_as_sent() -> None:
    parsed = parse_chat({"messages": CHAT, "temperature": 0.2, "stop": "END",
                         "logit_bias": {"9": -1e9, "3": 2}, "repetition_context_size": 8,
                         "max_completion_tokens": 5, "max_tokens": 99, "logprobs": True,
                         "top_logprobs": 2, "priority": "batch", "deadline_ms": 900})
    assert parsed.requested.given() == {
        "temperature": 0.2, "penalty_context_size": 8, "logit_bias": {9: -100.0, 3: 2.0},
        "stop": ["END"], "priority": "batch", "deadline_ms": 900, "max_tokens": 5,
        "logprobs": True, "top_logprobs": 2}
    assert list(parsed.requested.given()["logit_bias"]) == [9, 3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.requested.priority = 0   # type: ignore[misc]


def test_an_empty_body_sets_no_sampling_field_but_an_empty_stop() -> None:
    """No stop in the body is an explicit empty list (no server default stop applies), as
    before; chat's logprobs default to off."""
    assert parse_chat({"messages": CHAT}).requested.given() == {
        "stop": [], "logprobs": False, "top_logprobs": 0}
    assert parse_completion({"prompt": "a"}).requested.given() == {
        "stop": [], "max_tokens": 16, "logprobs": False, "top_logprobs": 0}
    _, requested = parse_messages({"messages": CHAT, "max_tokens": 7,
                                   "stop_sequences": ["x", "y"]})
    assert requested == Requested(stop=("x", "y"), max_tokens=7)
    assert parse_messages({"messages": CHAT}, count_only=True)[1] == Requested()
