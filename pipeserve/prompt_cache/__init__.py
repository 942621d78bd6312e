"""Prompt cache: reusable KV prefixes keyed by token sequence (RAM tier; SSD tier to come).
Engine thread only: entries hold MLX arrays."""
