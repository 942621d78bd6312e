"""pipeserve framework: config, engine, scheduler, request state, metrics, HTTP adapters."""
