"""Chat templates render exactly as transformers' apply_chat_template(..., add_generation_prompt=True),
inside a sandbox, with the end-of-turn token found from the template itself."""

from __future__ import annotations

import json
import shutil

import pytest

from ringserve.api.chat.template import ChatTemplate, ChatTemplateError, compile_template, read_template
from ringserve.api.tokenizer import TextCodec

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫 and 🙂.\n\nTwo lines."},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  ", "name": "bob"}],
]

# Templates exercising what real ones use: loop controls, namespace, tojson, the generation tag,
# strftime_now, the special-token variables, tools/documents being None.
FEATURE_TEMPLATES = [
    "{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}"
    "{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m['content'] | length %}"
    "{% endfor %}{{ ns.n }}|{{ messages | tojson }}|{{ {'k': 'é<>'} | tojson(indent=2) }}",
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}>{% endif %}{{ tools is none }}{{ documents is none }}",
    "{{ strftime_now('%Y') | length }}{% for m in messages %}{{ dict(a=m['role']) | tojson }}{% endfor %}",
]


def _transformers(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tiny_template_renders_as_transformers(tiny_model_dir, codec, messages):
    """The tiny model's template: our rendering is transformers' rendering, character for character."""
    ours = ChatTemplate.load(tiny_model_dir, codec).render(messages)
    assert ours == _transformers(tiny_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("source", FEATURE_TEMPLATES)
def test_template_features_render_as_transformers(tiny_model_dir, codec, source):
    """Loop controls, namespace, tojson, {% generation %}, dict, strftime_now: same as transformers."""
    template = ChatTemplate.load(tiny_model_dir, codec)
    ours = ChatTemplate(source, template.special_tokens, compile_template(source), ()).render(CONVERSATIONS[2])
    theirs = _transformers(tiny_model_dir).apply_chat_template(
        CONVERSATIONS[2], chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs


def test_smollm2_template_renders_and_tokenizes_as_transformers(smollm2_dir):
    """The real model's ChatML template, rendered and tokenized, equals transformers' for every
    conversation; its end-of-turn token is <|im_end|>."""
    codec = TextCodec.from_dir(smollm2_dir)
    template = ChatTemplate.load(smollm2_dir, codec)
    tok = _transformers(smollm2_dir)
    for messages in CONVERSATIONS:
        text = template.render(messages)
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert codec.encode(text, add_special_tokens=False) == list(ids)
    assert template.end_of_turn_ids == (codec.token_id("<|im_end|>"),)
    assert text.endswith("<|im_start|>assistant\n")


def test_raise_exception_is_a_template_error(tiny_model_dir, codec):
    template = ChatTemplate.load(tiny_model_dir, codec)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ namespace(_x=1) }}",
        "{{ dict.__class__.__subclasses__() }}",
    ],
)
def test_sandbox_refuses_internals_and_mutation(source):
    """Untrusted templates cannot reach Python internals or change the messages."""
    template = ChatTemplate(source, {}, compile_template(source), ())
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def _model_copy(src, dst, **tokenizer_config):
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_template_sources_as_transformers_reads_them(tiny_model_dir, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates uses
    "default"; no template at all is None."""
    d = _model_copy(
        tiny_model_dir,
        tmp_path,
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert read_template(d)[0] == "D"
    (d / "chat_template.jinja").write_text("J")
    assert read_template(d)[0] == "J"
    (d / "chat_template.jinja").unlink()
    _model_copy(tiny_model_dir, tmp_path, chat_template=None)
    assert ChatTemplate.load(d, TextCodec.from_dir(d)) is None


def test_template_that_does_not_compile_is_an_error(tiny_model_dir, tmp_path):
    d = _model_copy(tiny_model_dir, tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(d, TextCodec.from_dir(d))


def test_end_of_turn_is_the_token_after_an_assistant_message(tiny_model_dir, tmp_path):
    """A Llama-3-style template ending turns with its own special token: that token, and EOS."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    codec = TextCodec.from_dir(tmp_path)
    template = ChatTemplate.load(tmp_path, codec)
    assert template.end_of_turn_ids == tuple(sorted({codec.token_id("<|eot_id|>"), codec.token_id("<|end_of_text|>")}))
