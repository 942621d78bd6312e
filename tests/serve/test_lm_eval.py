"""lm-evaluation-harness (`pip install -e .[eval]`) runs a multiple-choice (loglikelihood) task
against a real `serve.py` with its `local-completions` model and the server's own tokenizer
(/tokenizer_info, /tokenize: tokenizer_backend=remote); the task's data is written here, nothing
is downloaded. Every per-choice loglikelihood equals mlx-lm's on the same float32 model.
Runs only where the optional `eval` extra is installed; test_scoring_api.py drives the same
HTTP calls without it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeserve.model.tiny.text import ensure_model

lm_eval = pytest.importorskip("lm_eval", reason="the optional eval extra (lm-eval) is not installed")

TOL = 1e-4   # per token, float32 weights
DOCS = [
    {"context": "Question: Where are my keys?\nAnswer:", "choices": [" On the table.", " Blue."],
     "gold": 0},
    {"context": "Question: What time is it?\nAnswer:",
     "choices": [" It is half past three.", " In the river.", " 42"], "gold": 0},
    {"context": "The morning train left the station at", "choices": [" seven", " noon"],
     "gold": 0},
]


@pytest.fixture(scope="module")
def srv(server_factory: Any) -> Any:
    return server_factory()


def write_task(root: Path) -> str:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "task.yaml").write_text(
        "task: pipeserve_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    return "pipeserve_tiny_mc"


def test_lm_eval_local_completions_loglikelihoods_equal_mlx_lm(
        srv: Any, tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import mlx.core as mx
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table
    from mlx_lm import load

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    task = write_task(tmp_path)
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={srv.base_url}/v1/completions,model=tiny,"
                    "tokenizer_backend=remote,num_concurrent=2,max_retries=1,timeout=60"),
        tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)), batch_size=4,
        log_samples=True)
    assert results is not None
    with capsys.disabled():
        print("\n" + make_table(results))

    model, tokenizer = load(str(ensure_model("qwen3", "tiny", "float32", model_cache)))

    def loglikelihood(context: str, continuation: str) -> float:
        ctx = tokenizer.encode(context, add_special_tokens=False)
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        logits = model(mx.array(whole)[None])[0].astype(mx.float32)
        lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sum(lps[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))

    samples = results["samples"][task]
    assert len(samples) == len(DOCS)
    seen = 0
    for sample in samples:
        doc = DOCS[sample["doc_id"]]
        assert len(sample["resps"]) == len(doc["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            got, _greedy = resp[0]
            want = loglikelihood(context, continuation)
            n = len(tokenizer.encode(continuation, add_special_tokens=False))
            assert got == pytest.approx(want, abs=TOL * n), (context, continuation)
            with capsys.disabled():
                print(f"doc {sample['doc_id']} {continuation!r:28} lm-eval {got:+.6f}  "
                      f"mlx-lm {want:+.6f}")
            seen += 1
    assert seen == sum(len(d["choices"]) for d in DOCS)
    acc = results["results"][task]["acc,none"]
    assert 0.0 <= acc <= 1.0
