"""Serving one model across the ranks of an `mlx.launch` group: the `distributed`
config group (config.py, no mlx), the plan wire codec (wire.py), the model's sharding through
mlx-lm (shard.py) and the engine's per-step hook that keeps every rank on rank 0's plan
(group.py). Rank 0 serves HTTP; the others run `follow` (follower.py) and never listen."""
