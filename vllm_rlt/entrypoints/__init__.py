"""User entry points: the `vllm-rlt` command line (and later the offline LLM and the server)."""
