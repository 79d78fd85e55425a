"""Prefill/decode disaggregation: engine processes, KV transfers, the front end's router."""
