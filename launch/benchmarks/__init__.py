"""Benchmark helpers (workloads, reports) and micro-benchmarks (baton pass, experts)."""
