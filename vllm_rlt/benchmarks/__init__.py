"""Benchmarks behind `vllm-rlt bench serve|throughput|latency`: workloads, drivers that replay
them (the async engine in this process, or a server's OpenAI API) and the metrics of
docs/benchmarks/README.md §2. Research benchmarks that need more than the installed package stay
in the repository's `benchmarks/`."""
