"""Triton kernels (paged attention, ...)."""
