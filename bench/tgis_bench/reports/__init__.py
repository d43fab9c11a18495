"""The benchmark's Markdown report, console summary and throughput plot."""
