"""HF (safetensors, sharded) and GGUF checkpoints → orbax: ``python -m conversion.hf_to_orbax``."""
