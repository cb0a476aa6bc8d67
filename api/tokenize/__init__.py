"""The /tokenize and /detokenize routes (vLLM's): a prompt or chat messages to token ids and back."""
