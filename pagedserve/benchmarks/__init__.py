"""Benchmarks: each prints one JSON object as the last line of stdout."""
