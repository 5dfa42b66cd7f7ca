"""Array operations the model families share: attention dispatch and its reference, KV-cache
pytrees, layers, LoRA and sampling. Imports nothing above it (models, generation, serving)."""
