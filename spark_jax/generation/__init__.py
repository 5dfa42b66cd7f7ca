"""Generation over the runner protocols: the request state and stop rule, the one decode step,
and the drivers built on it (generate / stream, beam search, speculative decoding)."""
