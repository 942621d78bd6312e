"""The tool-call formats of every model family we serve, one module each, in one registry:
markers, the assistant-turn prefix that opens a call, the parser of one call body →
(name, arguments), and the llguidance grammar that enforces a call. Pure Python."""
from __future__ import annotations

from pipeserve.markup.tool_formats import (deepseek, gemma, glm, harmony, hermes, kimi, kimi_k3,
                                           llama3, longcat, minicpm5, minimax, minimax_m3,
                                           mistral, muse_spark, pythonic, qwen3_coder, step3)
from pipeserve.markup.tool_formats.base import Lit, RawCall, Spec, ToolFormat

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    hermes.FORMAT, qwen3_coder.FORMAT, llama3.FORMAT, gemma.GEMMA, gemma.FUNCTION_GEMMA,
    gemma.GEMMA4, harmony.FORMAT, mistral.FORMAT, mistral.FORMAT_V3, glm.FORMAT,
    deepseek.FORMAT, deepseek.FORMAT_V3, kimi.FORMAT, minimax.FORMAT, pythonic.FORMAT,
    minicpm5.FORMAT, kimi_k3.FORMAT, longcat.FORMAT, muse_spark.FORMAT, minimax_m3.FORMAT,
    step3.FORMAT,
)}

__all__ = ["FORMATS", "Lit", "RawCall", "Spec", "ToolFormat"]
