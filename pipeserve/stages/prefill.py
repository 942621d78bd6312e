"""Prefill: the model forward over a step's planned tokens — the prompt chunks of many rows
(those that finish their prompt share one padded forward per length bucket), then every
decoding row in one batched forward, with its drafts when it verifies. Returns the logits of
the rows that sample. Engine thread; prompt chunks' KV is evaluated before the step ends, so a
long prompt never builds one giant deferred graph."""
from __future__ import annotations

from typing import ClassVar

from pipeserve.config import ServeConfig
from pipeserve.core.forward import Forward
from pipeserve.core.rows import RowStore
from pipeserve.core.plan import Logits, StepPlan
from pipeserve.core.stage import StageDeps
from pipeserve.kv.attention import on_cuda
from pipeserve.vision import check_backend, check_vision
from pipeserve.vision.rows import PromptMedia


class Prefill:
    name: ClassVar[str] = "prefill"

    def __init__(self, cfg: ServeConfig, deps: StageDeps) -> None:
        if deps.loaded.vision is not None:
            check_vision(cfg, keep_hidden=deps.keep_hidden)
            check_backend(deps.loaded.vision.family, on_cuda())
        self.forward = Forward(deps.model, keep_hidden=deps.keep_hidden,
                               grouped=deps.layout.grouped_prefill and not deps.keep_hidden,
                               fast=cfg.model.fast_decode)
        self.metrics = deps.metrics

    def __call__(self, plan: StepPlan, kv: RowStore) -> Logits:
        grouped = self.forward.prefill(plan.prefill, kv)
        if grouped:
            self.metrics.grouped_prefills.inc(grouped)
        logits = self.forward.decode(plan.decode, kv)
        logits.failed.update(self.forward.failed)
        for rows in (plan.prefill, plan.decode):   # a row's images, counted once: at its first
            for row in rows:                       # chunk, or first decode (a full cache hit)
                media = row.request.media
                if media is not None and not media.counted:
                    self._count(media)
        return logits

    def _count(self, media: PromptMedia) -> None:
        media.counted = True
        self.metrics.images.inc(media.num_images)
        self.metrics.image_tokens.inc(media.num_image_tokens)
        self.metrics.videos.inc(len(media.video_digests))
        self.metrics.video_frames.inc(sum(media.video_frames))
        if media.audio_digests:
            self.metrics.audio_clips.inc(media.num_audios)
            self.metrics.audio_tokens.inc(media.num_audio_tokens)
            self.metrics.audio_seconds.inc(media.audio_seconds)
        if media.encoded:   # a prompt-cache hit over every image skips the tower
            self.metrics.vision_seconds.observe(media.encode_s)
