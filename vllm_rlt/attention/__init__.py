"""Attention: per-row metadata and backends (torch reference, Triton)."""
