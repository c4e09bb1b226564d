"""How other libraries (transformers, vLLM) load converted checkpoints through the runtime."""
