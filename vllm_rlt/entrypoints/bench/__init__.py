"""`vllm-rlt bench serve|throughput|latency`: workloads, drivers that replay them (the async
engine in this process, or a server's OpenAI API) and the metrics of docs/benchmarks/README.md
§2. The repository's one benchmarks package, `benchmarks/` (its measurement tools and
development probes), builds on these; it is not installed."""
