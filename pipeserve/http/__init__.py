"""The HTTP side: the Sanic app (server), the per-model request stages (front), the chat page
and the protocol adapters (api/). Reaches the core only through its face: core.engine,
core.events, core.stream, core.limits, core.scoring (tests/test_import_graph.py)."""
