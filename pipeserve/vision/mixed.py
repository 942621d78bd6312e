"""Images and videos in one Qwen-VL prompt (Qwen2-VL, Qwen2.5-VL, Qwen3.5; Qwen3-VL's own
get_input_embeddings takes both). mlx-vlm's get_input_embeddings of those takes one kind per
prompt (its pixel_values are the images', else the videos'); this composes the same parts of
its model for both: the vision tower on each kind's pixels, each kind's features merged at its
own tokens (merge_input_ids_with_image_features; Qwen3.5: its masked scatter), and the M-RoPE
positions of both grids (get_rope_index takes both). Engine thread."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

KINDS = (("pixel_values", "image_grid_thw", "image_token_id"),
         ("pixel_values_videos", "video_grid_thw", "video_token_id"))


def takes_both(pixels: dict[str, Any]) -> bool:
    return "pixel_values" in pixels and "pixel_values_videos" in pixels


def input_embeddings(vlm: Any, ids: mx.array, pixels: dict[str, Any], cached: bool,
                     dtype: Any) -> Any:
    """mlx-vlm's InputEmbeddingsFeatures of a prompt with images and videos. `cached`: the
    prompt cache holds every visual token, so the tower is skipped (zeros no chunk reads).
    A Qwen3 tower (Qwen3.5, Qwen3-VL-MoE) also returns deepstack features, merged here in
    the prompt order of the visual tokens, as mlx-vlm's Qwen3-VL merges both kinds'."""
    from mlx_vlm.models.base import InputEmbeddingsFeatures

    inner = vlm.language_model
    embeds = inner.model.embed_tokens(ids)
    tower = vlm.vision_tower
    qwen3 = hasattr(tower, "deepstack_merger_list")
    flat = np.array(ids[0])
    stacks, where = [], []   # per kind: its deepstack features, its tokens' prompt positions
    for values, grid, token_key in KINDS:
        token = getattr(vlm.config, token_key)
        if cached:
            count = int(mx.sum(ids == token).item())
            features, deepstack = mx.zeros((count, embeds.shape[-1]), dtype=dtype), None
        else:
            pv = mx.array(pixels[values]).astype(tower.patch_embed.proj.weight.dtype)
            features = tower(pv, mx.array(pixels[grid]), output_hidden_states=False)
            features, deepstack = features if qwen3 else (features, None)
        if not qwen3:
            embeds = vlm.merge_input_ids_with_image_features(token, token, features, embeds, ids)
            continue
        from mlx_vlm.models.qwen3_vl.qwen3_vl import masked_scatter
        embeds = masked_scatter(embeds, mx.broadcast_to((ids == token)[..., None], embeds.shape),
                                features)
        if deepstack:
            stacks.append(mx.stack(list(deepstack)))
            where.append(np.nonzero(flat == token)[0])
    positions, deltas = inner.get_rope_index(ids, mx.array(pixels["image_grid_thw"]),
                                             mx.array(pixels["video_grid_thw"]),
                                             mx.ones(ids.shape, dtype=mx.int32))
    out = InputEmbeddingsFeatures(inputs_embeds=embeds, position_ids=positions,
                                  rope_deltas=deltas)
    if len(stacks) == len(KINDS):   # the tower ran, with deepstack layers
        order = mx.array(np.argsort(np.concatenate(where), kind="stable"), dtype=mx.uint32)
        out.deepstack_visual_embeds = list(mx.concatenate(stacks, axis=1)[:, order])
        out.visual_pos_masks = mx.array(np.isin(flat, [vlm.config.image_token_id,
                                                       vlm.config.video_token_id])[None])
    return out
