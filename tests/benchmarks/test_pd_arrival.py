"""The disaggregation-against-replicas benchmark (`benchmarks/pd_arrival.py`) at smoke size on
the CPU: a real `vllm-rlt serve --pd-prefill 1 --pd-decode 1`, the arrival replay over HTTP,
and the transfer counters read from its /metrics."""

from __future__ import annotations

import json

from benchmarks import pd_arrival


def test_pd_setup_smoke(tmp_path):
    out = tmp_path / "pd.json"
    result = pd_arrival.main(["--smoke", "--setups", "pd", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (run,) = result["runs"]
    assert (run["setup"], run["input_len"], run["rate"]) == ("pd", 48, 20.0)
    assert run["summary"]["completed"] == 6 and run["summary"]["failed"] == 0
    t = run["transfers"]  # the warm-up's transfers are not counted
    assert t["pd_transfers_total"] == 6 and t["pd_kv_transfer_bytes_total"] > 0
    assert (tmp_path / "pd-pd.log").exists()
