"""Loading Hugging Face checkpoints: sharded and single files, dtypes, special tokens, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import CheckpointError, load_model, read_special_tokens, resolve_dtype
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch


@pytest.fixture
def ckpt(tiny_model_dir, tmp_path):
    """A private copy of the tiny checkpoint that a test may break."""
    return shutil.copytree(tiny_model_dir, tmp_path / "ckpt")


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _logits(model):
    a = model.args
    runner = ModelRunner(model, KVPool(a.num_layers, 4, a.num_kv_heads, a.head_dim, dtype=model.dtype))
    return runner.execute(StepBatch([SeqStep(0, [0, 5, 9, 33], 0, [0], RowSampling(temperature=0.0))]))


def test_sharded_checkpoint_loads_like_single_file(ckpt, tiny_model_dir):
    """Weights split over two files with an index give the same model as one file."""
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(ckpt / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(_logits(load_model(ckpt)), _logits(load_model(tiny_model_dir)))


def test_weights_land_on_device_in_requested_dtype(tiny_model_dir):
    """A requested dtype is applied to every parameter and the model runs in it."""
    model = load_model(tiny_model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ref = _logits(load_model(tiny_model_dir))
    torch.testing.assert_close(_logits(model), ref, atol=0.5, rtol=0.1)


def test_auto_dtype_uses_float32_for_half_checkpoints_on_cpu(ckpt):
    """`auto` takes the checkpoint's dtype, except half precision on CPU, which runs in float32."""
    _edit_config(ckpt, torch_dtype="bfloat16")
    assert load_model(ckpt, dtype="auto").dtype == torch.float32


@pytest.mark.parametrize(
    "checkpoint,bf16,want",
    [
        ("float32", True, torch.bfloat16),  # every GGUF we convert is stored float32
        (None, True, torch.bfloat16),
        ("float32", False, torch.float16),  # a GPU without bfloat16 (before sm_80)
        ("bfloat16", False, torch.float16),
        ("float16", True, torch.float16),
        ("bfloat16", True, torch.bfloat16),
    ],
)
def test_auto_dtype_on_cuda_is_half_precision(checkpoint, bf16, want):
    """`auto` on a CUDA device serves half precision: bfloat16 where the GPU has it, else float16,
    whatever the checkpoint is stored in (the device type is faked: no GPU needed)."""
    cfg = {} if checkpoint is None else {"torch_dtype": checkpoint}
    assert resolve_dtype("auto", cfg, torch.device("cuda"), cuda_bf16=bf16) == want
    assert resolve_dtype("float32", cfg, torch.device("cuda"), cuda_bf16=bf16) == torch.float32  # asked for


def test_special_tokens(tiny_model_dir):
    """EOS and BOS ids come from the checkpoint's configs."""
    st = read_special_tokens(tiny_model_dir)
    assert st.eos_token_ids == frozenset({1}) and st.bos_token_id == 0


def test_eos_falls_back_to_tokenizer_config(ckpt):
    """Without eos ids in the JSON configs, tokenizer_config's eos_token is looked up in tokenizer.json."""
    (ckpt / "generation_config.json").unlink()
    _edit_config(ckpt, eos_token_id=None)
    assert read_special_tokens(ckpt).eos_token_ids == frozenset({1})


@pytest.mark.parametrize(
    "case,match",
    [
        ("no_dir", "model directory not found"),
        ("no_config", r"config\.json: file not found"),
        ("bad_json", r"config\.json: not valid JSON"),
        ("no_weights", r"no \*\.safetensors weights"),
        ("arch", r"config\.json: field 'architectures' is \['GPT2LMHeadModel'\]"),
        ("act", r"config\.json: field 'hidden_act' is 'gelu'"),
        ("missing_field", r"config\.json: required field 'hidden_size' is missing"),
        ("heads", r"config\.json: .*not a multiple of num_key_value_heads"),
        ("kv_heads_shape", r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"),
        ("vocab_shape", r"model\.safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' has shape \(\d+, 128\)"),
        ("missing_tensor", r"tensor 'model\.layers\.3\.mlp\.up_proj\.weight' missing"),
        ("unexpected_tensor", r"model\.safetensors: unexpected tensor 'model\.layers\.9\.mlp\.up_proj\.weight'"),
        ("rope", r"rope_scaling type 'yarn' is not supported"),
        ("sliding", r"field 'sliding_window' is 4096"),
        ("missing_shard", r"model-00002-of-00002\.safetensors: file not found"),
        ("corrupt", r"model\.safetensors: unreadable safetensors file"),
    ],
)
def test_bad_checkpoints_give_clear_errors(ckpt, case, match):
    """Each broken checkpoint raises CheckpointError naming the file and the field or tensor."""
    target = ckpt
    if case == "no_dir":
        target = ckpt / "nope"
    elif case == "no_config":
        (ckpt / "config.json").unlink()
    elif case == "bad_json":
        (ckpt / "config.json").write_text("{not json")
    elif case == "no_weights":
        (ckpt / "model.safetensors").unlink()
    elif case == "arch":
        _edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    elif case == "act":
        _edit_config(ckpt, hidden_act="gelu")
    elif case == "missing_field":
        cfg = json.loads((ckpt / "config.json").read_text())
        del cfg["hidden_size"]
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif case == "heads":
        _edit_config(ckpt, num_key_value_heads=3)
    elif case == "kv_heads_shape":
        _edit_config(ckpt, num_key_value_heads=4)
    elif case == "vocab_shape":
        _edit_config(ckpt, vocab_size=4096)
    elif case in ("missing_tensor", "unexpected_tensor"):
        state = load_file(ckpt / "model.safetensors")
        if case == "missing_tensor":
            del state["model.layers.3.mlp.up_proj.weight"]
        else:
            state["model.layers.9.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].clone()
        save_file(state, str(ckpt / "model.safetensors"))
    elif case == "rope":
        _edit_config(ckpt, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    elif case == "sliding":
        _edit_config(ckpt, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    elif case == "missing_shard":
        (ckpt / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
        )
    elif case == "corrupt":
        (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match=match):
        load_model(target)


def test_missing_tokenizer_is_named(ckpt):
    """The special-token reader requires tokenizer.json and says so."""
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        read_special_tokens(ckpt)
