"""PEFT LoRA adapters for the tests, made by PEFT itself in its saved format (random A and B:
`init_lora_weights=False`, so each one changes the model's answers), and PEFT's greedy answers."""

from __future__ import annotations

from pathlib import Path

import torch

# name: (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "attn-r4": (4, 8, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj"], True),
    "o-r2": (2, 4, ["o_proj", "k_proj"], False),
}


def make_adapters(model_dir: Path, root: Path, names=tuple(ADAPTERS)) -> dict[str, Path]:
    """{name: directory} of the adapters `names` for the checkpoint at `model_dir`, saved under `root`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    out = {}
    for name in names:
        r, alpha, targets, rslora = ADAPTERS[name]
        torch.manual_seed(100 + list(ADAPTERS).index(name))
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, use_rslora=rslora
        )
        get_peft_model(hf, config).save_pretrained(root / name)
        out[name] = root / name
    return out


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """transformers + PEFT's greedy continuation of each prompt (the base model's for None)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(hf, adapter_dir).eval() if adapter_dir is not None else hf
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def served_greedy(client, model: str, prompt, new_tokens: int) -> list[int]:
    """The token ids a server (an openai client) answers `prompt` with under `model`, greedily."""
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert out.model == model
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
