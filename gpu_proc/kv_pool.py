"""The paged KV cache: a fixed pool of 16-token blocks, preallocated per layer for K and V.

Layout (the contract the attention backends and kernels code against)::

    pool.k[layer], pool.v[layer]: [num_blocks, num_kv_heads, block_size, head_dim], contiguous

All layers live in one tensor per K and V (`pool.k_all`, `pool.v_all`:
`[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`), and `pool.k[layer]` is a view of it.
The token at position `p` of a sequence lives in
block `block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block_id * block_size + p % block_size`. Within a block, a head's 16 keys are adjacent
(`[block_size, head_dim]` per head), which is what a decode kernel reading one head wants.

Which blocks are free or shared is the block manager's business (pure Python); the pool only holds
memory.
"""

from __future__ import annotations

import torch

from ringserve.config import DEFAULTS


class KVPool:
    """Preallocated K and V memory for `num_blocks` blocks of `block_size` tokens in every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = DEFAULTS.block_size,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if value <= 0:
                raise ValueError(f"KVPool: {name} must be > 0, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        # NOTE: zeros, not empty: a bug that reads an unwritten slot then gives a visible, repeatable
        # wrong answer instead of reading stale memory that may happen to look right.
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = list(self.k_all.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_all.unbind(0))
