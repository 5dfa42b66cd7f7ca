"""Continuous batching: the public ``Engine``, its scheduling policy, page pool and warm-up."""
