"""The model's output markup: its reasoning format (think markers or harmony channels) and its
tool-call format, inferred once at load from the tokenizer, the chat template and
`model.tool_call_format` / `model.reasoning_format`. One OutputMarkup is built with the
request stages (pipeserve/http/front.py) and handed to tokenize (open think spans, tool grammars),
detokenize (markers that decoding keeps) and the output path (pipeserve/http/api: the reasoning
splitter and the tool-call parser). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeserve.markup.tool_formats import FORMATS, ToolFormat
from pipeserve.markup.tool_formats import harmony

THINK_PAIRS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
               ("<|think:start|>", "<|think:end|>"))
# Every marker an output parser may need to see, whichever family the model is: decoding keeps
# these even where a tokenizer marks them special. (A format's `inner` markers are kept only
# when the model uses that format: harmony's <|end|> is another model's end-of-turn.)
KNOWN_MARKERS = frozenset({m for f in FORMATS.values() for m in f.markers}
                          | {m for pair in THINK_PAIRS for m in pair})
XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")   # Kimi-K3's vocabulary
REASONING_FORMATS = ("auto", "none", "think", "harmony")


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str


@dataclass(frozen=True)
class OutputMarkup:
    """`think`: the reasoning span's markers (None: no think span). `channels`: the output is
    harmony messages (analysis → reasoning, final → content, commentary calls → tool calls).
    `tool_format`: how the model writes tool calls (None: calls are not parsed). `kept`:
    markers decoding keeps."""

    think: ThinkMarkers | None = None
    tool_format: ToolFormat | None = None
    kept: frozenset[str] = KNOWN_MARKERS
    channels: bool = False

    @classmethod
    def infer(cls, tokenizer: Any, tool_call_format: str = "auto",
              reasoning_format: str = "auto") -> OutputMarkup:
        """The markup of the model behind `tokenizer`; `tool_call_format` is
        model.tool_call_format (auto | none | a format name), `reasoning_format`
        model.reasoning_format (auto | none | think | harmony)."""
        fmt = resolve_tool_format(tool_call_format, tokenizer)
        template = _template_text(getattr(tokenizer, "chat_template", None))
        if reasoning_format == "auto":
            reasoning_format = "harmony" if _is_harmony(template) else "think"
        channels = reasoning_format == "harmony"
        think = infer_think(tokenizer) if reasoning_format == "think" else None
        kept = KNOWN_MARKERS | frozenset(fmt.inner if fmt else ())
        if channels:
            kept |= frozenset(harmony.MARKERS)
        return cls(think=think, tool_format=fmt, kept=kept, channels=channels)

    def open_span(self, prompt_text: str) -> str:
        """The opened think span when the rendered prompt ends inside one (templates that write
        `<think>` into the generation prompt), else ''. The model then emits only the end marker."""
        if self.think is None:
            return ""
        if not prompt_text.rstrip().endswith(self.think.start):
            return ""
        return prompt_text[prompt_text.rindex(self.think.start):]

    def describe(self) -> str:
        reasoning = ("harmony channels" if self.channels else
                     f"think markers {f'{self.think.start}…{self.think.end}' if self.think else 'none'}")
        return (f"tool calls {self.tool_format.name if self.tool_format else 'not parsed'}, "
                f"{reasoning}")


def infer_think(tokenizer: Any) -> ThinkMarkers | None:
    """The tokenizer's think markers (mlx-lm knows single-token ones), else a pair the chat
    template writes, else None."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        return ThinkMarkers(start, end)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        for start, end in THINK_PAIRS:
            if start in template and end in template:
                return ThinkMarkers(start, end)
    return None


def _template_text(chat_template: Any) -> str:
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, dict):
        return "\n".join(map(str, chat_template.values()))
    return ""


def _is_harmony(text: str) -> bool:
    return "<|channel|>" in text and "<|message|>" in text


# (format, a test on the template text), most specific first: several families share
# <tool_call>, so the markers inside a call decide.
_INFERENCE: tuple[tuple[str, Any], ...] = (
    ("harmony", _is_harmony),
    ("minimax_m3", lambda t: "]<]minimax[>[" in t),
    ("step3", lambda t: "<steptml:invoke" in t),
    ("minimax_m2", lambda t: "<minimax:tool_call>" in t),
    ("gemma4", lambda t: "<|tool_call>" in t and "<tool_call|>" in t),
    ("function_gemma", lambda t: "<start_function_call>" in t),
    ("longcat", lambda t: "<longcat_tool_call>" in t),
    ("muse_spark", lambda t: "<atem:function_calls>" in t),
    ("glm", lambda t: "<arg_key>" in t),
    ("qwen3_coder", lambda t: "<tool_call>\n<function=" in t or "<tool_call>\\n<function=" in t),
    ("kimi_k2", lambda t: "<|tool_calls_section_begin|>" in t),
    ("deepseek_v3", lambda t: "tool▁sep" in t and "```json" in t),
    ("deepseek_v31", lambda t: "tool▁sep" in t),
    ("minicpm5", lambda t: '<function name="' in t and '<param name="' in t),
    ("mistral", lambda t: "[TOOL_CALLS]" in t and "[ARGS]" in t),
    ("mistral_v3", lambda t: "[TOOL_CALLS]" in t),
    ("hermes", lambda t: "<tool_call>" in t),
    ("pythonic", lambda t: "<|python_start|>" in t or "[func_name1(" in t),
    ("llama3", lambda t: "<|python_tag|>" in t),
    ("gemma", lambda t: "tool_code" in t),
)


def infer_tool_format(chat_template: Any, vocab: dict[str, int]) -> str | None:
    """The format a chat template renders tool calls in (mirrors mlx-lm's inference)."""
    text = _template_text(chat_template)
    found = next((name for name, test in _INFERENCE if test(text)), None)
    if found is None and all(t in vocab for t in XTML_TOKENS):
        return "kimi_k3"   # its templates build the markers from parts; its vocabulary has them
    return found


def resolve_tool_format(setting: str, tokenizer: Any) -> ToolFormat | None:
    """`model.tool_call_format` (auto | none | a format name) → the format, or None."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    name = infer_tool_format(getattr(tokenizer, "chat_template", None), tokenizer.get_vocab())
    return FORMATS[name] if name else None
