"""Engine processes behind one front end: prefill/decode disaggregation (engine processes, KV
transfers, the router) and data-parallel replicas."""
