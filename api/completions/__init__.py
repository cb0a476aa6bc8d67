"""The /v1/completions route: its body (one prompt or a batch) and its answer."""
