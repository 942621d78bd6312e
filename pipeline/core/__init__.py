"""The engine core: the engine thread, its inbox and outbox, the scheduler, the step and its
plan, the forward, the row store, sampling state and the events that cross to the HTTP side.
Imports nothing of pipeline.http or pipeline.pool (tests/pipeline/test_import_graph.py)."""
