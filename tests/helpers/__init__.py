"""What many tests need, written once: a real server on loopback (`server`), free ports and JSON
over HTTP (`net`), server-sent events (`sse`), the scheduler's fake engine (`scheduler_fakes`),
the real engine's serve loop (`engine_loop`), and GGUF files built from a checkpoint (`gguf_files`).
No test module imports another test module; they import from here."""
