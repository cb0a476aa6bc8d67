"""Host tensors from flat Python lists, the fast way: the step's index tensors, the sampler's and the
logits controls' per-row settings are all built with it."""

from __future__ import annotations

import struct

import torch

_TORCH_TYPES = {"q": torch.int64, "i": torch.int32, "f": torch.float32}


def host_tensor(code: str, values: list) -> torch.Tensor:
    """A CPU tensor from a flat list: `struct` packs Python numbers about twice as fast as `array`
    and 5-8x faster than `torch.tensor(list)`, which matters at thousands of block ids per step.
    `code` is a struct code: "q" int64, "i" int32, "f" float32."""
    buf = bytearray(struct.calcsize(code) * len(values))
    struct.pack_into(f"{len(values)}{code}", buf, 0, *values)
    return torch.frombuffer(buf, dtype=_TORCH_TYPES[code]) if values else torch.empty(0, dtype=_TORCH_TYPES[code])
