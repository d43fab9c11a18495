"""The benchmark tool: a concurrent gRPC workload against a running server, with in-process baselines.

`text-generation-server benchmark` (tgis.benchmark.cli) drives it; `make benchmark-report` regenerates
docs/benchmark/ with it.
"""
