"""The request fields each endpoint honours. Anything else a body carries is one the server
does not implement: with server.strict_fields=true it is a 400 naming the field; by default it
is named in the `x-pipeserve-ignored` response header and counted in
pipeserve_ignored_fields_total. Event loop; pure Python."""
from __future__ import annotations

import re
from typing import Any

from pipeserve.http.api.fields import short
from pipeserve.errors import InvalidRequest

HEADER = "x-pipeserve-ignored"
# names the header shows as they are (printable ASCII a field name has); the others, and any
# past the first MAX_NAMED, are counted at its end, so a body cannot put bytes in a header
SHOWN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_NAMED = 16

# read by every generation endpoint (pipeserve/http/api/openai.py sampling_fields, structured.py,
# fields.adapter, the pool's keep_alive)
_SAMPLING = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "repetition_context_size", "presence_penalty", "frequency_penalty", "xtc_probability",
    "xtc_threshold", "seed", "logit_bias", "n", "stream", "stream_options", "adapter",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "keep_alive", "user",
    "priority", "deadline_ms"})
_CHAT_PROMPT = frozenset({"messages", "tools", "tool_choice", "chat_template_kwargs",
                          "reasoning_effort"})
_TOKENIZE = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs",
                       "add_generation_prompt", "continue_final_message"}) | _CHAT_PROMPT

HONOURED: dict[str, frozenset[str]] = {
    "chat": _SAMPLING | _CHAT_PROMPT | {"stop", "max_tokens", "max_completion_tokens",
                                        "logprobs", "top_logprobs", "response_format",
                                        "parallel_tool_calls", "prompt_cache_key",
                                        "prompt_cache_retention"},
    "completions": _SAMPLING | {"prompt", "suffix", "max_tokens", "echo", "logprobs",
                                "best_of", "stop", "response_format"},
    "responses": _SAMPLING | {"input", "instructions", "previous_response_id", "tools",
                              "tool_choice", "chat_template_kwargs", "reasoning", "text",
                              "max_output_tokens", "metadata", "store", "stop",
                              "parallel_tool_calls", "truncation", "prompt_cache_key",
                              "prompt_cache_retention", "background"},
    "messages": _SAMPLING | {"messages", "system", "max_tokens", "stop_sequences", "tools",
                             "tool_choice", "thinking", "chat_template_kwargs", "metadata"},
    "count_tokens": frozenset({"model", "messages", "system", "tools", "tool_choice",
                               "thinking", "chat_template_kwargs", "max_tokens"}),
    "tokenize": _TOKENIZE,
    "chat_template": _TOKENIZE - {"prompt", "return_token_strs"},
    "detokenize": frozenset({"model", "tokens"}),
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user",
                             "keep_alive"}),
    "rerank": frozenset({"model", "query", "documents", "top_n", "return_documents",
                         "keep_alive", "user"}),
}

# Fields that other servers implement and clients send, counted under their own name (any
# other unknown key counts as "other", so a client cannot grow the metric's label set)
NAMED = frozenset({
    "prompt_logprobs", "modalities", "audio", "priority", "prediction", "parallel_tool_calls",
    "service_tier", "web_search_options", "store", "metadata", "functions", "function_call",
    "min_tokens", "ignore_eos", "stop_token_ids", "bad_words", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "use_beam_search",
    "length_penalty", "include_stop_str_in_output", "verbosity", "include", "truncation",
    "background", "max_tool_calls", "safety_identifier", "prompt_cache_key", "container",
    "mcp_servers", "top_a", "typical_p", "tfs", "mirostat", "dynatemp_range"})

# values of a not-honoured field that ask for nothing beyond what the server does anyway
HARMLESS: dict[str, Any] = {"modalities": (["text"],), "service_tier": ("auto", "default"),
                            "store": (False,)}


def ignored(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The fields of `body` this endpoint does not honour (in body order); null values and
    values that ask for the default behaviour are not counted."""
    honoured = HONOURED[endpoint]
    return [k for k, v in body.items()
            if k not in honoured and v is not None and v not in HARMLESS.get(k, ())]


def check(ctx: Any, http: Any, endpoint: str, body: dict[str, Any]) -> None:
    """Strict: a 400 naming the first field not honoured. Otherwise they are kept for the
    response header (http.ctx.ignored) and counted."""
    names = ignored(endpoint, body)
    if not names:
        return
    if ctx.cfg.server.strict_fields:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        shown = names[0] if SHOWN.match(names[0]) else short(names[0])
        raise InvalidRequest(
            f"{shown} is not supported by this server{more}; drop the field, or launch "
            "with server.strict_fields=false to have unsupported fields ignored and named in "
            f"the {HEADER} response header", param=names[0][:64], code="unsupported_field")
    http.ctx.ignored = header_value(names)
    for name in names:
        ctx.metrics.ignored_fields.labels(endpoint, name if name in NAMED else "other").inc()


def header_value(names: list[str]) -> str:
    """The header's text: the first MAX_NAMED printable names, then how many more."""
    shown = [n for n in names if SHOWN.match(n)][:MAX_NAMED]
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"(+{rest} more)"] if rest else []))
