"""Generation checkpoints with real processes: kill -9 mid-generation, restart, repeat the
identical request → the full output equals an uninterrupted run; a different seed or stop
string never resumes someone else's generation."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import json

from tests.serve.test_openai import NO_EOS, metric_families, sample_value, sdk

PROMPT = "Write a very long story about checkpoints and crashes."
N = 400


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "logit_bias": NO_EOS,
            "temperature": 1.0, "seed": 5, **kw}


def resumes(base: str) -> float:
    name = "pipeserve_generation_checkpoint_resumes"
    return sample_value(metric_families(base), name, name + "_total")


def start(server_factory: Any, d: Path) -> Any:
    return server_factory("cache=ssd", f"cache.ssd.dir={d}", "cache.checkpoint_every=40")


def interrupted(server_factory: Any, d: Path, **kw: Any) -> None:
    """Stream the request, kill -9 the server after ~200 tokens (bounded)."""
    s = start(server_factory, d)
    seen = 0
    with httpx.stream("POST", s.base_url + "/v1/completions", json={**body(**kw), "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                seen += 1
            if seen >= 200:
                break
    s.proc.kill()
    s.proc.wait(10)


def test_kill_9_then_the_identical_request_resumes_exactly(server_factory, tmp_path) -> None:
    ref_server = start(server_factory, tmp_path / "ref")
    reference = sdk(ref_server.base_url).completions.create(**body())
    ref_server.stop()
    assert reference.usage.completion_tokens == N

    interrupted(server_factory, tmp_path / "crash")
    again = start(server_factory, tmp_path / "crash")
    resumed = sdk(again.base_url).completions.create(**body())
    assert resumes(again.base_url) == 1
    assert resumed.choices[0].text == reference.choices[0].text   # sampled, seed 5: exact
    assert resumed.usage.completion_tokens == N
    # completion removed the checkpoint: the same request now runs from the start
    sdk(again.base_url).completions.create(**body())
    assert resumes(again.base_url) == 1


def test_a_different_seed_or_stop_string_never_resumes(server_factory, tmp_path) -> None:
    interrupted(server_factory, tmp_path / "c")
    s = start(server_factory, tmp_path / "c")
    other_seed = sdk(s.base_url).completions.create(**body(seed=6))
    other_stop = sdk(s.base_url).completions.create(**body(stop=["never-appears-here"]))
    assert resumes(s.base_url) == 0
    assert other_seed.usage.completion_tokens == other_stop.usage.completion_tokens == N
    sdk(s.base_url).completions.create(**body())        # the identical one still resumes
    assert resumes(s.base_url) == 1
