"""The /v1/messages route (Anthropic's Messages API): its body, its translation onto the chat route, and its answer."""
