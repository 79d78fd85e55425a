"""The token-agreement tool of the two-GPU run (`benchmarks/pd_tokens.py`): at smoke size on the
CPU a real `vllm-rlt serve --pd-prefill 1 --pd-decode 1` gives every request the token ids one
engine gives (fp32: exactly, tests/disagg/test_pd_equivalence.py); and how a disagreement or a
failed request is reported."""

from __future__ import annotations

import json

from benchmarks import pd_tokens


def test_pd_gives_the_tokens_of_one_engine_smoke(tmp_path):
    out = tmp_path / "tok.json"
    result = pd_tokens.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["meta"]["args"]["batch_invariant"] is False and result["meta"]["engine_sha256"]
    r = result["results"]["pd"]
    assert (r["requests"], r["identical_requests"], r["failed"]) == (6, 6, 0)
    assert r["tokens"] == r["identical_tokens"] == 6 * 8
    lens = [row["prompt_len"] for row in r["per_request"]]
    assert all(8 <= n <= 96 for n in lens) and max(lens) > 2 * 32  # prompts of several chunks
    single, pd = result["tokens"]["single"], result["tokens"]["pd"]
    assert single == pd and all(len(t) == 8 for t in single)
    assert (tmp_path / "tok-single.log").exists() and (tmp_path / "tok-pd.log").exists()


def test_compare_reports_where_tokens_first_differ():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    got = [[1, 2, 3], [4, 0, 6], [7, 8], "HTTPStatusError: 500"]
    r = pd_tokens.compare(ref, got, [10, 20, 30, 40])
    assert (r["requests"], r["identical_requests"], r["failed"]) == (4, 1, 1)
    assert (r["tokens"], r["identical_tokens"]) == (12, 3 + 1 + 2)
    rows = r["per_request"]
    assert [row["first_diff"] for row in rows] == [None, 1, 2, 0]
    assert [row["prompt_len"] for row in rows] == [10, 20, 30, 40]
    assert rows[3]["error"] == "HTTPStatusError: 500"
