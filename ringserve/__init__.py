"""ringserve: one GPU, one Llama-family model, many streaming users."""

__version__ = "0.1.0"
