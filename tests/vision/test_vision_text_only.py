"""model.vision=false: a vision-language checkpoint — every released Qwen3.5 is one —
served text only, its towers not loaded, so what does not compose with image rows composes
again: here Qwen3.5's MTP head drafting (draft=mtp), lossless against the plain decode of the
same weights served as a VLM. Real models: the generated `model=tiny_vlm model.arch=qwen3_5`
checkpoint (with its MTP head) through the real loader and engine."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import startup_error

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")

VLM = ("model=tiny_vlm", "model.arch=qwen3_5")
PROMPT = [40 + (i * 13) % 300 for i in range(40)]
EOS_OFF = {0: -100.0, 2: -100.0}


def test_draft_mtp_needs_the_text_only_vlm_and_is_lossless_there(engine_factory: Any,
                                                                   model_cache: Path) -> None:
    refused = startup_error(model_cache, *VLM, "draft=mtp")
    assert "draft=mtp with a vision-language model" in refused
    assert "model.vision=false" in refused
    plain = engine_factory(*VLM)
    assert plain.loaded.vision is not None
    expected = plain.generate(PROMPT, max_tokens=24, logit_bias=EOS_OFF)["ids"]
    text_only = engine_factory(*VLM, "model.vision=false", "draft=mtp")
    assert text_only.loaded.vision is None
    assert text_only.generate(PROMPT, max_tokens=24, logit_bias=EOS_OFF)["ids"] == expected
    # the head drafted and every draft was verified (this trunk is not the successor-shaped
    # one of model=tiny's qwen3_5, so its guesses are seldom right: acceptance is tested there)
    assert text_only.metrics.spec_proposed.labels("mtp")._value.get() > 0
