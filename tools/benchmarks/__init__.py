"""The benchmarks behind tools/bench.py, one module per benchmark; the workloads over the shared harness (harness.py)
in workloads.py."""
