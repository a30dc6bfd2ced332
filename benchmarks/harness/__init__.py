"""bench.py's helpers: workloads, engine runs, roofline counting, device probes, statistics, the report; the
fused MoE benchmarks' shared case (moe_cases.py)."""
