"""Development probes: GPU sweeps and profiles a maintainer reruns when changing a kernel default
or chasing host overhead (`python -m benchmarks.probes.<name> --help`). What each measures and
which defaults it informs: docs/contributing.md §5 and docs/design/runner.md §4."""
