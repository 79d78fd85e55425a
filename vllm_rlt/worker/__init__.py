"""Device side: the only owner of tensors (KV cache, hidden states, model execution)."""
