"""Model serving: the model catalog, GGUF metadata, and the inference engine."""
