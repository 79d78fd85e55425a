"""The top-level names a vLLM user imports, and a light `import vllm_rlt`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import vllm_rlt


def test_vllm_names_import_from_the_package():
    from vllm_rlt import LLM, RequestOutput, SamplingParams
    from vllm_rlt.entrypoints.llm import LLM as EntryLLM
    from vllm_rlt.outputs import RequestOutput as Outputs

    assert LLM is EntryLLM and RequestOutput is Outputs
    assert SamplingParams(max_tokens=3).max_tokens == 3
    assert set(vllm_rlt.__all__) >= {"LLM", "SamplingParams", "RequestOutput", "__version__"}
    with pytest.raises(AttributeError, match="no_such_name"):
        vllm_rlt.no_such_name  # noqa: B018


def test_version_comes_from_the_package_metadata(monkeypatch):
    assert vllm_rlt.__version__ == importlib.metadata.version("vllm-rlt")

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert vllm_rlt.__version__ == vllm_rlt.UNKNOWN_VERSION


def test_import_loads_no_torch():
    code = "import sys, vllm_rlt; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
