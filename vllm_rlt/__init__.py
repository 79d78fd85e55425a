"""vllm-rlt: an inference and serving engine for recurrent-depth (looped) language models."""

__version__ = "0.1.0"
