"""The concurrency sweep: a gRPC workload against a running server, its timings, scrape and results."""
