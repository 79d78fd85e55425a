"""vllm-rlt: an inference and serving engine for recurrent-depth (looped) language models.

The names a vLLM user imports: `from vllm_rlt import LLM, SamplingParams, RequestOutput`.
`LLM` (which loads torch) and `__version__` (read from the installed package's metadata) are
resolved on first use, so that `import vllm_rlt` stays light.
"""

from __future__ import annotations

from typing import Any

from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

UNKNOWN_VERSION = "0+unknown"  # a source tree used without `pip install`: no package metadata


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-rlt")
    except PackageNotFoundError:
        return UNKNOWN_VERSION


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from vllm_rlt.entrypoints.llm import LLM

        return LLM
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'vllm_rlt' has no attribute {name!r}")
