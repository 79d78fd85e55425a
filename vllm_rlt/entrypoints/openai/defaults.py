"""The server's default limits and intervals, in a module that imports nothing heavy: the CLI
shows them in `vllm-rlt serve --help` without loading torch."""

DEFAULT_MAX_N = 16  # most samples one request may ask for (--max-n)
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # seconds a body may take to arrive (--body-read-timeout)
DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # seconds between stats lines (--log-stats-interval)
