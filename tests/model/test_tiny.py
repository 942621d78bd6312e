from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import load_tokenizer

from pipeserve.model.tiny.text import ARCHS, VOCAB_SIZE, ensure_model, model_dir_name

REPO = Path(__file__).resolve().parents[2]
TEXT = "Hello, café naïve 日本語 🙂🚀 ❤️ — {\"a\": [1, 2]}\n\tdef f(x):  return x  # end"


def _chat(tokenizer: object, content: str = "Tell me a story.") -> str:
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_load_generate_reuse_and_determinism(arch: str, tmp_path: Path) -> None:
    path = ensure_model(arch, cache_dir=tmp_path / "a")
    assert path.name == model_dir_name(arch, "tiny", "float32")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json"):
        assert (path / f).is_file(), f
    model, tokenizer = mlx_lm.load(str(path))
    text = mlx_lm.generate(model, tokenizer, prompt=_chat(tokenizer), max_tokens=16)
    assert isinstance(text, str) and text

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(arch, cache_dir=tmp_path / "a") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "a").iterdir()] == [path.name]  # no temp dirs left

    other = ensure_model(arch, cache_dir=tmp_path / "b")
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / f).read_bytes() == (path / f).read_bytes(), f


def test_tokenizer_round_trip_and_chat_template(tmp_path: Path) -> None:
    path = ensure_model("qwen3", cache_dir=tmp_path)
    tok = load_tokenizer(path)
    assert len(tok.get_vocab()) == VOCAB_SIZE  # 508 BPE + 4 added (<tool_call> etc.)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    detok = tok.detokenizer  # streaming detokenizer must also reassemble multi-byte chars
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == TEXT

    im_start, im_end = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [im_start]
    config = json.loads((path / "config.json").read_text())
    assert im_end in config["eos_token_id"] and tok.convert_tokens_to_ids("<|endoftext|>") in config["eos_token_id"]
    assert im_end in tok.eos_token_ids

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert gen == rendered + "<|im_start|>assistant\n"

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "18C"}]
    rendered = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function"' in rendered and "get_weather" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in rendered
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in rendered
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"


def test_greedy_margin(tmp_path: Path) -> None:
    model, tok = mlx_lm.load(str(ensure_model("qwen3", cache_dir=tmp_path)))
    cache = make_prompt_cache(model)
    logits = model(mx.array(tok.encode(_chat(tok), add_special_tokens=False))[None], cache=cache)[0, -1]
    tokens = []
    for _ in range(32):
        top2 = mx.sort(logits.astype(mx.float32))[-2:]
        assert (top2[1] - top2[0]).item() > 1e-4
        tokens.append(mx.argmax(logits).item())
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    assert len(set(tokens)) > 4  # not a degenerate one-token loop


def test_qwen3_next_has_recurrent_and_attention_layers(tmp_path: Path) -> None:
    model, _ = mlx_lm.load(str(ensure_model("qwen3_next", cache_dir=tmp_path)))
    caches = model.make_cache()
    assert any(isinstance(c, ArraysCache) for c in caches)
    assert any(type(c) is KVCache for c in caches)


def test_dtype_env_default_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESERVE_CACHE", str(tmp_path))
    path = ensure_model(dtype="bfloat16")
    assert path.parent == tmp_path
    model, _ = mlx_lm.load(str(path))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    with pytest.raises(ValueError):
        ensure_model("gemma3", size="small", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        ensure_model("gpt2", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        ensure_model(dtype="int8", cache_dir=tmp_path)


def test_concurrent_processes_publish_one_complete_dir(tmp_path: Path) -> None:
    code = "import sys; from pipeserve.model.tiny.text import ensure_model; print(ensure_model('llama', cache_dir=sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env,
                              text=True) for _ in range(3)]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert outs == {str(tmp_path / model_dir_name("llama", "tiny", "float32"))}
    assert [p.name for p in tmp_path.iterdir()] == [model_dir_name("llama", "tiny", "float32")]
    model, tok = mlx_lm.load(outs.pop())
    assert mlx_lm.generate(model, tok, prompt=_chat(tok), max_tokens=4)


def test_vlm_benchmark_sizes_are_consistent_shapes_and_others_are_refused() -> None:
    """model=tiny_vlm model.size=medium|large (the GPU benchmark shapes): the configs mlx-vlm
    builds from are self-consistent (Qwen's M-RoPE sections cover each head's rotary pairs;
    Gemma's SigLIP pools its patches to the tokens the processor emits), and a size the
    generator does not make is refused at launch naming the sizes it does."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (pip install -e '.[vision]')")
    from hydra import compose, initialize_config_dir

    from pipeserve.model.tiny import vlm as tiny_vlm
    from pipeserve.config import ConfigError, load_config

    marks = {t for ts in tiny_vlm.IMAGE_TOKENS.values() for t in ts}
    ids = {t: i for i, t in enumerate([*marks, *(f"t{i}" for i in range(600))])}
    for size in tiny_vlm.VLM_SIZES:
        q = tiny_vlm._config("qwen2_5_vl", ids, [0, 1], size)
        head_dim = q["hidden_size"] // q["num_attention_heads"]
        assert sum(q["rope_scaling"]["mrope_section"]) * 2 == head_dim, size
        assert q["vision_config"]["out_hidden_size"] == q["hidden_size"]
        for arch in ("qwen3_vl", "qwen3_vl_moe"):
            q3 = tiny_vlm._config(arch, ids, [0, 1], size)["text_config"]
            assert sum(q3["rope_scaling"]["mrope_section"]) * 2 == q3["head_dim"], size
        for arch in ("qwen3_5", "qwen3_5_moe"):
            q35 = tiny_vlm._config(arch, ids, [0, 1], size)["text_config"]
            rope = q35["rope_parameters"]
            assert sum(rope["mrope_section"]) * 2 == q35["head_dim"] * rope["partial_rotary_factor"]
        g = tiny_vlm._config("gemma3", ids, [0, 1], size)
        side, patch = g["vision_config"]["image_size"], g["vision_config"]["patch_size"]
        per_side = int(g["mm_tokens_per_image"] ** 0.5)
        assert per_side ** 2 == g["mm_tokens_per_image"] and (side // patch) % per_side == 0
        proc = tiny_vlm._processor_files("gemma3", size)
        assert proc["processor_config.json"]["image_seq_length"] == g["mm_tokens_per_image"]
    assert tiny_vlm._config("gemma3", ids, [0, 1], "large")["text_config"]["hidden_size"] == 4096
    with pytest.raises(ValueError, match="unknown vision-model size 'small'"):
        tiny_vlm.ensure_model("gemma3", "float32", None, "small")
    conf = Path(__file__).resolve().parents[2] / "pipeserve" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        raw = compose("serve", overrides=["model=tiny_vlm", "model.size=small"])
    with pytest.raises(ConfigError, match="size tiny, medium, large .*model.size=small"):
        load_config(raw)
