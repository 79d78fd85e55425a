"""Test setup: Triton runs under its interpreter on machines without CUDA; `gpu` tests need
--run-gpu (and a GPU)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # Tiny test models gain nothing from intra-op threads, and on a 2-core machine that is
        # busy elsewhere each parallel region can wait a scheduler quantum (measured: 15x slower).
        torch.set_num_threads(1)
        from tests.triton_interpreter import install

        install()  # the same results, without a redundant patch per device-function call
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass

import pytest  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", help="run tests marked gpu (needs CUDA)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="GPU test: pass --run-gpu on a machine with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
