"""The engine core: the engine thread, its inbox and outbox, the scheduler, the step and its
plan, the forward, the row store, sampling state and the events that cross to the HTTP side.
Imports nothing of pipeserve.http or pipeserve.pool (tests/test_import_graph.py)."""
