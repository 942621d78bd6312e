"""Speculative decoding building blocks (model-independent): n-gram proposer, acceptance rules,
and the Qwen3-Next MTP head. Engine thread."""
