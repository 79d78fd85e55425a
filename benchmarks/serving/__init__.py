"""The serving benchmark's former home: it is now `vllm-rlt bench serve`
(vllm_rlt/entrypoints/bench/), which `python -m benchmarks.serving` runs."""
