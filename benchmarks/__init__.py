"""Benchmarks (not tests, not library code): each ``python -m benchmarks.bench_x`` measures one thing on this
machine over ``megatron``'s public API and prints a table (``--json`` for the rows)."""
