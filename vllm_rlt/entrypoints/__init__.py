"""User entry points: the `vllm-rlt` command line (serve, generate, bench, inspect,
calibrate-kv-scales, pd-engine), the offline `LLM` API and the OpenAI-compatible server
(`openai/`)."""
