"""Benchmarks: each prints pinvault's figure beside a baseline measured in the same run."""

import os

# Servers stopped while a benchmark's channel is still open are expected, not news.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
