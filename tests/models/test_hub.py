"""Hub ids resolve through huggingface_hub's cache (offline here: tests/conftest.py sets
HF_HUB_OFFLINE): a model in a hub-layout cache loads by `org/name` and revision, with the same
results as its directory; one missing from the cache is one clear error, from the API and the
CLI; directories and paths keep meaning directories."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.hub import resolve_model_dir
from vllm_rlt.models.loader import CheckpointError
from vllm_rlt.models.tiny import default_model_dir, write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A hub cache holding org/tiny at main (the packaged model) and at tag v1 (another)."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--org--tiny"
    for ref, sha in (("main", "a" * 40), ("v1", "b" * 40)):
        snapshot = repo / "snapshots" / sha
        if ref == "main":
            shutil.copytree(default_model_dir(), snapshot)
        else:
            write_tiny_ouro(snapshot, vocab_size=256, seed=3)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return root


def test_a_cached_hub_id_loads_like_its_directory(cache):
    main = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    assert resolve_model_dir("org/tiny", None, str(cache)) == main
    assert resolve_model_dir("org/tiny", "v1", str(cache)).name == "b" * 40
    by_id = LLM("org/tiny", download_dir=str(cache), device="cpu", num_kv_blocks=64)
    by_dir = LLM(str(main), device="cpu", num_kv_blocks=64)
    outs = [llm.generate("import os", GREEDY, use_tqdm=False)[0] for llm in (by_id, by_dir)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert len(outs[0].outputs[0].token_ids) == 4


def test_directories_stay_directories(tmp_path):
    assert resolve_model_dir(None) == default_model_dir()
    assert resolve_model_dir(str(default_model_dir())) == default_model_dir()
    missing = tmp_path / "missing"  # an absolute path is never a hub id
    assert resolve_model_dir(str(missing)) == missing
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(missing), device="cpu")


def test_an_id_missing_from_the_cache_is_one_clear_error(cache, tmp_path):
    with pytest.raises(CheckpointError) as info:
        resolve_model_dir("org/absent", None, str(cache))
    assert str(info.value) == (
        f"model org/absent is neither a local directory nor in {cache}, and it cannot be "
        "downloaded now (HF_HUB_OFFLINE is set, or the hub cannot be reached)"
    )
    with pytest.raises(CheckpointError, match=r"model org/tiny \(revision v9\) is neither"):
        resolve_model_dir("org/tiny", "v9", str(cache))
    cli = subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "generate", "ByteDance/Ouro-1.4B",
         "--download-dir", str(tmp_path), "--prompt", "x", "--device", "cpu"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert cli.returncode == 1
    assert cli.stderr.startswith("error: model ByteDance/Ouro-1.4B is neither a local directory")
    assert len(cli.stderr.strip().splitlines()) == 1
