"""Serve tests that start their own Ray instance per module (worker kills, data parallel, Serve's throughput-optimized
mode), apart from tests/serve, whose modules share one instance for the whole package."""
