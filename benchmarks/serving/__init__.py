"""Serving benchmark: workloads, drivers (in-process async engine, HTTP OpenAI API), metrics.

Both drivers produce the same per-request records, and one function turns records into the
metrics of BENCHMARKS.md, so in-process and HTTP numbers are computed the same way.
"""
