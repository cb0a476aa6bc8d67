"""The /v1/chat/completions route: its body, the chat template, tool calls (grammar, parsers, output) and the answer."""
