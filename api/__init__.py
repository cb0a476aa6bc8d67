"""API workers: aiohttp + uvloop, tokenize, detokenize, SSE. Never import gpu_proc."""
