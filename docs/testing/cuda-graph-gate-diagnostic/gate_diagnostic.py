"""Why `test_padded_decode_invocation_equals_eager` failed on an AVX-512 CPU (eleventh session):
the gate logits of the padded graph call and of the eager call, the hidden rows' relative
difference, the size of the gate's terms, and the gate recomputed from each side's rows.

    python docs/testing/cuda-graph-gate-diagnostic/gate_diagnostic.py   # from the repository root
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, ".")

import tests.worker.test_cuda_graph as t  # noqa: E402
from vllm_rlt.worker.cuda_graph import CudaGraphRunner  # noqa: E402

ex, hidden = t._setup(t.DECODE, "torch")
eager = ex.loop(t.DECODE, hidden)
max_context = ex.model.config.max_position_embeddings
graphs = CudaGraphRunner(ex.model, ex.kv_cache, t.SPECS, max_context, capture=False)
inv, out, gate = t._static_call(ex, graphs, t.DECODE, hidden)
layer = ex.model.model.early_exit_gate
print("gate graph", gate.tolist())
print("gate eager", eager.gate_logits.tolist())
terms = [(layer.weight[0].abs() * x.abs()).sum().item() for x in eager.hidden]
print("sum of |w x| per row", terms)
print("hidden rel", ((out - eager.hidden).abs().max() / eager.hidden.abs().max()).item())
for name, x in (("gate of eager rows", eager.hidden), ("gate of graph rows", out)):
    print(name, layer(x).squeeze(-1).tolist())
