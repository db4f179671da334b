"""Training the bundled tiny models: BPE tokenizer, data pipeline, JAX + optax training loop, GGUF export."""
