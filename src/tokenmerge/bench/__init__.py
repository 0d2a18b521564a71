"""Benchmarks: random-weight architecture presets, the interleaved runner, the report writers."""
