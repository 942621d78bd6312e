"""The `draft` config group (SPEC §3, §4): one schema per proposer option, each declared once
by `@register` (pipeserve/registry.py); its `_target_` names the proposer class, and every
option but `none` is a value of the speculation metrics' `proposer` label. Launch time, main
thread; no mlx import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from pipeserve.errors import ConfigError, check_positive as _positive
from pipeserve.registry import name_of, register


@dataclass
class DraftConfig:
    """Speculative decoding: who proposes tokens for the target to verify (SPEC §4)."""

    _target_: str = MISSING
    num_draft_tokens: int = 3   # tokens proposed per step for the target to verify
    path: Optional[str] = None   # draft=model: the draft model (dir or local HF id);
                                 # draft=eagle3 / dflash: the head's checkpoint directory
    disable_by_batch_size: Optional[int] = None   # draft only while at most this many rows
                                                  # decode (unset: always)
    gate: bool = True   # drafting turns off in batch sizes where it measures slower than plain
                        # decode (tokens per second of each kind of step, per bucket of 1, 2-3,
                        # 4-7, ... decoding rows), and probes drafting there now and then
    gate_ratio: float = 0.95   # draft.gate keeps drafting while its goodput >= this × plain's
                               # (once off, a probe turns it on again at this + 0.05)
    adaptive: bool = True   # each row's draft length follows its recent acceptance (at most
                            # num_draft_tokens); rows whose drafts keep failing pause drafting
    fast_forward: int = 16   # tokens a grammar forces that a row appends in one step, verified
                             # like drafts (0: off)

    @property
    def name(self) -> str:
        """The option (`draft=<name>`): the `proposer` metric label, the name in messages."""
        return name_of(self)

    @property
    def enabled(self) -> bool:
        """Rows draft and verify (every option but draft=none; that one with fast_forward)."""
        return True

    @property
    def proposes(self) -> bool:
        """A proposer offers drafts (every option but draft=none)."""
        return True

    @property
    def keep_hidden(self) -> bool:
        """The target's forwards also return the trunk's hidden states (the proposer drafts
        from them)."""
        return False

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= 64:
            raise ConfigError(
                f"draft.num_draft_tokens must be in [1, 64], got {self.num_draft_tokens}")
        _positive("draft.disable_by_batch_size", self.disable_by_batch_size)
        if not 0 < self.gate_ratio <= 100:
            raise ConfigError(f"draft.gate_ratio must be in (0, 100] (drafting's goodput over "
                              f"plain decode's that keeps it on), got {self.gate_ratio}")
        if not 0 <= self.fast_forward <= 256:
            raise ConfigError(f"draft.fast_forward must be in [0, 256] (0: off), got "
                              f"{self.fast_forward}")
        if self.path is not None and self.name not in ("model", "eagle3", "dflash", "assistant"):
            raise ConfigError(
                f"draft.path={self.path!r} is only used by draft=model, eagle3, dflash and "
                f"assistant; "
                f"draft={self.name} does not load a draft model")


@register("draft", "none", labelled=False)
@dataclass
class NoDraftConfig(DraftConfig):
    _target_: str = "pipeserve.draft.proposers.NoDraft"
    fast_forward: int = 0   # draft=none draft.fast_forward=16: grammar rows fast-forward,
                            # nothing else drafts (needs KV that can be rolled back)

    @property
    def enabled(self) -> bool:
        return self.fast_forward > 0

    @property
    def proposes(self) -> bool:
        return False


@register("draft", "ngram")
@dataclass
class NgramDraftConfig(DraftConfig):
    _target_: str = "pipeserve.draft.proposers.NgramProposer"
    num_draft_tokens: int = 10
    ngram_min: int = 1   # shortest suffix of the text looked up earlier in it
    ngram_max: int = 3   # longest suffix looked up (the longest match proposes)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"draft.ngram_min ({self.ngram_min}) must be >= 1 and <= "
                              f"draft.ngram_max ({self.ngram_max})")


@register("draft", "model")
@dataclass
class ModelDraftConfig(DraftConfig):
    _target_: str = "pipeserve.draft.proposers.ModelProposer"
    path: Optional[str] = MISSING


@register("draft", "mtp")
@dataclass
class MtpDraftConfig(DraftConfig):
    _target_: str = "pipeserve.draft.proposers.MtpProposer"

    @property
    def keep_hidden(self) -> bool:
        return True   # the MTP head drafts from the trunk's hidden states


@register("draft", "eagle3")
@dataclass
class Eagle3DraftConfig(DraftConfig):
    """An EAGLE-3 head reading three of the target's layers (draft.path: its checkpoint
    directory; unset on a generated model: a generated head)."""

    _target_: str = "pipeserve.draft.proposers.Eagle3Proposer"

    @property
    def keep_hidden(self) -> bool:
        return True   # the head drafts from the target's tapped hidden states


@register("draft", "dflash")
@dataclass
class DFlashDraftConfig(DraftConfig):
    """A DFlash block-diffusion drafter fed the target's hidden states (draft.path: its
    checkpoint directory; unset on a generated model: a generated one)."""

    _target_: str = "pipeserve.draft.dflash.DFlashProposer"
    num_draft_tokens: int = 7   # at most the checkpoint's block_size - 1 are drafted

    @property
    def keep_hidden(self) -> bool:
        return True   # the drafter's context is the target's tapped hidden states


@register("draft", "assistant")
@dataclass
class AssistantDraftConfig(DraftConfig):
    """A Gemma 4 assistant drafter reading the target's KV (draft.path: its checkpoint
    directory; unset on a generated Gemma 4: a generated one)."""

    _target_: str = "pipeserve.draft.assistant.AssistantProposer"

    @property
    def keep_hidden(self) -> bool:
        return True   # each round starts from the target's last hidden state
