"""User entry points: the `vllm-rlt` command line (serve, generate, bench, inspect, pd-engine),
the offline `LLM` API and the OpenAI-compatible server (`openai/`)."""
