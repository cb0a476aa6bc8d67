"""The model runner: a step description in, logits for the sampling rows out.

`execute(batch)` = block copies, then `prepare` (the step's index tensors, built with one
`torch.tensor` call), then `forward`; or, for a decode-only step when decode graphs are captured
(`cuda_graphs.py`), a replay. A step that scores prompts (`prompt_logprobs.py`) also asks for
the logits of the scored positions, after the sampling rows'. The two halves are public so
`ringserve bench step` can time host overhead and device work separately. The runner keeps no
per-sequence state: everything a step needs is in the `StepBatch`, so preemption, recomputation
and restarts need nothing from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from .host_tensor import host_tensor
from .kv_pool import KVPool
from .lora import LoraRegistry
from .pooling import pooled_rows
from .prompt_logprobs import logits_rows
from .step import StepBatch
from .step_inputs import StepInputs, build_step_inputs

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs
    from .model.llama import Llama


class ModelRunner:
    """Runs flat steps of `model` against `kv_pool` on the model's device."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, loras: LoraRegistry | None = None) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.loras = loras  # the LoRA adapters a row may run (`lora.py`); None: none served
        self.device = kv_pool.device
        self.block_size = kv_pool.block_size
        self.graphs: DecodeGraphs | None = None  # once captured (CUDA)
        args = getattr(model, "args", None)
        if args is not None:
            if (args.num_layers, args.num_kv_heads, args.head_dim) != (
                kv_pool.num_layers,
                kv_pool.num_kv_heads,
                kv_pool.head_dim,
            ):
                raise ValueError(
                    f"KV pool (layers {kv_pool.num_layers}, kv heads {kv_pool.num_kv_heads}, head_dim "
                    f"{kv_pool.head_dim}) does not match the model ({args.num_layers}, {args.num_kv_heads}, "
                    f"{args.head_dim})"
                )
            self.max_position = args.max_position_embeddings
        else:
            self.max_position = None

    def prepare(self, batch: StepBatch) -> StepInputs:
        """Host work of a step: the flat index tensors, on the device."""
        inputs = build_step_inputs(batch, self.block_size, self.device)
        if batch.loras:
            if self.loras is None:
                raise ValueError("a row runs a LoRA adapter, but this runner serves none")
            inputs.lora = self.loras.step([s.lora for s in batch.seqs for _ in s.token_ids], self.device)
        if batch.scores_prompts:
            scored = host_tensor("q", logits_rows(batch)).to(self.device)
            inputs.logits_indices = torch.cat((inputs.logits_indices, scored))
        return inputs

    def _check_positions(self, inputs: StepInputs) -> None:
        if self.max_position is not None and inputs.meta.max_seq_len > self.max_position:
            raise ValueError(
                f"context of {inputs.meta.max_seq_len} tokens exceeds the model's "
                f"max_position_embeddings {self.max_position}"
            )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Device work of a step: float32 logits `[R, vocab]` for the sampling rows."""
        self._check_positions(inputs)
        if inputs.lora is None:
            return self.model(inputs.input_ids, inputs.meta, self.kv_pool, inputs.logits_indices)
        return self.model(inputs.input_ids, inputs.meta, self.kv_pool, inputs.logits_indices, inputs.lora)

    @torch.inference_mode()
    def execute_pooling(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute` for a step with pooling rows (`pooling.py`): the logits as `execute` returns
        them, and the final hidden states `[Q, hidden]` of the pooled positions, in
        `pooled_rows` order. Never a graph replay: graphs capture decode steps without pooling."""
        inputs = self.prepare(batch)
        self._check_positions(inputs)
        pooled = host_tensor("q", pooled_rows(batch)).to(self.device)
        n = inputs.logits_indices.shape[0]
        indices = torch.cat((inputs.logits_indices, pooled))
        model = cast("Llama", self.model)
        h = model.final_hidden(inputs.input_ids, inputs.meta, self.kv_pool, indices, inputs.lora)
        logits = model.head(h[:n]) if n else h.new_zeros((0, model.args.vocab_size), dtype=torch.float32)
        return logits, h[n:]

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; logits `[R (+ P), vocab]` float32, rows in the order of
        `batch.sampling_seqs` (then the P scored prompt positions, when the step scores prompts)."""
        if self.graphs is not None and not batch.scores_prompts and not batch.loras:
            size = self.graphs.size_for(batch)
            if size is not None:
                return self.graphs.run(batch, size)
        return self.forward(self.prepare(batch))
