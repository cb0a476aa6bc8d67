"""Command-line tools: inspection, drills, load tests, benchmarks."""
