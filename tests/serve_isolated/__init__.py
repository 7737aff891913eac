"""Serve tests that start their own Ray instance per module (worker kills, limits), apart from tests/serve, whose
modules share one instance for the whole package."""
