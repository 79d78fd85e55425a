"""Looped-model implementations, the checkpoint loader and the dense reference."""
