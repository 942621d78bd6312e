"""KV state: per-row caches and the shared decode batch. Engine thread only."""
