"""Owns the generated test/benchmark models: deterministic random-weight mlx_lm directories + a byte-level BPE.
Called on the engine thread; weights are numpy (mlx only builds shapes and writes safetensors), so any thread works.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.model.cache import cache_root, publish

ARCHS = ("qwen3", "llama", "gemma3", "qwen3_next", "qwen3_5", "gemma4")
SIZES = ("tiny", "small", "base", "medium", "large")
DTYPES = ("float32", "bfloat16", "float16")
FORMAT_VERSION = 1
# Per-arch format, bumped when only that arch's files change (qwen3_next 2: + mtp.safetensors).
ARCH_FORMAT_VERSION = {"qwen3_next": 2}
SEED = 20240611
VOCAB_SIZE = 512
WIDE_SIZES = ("medium", "large")   # 16,384-row vocabularies (the real models' shape class)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CORPUS = """\
The morning train left the station at seven, and the passengers settled into their seats with coffee and newspapers. \
Outside the window, fields of wheat rolled past under a pale sky, and a farmer waved from a red tractor near the river.
A good server answers every request quickly, streams tokens as soon as they are ready, and never blocks the event loop. \
When the queue is full it says so politely instead of failing silently; when a client disconnects it frees the cache.
She opened the old notebook and read the first line again: "Write what you see, not what you expect to see." \
The handwriting was her grandmother's, small and careful, and the ink had faded to the colour of weak tea.
In the quiet library, students whispered about exams, recipes, football scores and the weather in distant cities. \
Somebody asked whether the museum would open on Sunday; nobody knew, so they checked the website together.
Numbers appear everywhere: 3.14159, 2.71828, 1024, 4096, 65536, the year 1999, room 42 and the price $19.99.
Questions, answers, lists and short notes: What time is it? It is half past three. Where are my keys? On the table.
Unicode matters too: a café in Zürich served crème brûlée to a naïve tourist; the façade was painted jaune.
日本語のテキストも少し含めます。東京は大きな都市です。中文也可以：你好，世界。Привет, мир! Γειά σου κόσμε.
Emoji show up in chat messages 🙂 🚀 🎉 👍 ❤️ and the tokenizer must keep every byte of them intact. ✨ ✅ 🌍
def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]

for index, value in enumerate(fibonacci(10)):
    print(f"{index}: {value}")

class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.tokens: list[int] = []

    def is_done(self) -> bool:
        return len(self.tokens) >= self.max_tokens

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
if (items.length > 0 && items[0] !== null) { console.log("ok", items); } else { throw new Error("empty"); }
SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY count(*) DESC;
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "temperature": 0.7, "stream": true}
{"id": "chatcmpl-123", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}]}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "required": ["city"]}
{"usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}, "error": null, "ok": false}
The assistant thought for a moment and then replied: "I can help with that. First, let us read the file; \
then we will count the words, sort them by frequency, and print the ten most common ones with their counts."
Rain fell on the roof all night. By dawn the streets were clean, the air smelled of wet stone and bread, \
and the bakery on the corner had already sold most of its croissants to people hurrying to work.
The user said hello. The model said hello back. They talked about books, music, travel, history and science, \
and the conversation went on until the battery of the small laptop finally died with a short beep.
"""

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """Train the shared byte-level BPE (deterministic) and return a `tokenizers.Tokenizer`.
    A larger `vocab_size` (the medium/large shapes' 16,384 rows) appends decode-only entries:
    letter strings with no merge, so encoding is unchanged but every id the model can sample
    decodes to visible text (a benchmark then measures the detokenizer and a client's first
    visible token, not a stream of empty strings)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if vocab_size > VOCAB_SIZE:
        tok = _widen(tok, vocab_size)
    return tok


def _widen(tok: Any, vocab_size: int) -> Any:
    """The BPE with decode-only entries up to `vocab_size` ids: two- then three-letter strings
    not already in the vocabulary, ids after the added tokens."""
    from itertools import product
    from string import ascii_lowercase

    from tokenizers import Tokenizer
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in spec["added_tokens"]}
    next_id = VOCAB_SIZE
    for n in (2, 3):
        for letters in product(ascii_lowercase, repeat=n):
            if next_id == vocab_size:
                break
            word = "".join(letters)
            if word not in taken:
                vocab[word] = next_id
                next_id += 1
    assert next_id == vocab_size, next_id
    return Tokenizer.from_str(json.dumps(spec))


def _model_config(arch: str, size: str, eos: list[int]) -> dict[str, Any]:
    """config.json of a generated model; a Qwen3.5 one nests its decoder under text_config,
    as the released (multimodal) Qwen3.5 checkpoints do."""
    dims = {  # layers, hidden, heads, kv heads, head_dim, intermediate
        "tiny": (2, 64, 4, 2, 16, 128),
        "small": (8, 512, 8, 4, 64, 2048),
        "base": (12, 768, 12, 4, 64, 3072),
        "medium": (28, 1024, 16, 8, 128, 3072),    # Qwen3-0.6B's shape
        "large": (36, 4096, 32, 8, 128, 12288),    # Qwen3-8B's shape
    }[size]
    layers, hidden, heads, kv_heads, head_dim, inter = dims
    if arch == "qwen3_5":   # every KV layout works: affine groups of 64, turbo's power of two
        head_dim = 64
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        # GPU-benchmark shapes get a 16k embedding (rows past the tokenizer are never produced
        # by it) so the output head costs what a real model's does.
        "vocab_size": 16384 if size in WIDE_SIZES else VOCAB_SIZE,
        "max_position_embeddings": 4096 if size in ("tiny", "small", "base") else 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": size != "large", "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": None, "pad_token_id": eos[1], "eos_token_id": eos,
    }
    if arch == "qwen3":
        cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    elif arch == "llama":
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                   mlp_bias=False)
    elif arch == "gemma3":
        cfg.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                   sliding_window=32, sliding_window_pattern=2, rope_local_base_freq=10000.0)
        del cfg["hidden_act"]
    elif arch == "gemma4":
        # Gemma 4's text decoder with full-attention layers only (rolled back after a verify,
        # so Gemma's assistant drafters can be served with it); no per-layer inputs, no KV
        # sharing inside the trunk; qwen3_5's successor output head (its assistant guesses it)
        cfg.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"],
                   tie_word_embeddings=False,
                   hidden_activation="gelu_pytorch_tanh", global_head_dim=head_dim,
                   num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                   vocab_size_per_layer_input=cfg["vocab_size"], use_double_wide_mlp=False,
                   final_logit_softcapping=30.0, sliding_window=32,
                   layer_types=["full_attention"] * layers,
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1000000.0}})
        del cfg["hidden_act"], cfg["rope_theta"]
    elif arch == "qwen3_next":
        cfg.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                   num_hidden_layers=4, full_attention_interval=4, partial_rotary_factor=0.25,
                   linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                   num_experts_per_tok=1, decoder_sparse_step=1, mlp_only_layers=[],
                   shared_expert_intermediate_size=inter, moe_intermediate_size=inter,
                   num_nextn_predict_layers=1)  # the MTP depth vLLM's qwen3_next_mtp reads
    elif arch == "qwen3_5":
        # Qwen3.5's decoder (GatedDeltaNet + gated attention, both with the qwen3_next layer
        # code) at the generated widths; attention every 2nd layer, so tiny has two KV layers.
        text = {k: v for k, v in cfg.items() if k != "rope_theta"}
        lin = (4, 2, 16) if size == "tiny" else (heads, kv_heads, head_dim)   # v heads, k heads, dim
        text.update(model_type="qwen3_5_text", num_hidden_layers=max(layers, 4),
                    full_attention_interval=2, linear_num_value_heads=lin[0],
                    linear_num_key_heads=lin[1], linear_key_head_dim=lin[2],
                    linear_value_head_dim=lin[2], linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                     "partial_rotary_factor": 0.25},
                    tie_word_embeddings=False,   # the MTP head's guess needs its own output head
                    mtp_num_hidden_layers=1)   # the MTP depth vLLM's qwen3_5_mtp reads
        cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "tie_word_embeddings": False, "bos_token_id": None,
               "pad_token_id": eos[1], "eos_token_id": eos, "text_config": text}
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return cfg


EMBED_SCALE = 4.0  # tied logits are norm(h) @ E.T: std EMBED_SCALE/sqrt(hidden) -> logit std ~4
# Residual branches outweigh the token embedding, so greedy text does not just repeat the last token.
# qwen3_5's output head maps a token to its successor instead (below), so its branches only need
# to pull the target off that successor some of the time: at 0.6 about one greedy step in five
# (a larger gain lowers how often its MTP head's first draft is accepted).
# gemma4's post-branch norms at 4 pull it off its successor head about half the time: its
# generated assistant's drafts (the successor, mostly) are then kept about half the time.
GEMMA4_GAIN = 4.0
BRANCH_GAIN = {"qwen3": 12.0, "llama": 12.0, "gemma3": 48.0, "qwen3_next": 12.0, "qwen3_5": 0.6,
               "gemma4": GEMMA4_GAIN}
_BRANCH_OUT = ("o_proj", "down_proj", "out_proj")
# The Qwen3.5 stand-in's MTP head: fc passes the next token's embedding through (plus a little
# of the trunk's hidden state) and its layer's branches are weak, so it guesses the successor
# of the token it is given; the target's context moves it off that guess now and then, so
# drafts are accepted about as often as a trained head's, and rejected too.
MTP_EMBED_GAIN, MTP_HIDDEN_GAIN, MTP_BRANCH_GAIN = 1.0, 0.25, 0.25
GEMMA_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def _fill(name: str, shape: tuple[int, ...], arch: str, hidden: int) -> np.ndarray:
    """Deterministic numpy value of one parameter, seeded by (SEED, crc32(name))."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    leaf = name.rsplit(".", 1)[-1]
    if ("norm" in name and len(shape) == 1) or leaf == "layer_scalar":
        if arch not in ("gemma3", "gemma4"):
            return np.ones(shape, np.float32)
        # Gemma's post-branch norms carry the branch gain (gemma3's RMSNorm computes
        # x * (1 + w), gemma4's x * w).
        gain = BRANCH_GAIN[arch] if any(k in name for k in GEMMA_POST_NORMS) else 1.0
        return np.full(shape, gain - (arch == "gemma3"), np.float32)
    if leaf == "A_log":  # GatedDeltaNet decay, as in the reference init
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if leaf == "dt_bias":
        return np.ones(shape, np.float32)
    if leaf == "bias":
        return np.zeros(shape, np.float32)
    if arch == "qwen3_5" and name == "mtp.fc.weight":   # (H, 2H): [embedding | hidden] inputs
        fc = rng.standard_normal(shape, dtype=np.float32) * np.float32(MTP_HIDDEN_GAIN / np.sqrt(hidden))
        fc[:, :hidden] = np.eye(hidden, dtype=np.float32) * np.float32(MTP_EMBED_GAIN)
        return fc
    if arch in ("qwen3_5", "gemma4") and name.endswith("lm_head.weight"):
        # the embedding's rows in a seeded 512-cycle order: norm(e_t) @ lm_head.T peaks at
        # succ(t), so without its branches the model walks the whole vocabulary
        embed = _fill(name.replace("lm_head", "model.embed_tokens"), shape, arch, hidden)
        order = np.random.default_rng([SEED, zlib.crc32(b"successor")]).permutation(shape[0])
        pred = np.empty_like(order)
        pred[np.roll(order, -1)] = order   # pred[succ(t)] = t
        return embed[pred]
    if "embed_tokens" in name or "lm_head" in name:
        std = EMBED_SCALE / np.sqrt(hidden)
    else:  # fan-in scaled: keeps activations O(1); branch outputs get BRANCH_GAIN (not gemma: see norms)
        std = 1.0 / np.sqrt(int(np.prod(shape[1:])))
        if arch not in ("gemma3", "gemma4") and any(k in name for k in _BRANCH_OUT):
            std *= MTP_BRANCH_GAIN if arch == "qwen3_5" and name.startswith("mtp.") else BRANCH_GAIN[arch]
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _write_model(out: Path, arch: str, size: str, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = _model_config(arch, size, [0, 0])   # for its vocab_size; eos set below
    rows = config.get("text_config", config)["vocab_size"]
    tok = build_tokenizer(rows)
    vocab = tok.get_vocab()
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    assert tok.get_vocab_size() == rows, tok.get_vocab_size()
    config = _model_config(arch, size, eos)
    config["torch_dtype"] = dtype
    text = config.get("text_config", config)
    model_cls, args_cls = _get_classes(config)
    # lazy init: only shapes/names are used (on a copy: qwen3_5's args rewrite nested dicts)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(config))))
    mx_dtype = getattr(mx, dtype)
    params = [(name, tuple(param.shape)) for name, param in sorted(tree_flatten(model.parameters()))
              # gemma3_text drops lm_head when the checkpoint lacks it
              if not (name.startswith("lm_head") and config["tie_word_embeddings"])]
    mtp_layers = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers")

    # Each tensor has its own seeded generator and numpy samples outside the GIL, so threads give
    # the same bytes as a loop; an 8B-shaped model is mostly this sampling. MLX streams belong to
    # the calling thread, so the conversion stays here.
    weights: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        arrays = pool.map(lambda item: _fill(*item, arch, text["hidden_size"]), params)
        for (name, _), arr in zip(params, arrays):
            weights[name] = mx.array(arr).astype(mx_dtype)
    if mtp_layers and arch == "qwen3_5":
        # beside the trunk, as in the released Qwen3.5 shards (mlx-lm's sanitize drops mtp.*)
        weights.update(_mtp_weights(model.language_model.args, mtp_layers, arch, mx_dtype))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    if mtp_layers and arch == "qwen3_next":
        _write_mtp(out, model.args, mtp_layers, arch, mx_dtype)
    del model
    tok.save(str(out / "tokenizer.json"))
    added = {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + ADDED_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": text["max_position_embeddings"],
        "split_special_tokens": False, "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    gen_cfg = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
               "eos_token_id": eos, "pad_token_id": eos[1]}
    for fname, obj in (("config.json", config), ("tokenizer_config.json", tok_cfg),
                       ("special_tokens_map.json", special_map), ("generation_config.json", gen_cfg)):
        (out / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _mtp_weights(args: Any, num_layers: int, arch: str, mx_dtype: Any) -> dict[str, Any]:
    """The multi-token-prediction head under the released checkpoints' `mtp.*` names. Values
    come from `_fill`, whose per-name seeds leave every other tensor unchanged; norms are
    stored as the trunk's are (mlx-lm layout)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from pipeserve.draft.mtp import MtpBlock

    block = MtpBlock(args, num_layers=num_layers, moe=args.num_experts > 0)
    return {f"mtp.{name}": mx.array(_fill(f"mtp.{name}", tuple(p.shape), arch, args.hidden_size)
                                    ).astype(mx_dtype)
            for name, p in sorted(tree_flatten(block.parameters()))}


def _write_mtp(out: Path, args: Any, num_layers: int, arch: str, mx_dtype: Any) -> None:
    """Qwen3-Next's head in its own file: mlx-lm reads only model*.safetensors, and its
    qwen3_next sanitize keeps mtp.* for a model without experts, so they would break its
    strict load."""
    import mlx.core as mx

    mx.save_safetensors(str(out / "mtp.safetensors"), _mtp_weights(args, num_layers, arch, mx_dtype),
                        metadata={"format": "mlx"})


def model_dir_name(arch: str, size: str, dtype: str) -> str:
    version = ARCH_FORMAT_VERSION.get(arch, FORMAT_VERSION)
    if size in WIDE_SIZES:
        version = max(version, 2)   # 2: the tokenizer covers the 16,384-row vocabulary
    return f"{arch}-{size}-{dtype}-v{version}"


def ensure_model(arch: str = "qwen3", size: str = "tiny", dtype: str = "float32",
                 cache_dir: str | Path | None = None) -> Path:
    """Return a directory loadable by mlx_lm.load(path) (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json).
    Generated on first use into cache_dir (default: $PIPESERVE_CACHE or ~/.cache/pipeserve/models)
    under a name derived from arch/size/dtype and FORMAT_VERSION; later calls reuse it.
    Written atomically (temp dir + rename) so two processes racing do not corrupt it."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if size != "tiny" and arch != "qwen3" and not (arch == "qwen3_5" and size == "small"):
        raise ValueError(f"size {size!r} exists only for arch 'qwen3' (and 'small' for "
                         f"'qwen3_5'), not {arch!r}")
    final = cache_root(cache_dir) / model_dir_name(arch, size, dtype)
    return publish(final, lambda tmp: _write_model(tmp, arch, size, dtype))
