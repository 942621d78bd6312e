"""Acceptance of drafted tokens against the target's verify forward, for a ragged batch, in mlx.
Greedy (longest matching prefix) and speculative sampling (Leviathan et al. 2023, Chen et al.
2023) with request-local PRNG keys. Engine thread; all results are lazy mx arrays.

Shapes: rows R, padded draft length k, vocabulary V. Row r drafted `num_draft[r]` <= k tokens;
draft positions at or past that are padding and never accepted. Verify position i holds the
target's distribution for the token after draft i-1 (position 0: after the last emitted token),
so the target has k + 1 positions. Both functions return

    num_accepted  (R,) int32    drafts accepted, 0..num_draft[r]
    emitted       (R, k+1) int32  row r emits emitted[r, :num_accepted[r] + 1] (the accepted
                                  drafts, then the target's own token); the rest is PAD_ID

`emitted_lists` turns them into Python lists."""
from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

PAD_ID = -1


def _accepted_prefix(accept: mx.array, num_draft: mx.array) -> mx.array:
    """(R, k) per-position accept flags -> (R,) length of the accepted prefix within num_draft."""
    k = accept.shape[1]
    if k == 0:
        return mx.zeros((accept.shape[0],), dtype=mx.int32)
    valid = mx.arange(k)[None, :] < num_draft[:, None]
    ok = (accept & valid).astype(mx.int32)
    return mx.cumprod(ok, axis=1).sum(axis=1).astype(mx.int32)


def _emit(draft_ids: mx.array, num_accepted: mx.array, final_ids: mx.array) -> mx.array:
    """Accepted drafts, then final_ids[r] at position num_accepted[r], then PAD_ID."""
    rows, k = draft_ids.shape
    pos = mx.arange(k + 1)[None, :]
    drafts = mx.concatenate([draft_ids.astype(mx.int32), mx.zeros((rows, 1), mx.int32)], axis=1)
    a = num_accepted[:, None]
    out = mx.where(pos < a, drafts, final_ids.astype(mx.int32)[:, None])
    return mx.where(pos <= a, out, PAD_ID)


def accept_greedy(target_logits: mx.array, draft_ids: mx.array,
                  num_draft: mx.array) -> tuple[mx.array, mx.array]:
    """target_logits (R, k+1, V) (after any masks/biases), draft_ids (R, k), num_draft (R,).
    A draft is accepted while it equals the target's argmax at its position; the token after
    the accepted prefix is the target's argmax there (the bonus token when all were accepted)."""
    target_ids = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (R, k+1)
    k = draft_ids.shape[1]
    num_accepted = _accepted_prefix(draft_ids.astype(mx.int32) == target_ids[:, :k],
                                    num_draft.astype(mx.int32))
    final = mx.take_along_axis(target_ids, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, _emit(draft_ids, num_accepted, final)


def _split3(keys: mx.array) -> mx.array:
    return mx.vmap(lambda key: mx.random.split(key, 3))(keys)


def _uniform_rows(keys: mx.array, n: int) -> mx.array:
    return mx.vmap(lambda key: mx.random.uniform(shape=(n,), key=key))(keys)


def _categorical_rows(keys: mx.array, logits: mx.array) -> mx.array:
    return mx.vmap(lambda key, row: mx.random.categorical(row, key=key))(keys, logits)


def accept_sampling(target_probs: mx.array, draft_probs: mx.array | None, draft_ids: mx.array,
                    num_draft: mx.array, keys: mx.array | Sequence[mx.array],
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Speculative sampling: the emitted tokens are distributed exactly as sampling one token at
    a time from target_probs.

    target_probs (R, k+1, V): the target's final sampling distribution per position (after
    temperature, top-p/top-k, masks). draft_probs (R, k, V): the distribution each draft was
    sampled from, or None for deterministic drafts (n-gram: q is one-hot on the drafted id).
    keys: one mx.random key per row ((R, 2) uint32, or a sequence of (2,) keys).

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    the row's last token is drawn from normalize(max(p_i - q_i, 0)); when all num_draft[r] were
    accepted it is drawn from p at position num_draft[r]. Each row's draws use only its own key,
    so a request's stream does not depend on the rest of the batch. Returns
    (num_accepted, emitted, next_keys (R, 2)); store next_keys[r] back on row r."""
    if not isinstance(keys, mx.array):
        keys = mx.stack(list(keys))
    rows, k = draft_ids.shape
    p = target_probs.astype(mx.float32)
    ids = draft_ids.astype(mx.int32)
    split = _split3(keys)
    next_keys, accept_keys, sample_keys = split[:, 0], split[:, 1], split[:, 2]

    p_draft = mx.take_along_axis(p[:, :k], ids[..., None], axis=-1)[..., 0]  # (R, k)
    if draft_probs is None:
        q_draft = mx.ones_like(p_draft)
    else:
        q = draft_probs.astype(mx.float32)
        q_draft = mx.take_along_axis(q, ids[..., None], axis=-1)[..., 0]
    # u < p/q without dividing: q may be 0 at padding; u in [0, 1) so p >= q always accepts
    accept = _uniform_rows(accept_keys, k) * q_draft < p_draft
    num_accepted = _accepted_prefix(accept, num_draft.astype(mx.int32))

    a = num_accepted[:, None, None]
    p_last = mx.take_along_axis(p, a, axis=1)[:, 0]  # (R, V)
    rejected = num_accepted < num_draft.astype(mx.int32)
    if k == 0:
        dist = p_last
    else:
        a_draft = mx.minimum(a, k - 1)
        if draft_probs is None:
            d_last = mx.take_along_axis(ids, a_draft[:, :, 0], axis=1)  # (R, 1)
            q_last = (mx.arange(p.shape[-1])[None, :] == d_last).astype(mx.float32)
        else:
            q_last = mx.take_along_axis(q, a_draft, axis=1)[:, 0]
        residual = mx.maximum(p_last - q_last, 0.0)
        # a rejection with an all-zero residual only happens through rounding when p == q
        use_residual = rejected & (residual.sum(axis=-1) > 0)
        dist = mx.where(use_residual[:, None], residual, p_last)
    final = _categorical_rows(sample_keys, mx.log(dist))
    return num_accepted, _emit(ids, num_accepted, final), next_keys


def emitted_lists(num_accepted: mx.array, emitted: mx.array) -> list[list[int]]:
    """Host lists: row r -> its num_accepted[r] + 1 emitted token ids (evaluates the arrays)."""
    counts = num_accepted.tolist()
    return [row[:n + 1] for row, n in zip(emitted.tolist(), counts)]
