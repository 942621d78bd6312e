"""The HTTP side: the Sanic app (server), the per-model request stages (front), the chat page
and the protocol adapters (api/). Reaches the core only through its face: the EngineClient
(core.client) and the values it names (tests/test_import_graph.py)."""
