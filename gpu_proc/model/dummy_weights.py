"""`--load-format dummy`: a model of a checkpoint's shape with random weights made on the device.

For benchmarking without weight files (as vLLM's dummy load format): the architecture comes from
the directory's config.json, the tokenizer from its tokenizer.json, and every weight is drawn on
the target device from a seeded generator — normal(0, 0.02) for matrices and embeddings, ones for
the norms, zeros for biases — in the serving dtype, so an 8B model needs no host copy and loads in
about a second. Tokens are meaningless; speed and memory are those of the real model.
"""

from __future__ import annotations

import torch

from .llama import Llama, ModelArgs

SEED = 0


@torch.no_grad()
def random_model(
    args: ModelArgs, device: torch.device | str, dtype: torch.dtype, seed: int = SEED, cpu_kernels: bool = True
) -> Llama:
    """A `Llama` of `args` on `device` in `dtype` with seeded random weights, ready for forward."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Llama(args)
    model = model.to(dtype).to_empty(device=device)  # no weights anywhere but the target device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if args.tie_word_embeddings:
        model.tie_weights()
    model.eval().requires_grad_(False)
    model.setup(device, cpu_kernels=cpu_kernels)
    return model
