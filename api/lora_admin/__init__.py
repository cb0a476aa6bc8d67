"""vLLM's runtime LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter, behind an admin key."""
