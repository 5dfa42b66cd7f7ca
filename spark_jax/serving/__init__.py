"""Continuous batching: the public ``Engine``, its scheduling policy, page pool, executors and
warm-up."""
