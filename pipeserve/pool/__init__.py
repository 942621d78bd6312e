"""The model pool: several models under ids behind one server, each engine in its
own child process. config (schema, no mlx), members (per-model configs), codec (the wire),
child (the child's main), proxy (the parent's engine stand-in), pool (routing, LRU, idle)."""
