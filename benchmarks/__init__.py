"""Benchmarks (outside the engine's import path): `python -m benchmarks.<name> --help`."""
