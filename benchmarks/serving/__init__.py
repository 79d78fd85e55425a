"""The serving benchmark's former home: it is now `vllm-rlt bench serve` (vllm_rlt/benchmarks/),
which `python -m benchmarks.serving` runs."""
