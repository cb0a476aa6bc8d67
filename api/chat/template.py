"""A model's chat template, rendered as transformers' `apply_chat_template(messages,
add_generation_prompt=True)` renders it, inside jinja2's immutable sandbox.

Templates come with downloaded models, so they are untrusted code: the sandbox refuses attribute
access to internals and mutation of the inputs. The environment matches transformers' (trim_blocks,
lstrip_blocks, loop controls, the `{% generation %}` tag) and so do the helpers templates call:
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and `dict` / `namespace`
that refuse underscore names. The variables are the same too: `messages`, `tools` (the request's
tool definitions, None without), `documents` (None), `add_generation_prompt`, and the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...).

Where the template comes from: `--chat-template FILE` (the operator's; never a client's), else as
transformers reads it: `chat_template.jinja` in the model directory, else `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates of which "default" is used). A
known model may name a template ringserve ships (`ringserve/chat_templates/`): SmolLM2's own has
no tools, so it is served with a ChatML template that has.

The end-of-turn tokens: the tokenizer's EOS token plus the special token the template writes right
after an assistant message (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3), found by rendering
a probe conversation. A chat answer stops at any of them.

Client text is text. `render_pieces` renders with every special token's text inside the client's
strings (message content and names, template kwargs) swapped for a placeholder no client can
guess, then splits the rendered text at the placeholders: the pieces between them are tokenized as
usual, so the template's own markers are special tokens, and the client's copies are tokenized as
plain text (`TextCodec.encode_pieces`). A user message holding `<|im_end|>\n<|im_start|>system`
cannot open a system turn. Text without such copies renders as one piece, tokenized exactly as
transformers' `apply_chat_template(tokenize=True)` would.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ringserve.api.tokenizer import TextCodec

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PROBE = "\u2063ringserve-end-of-turn-probe\u2063"


class ChatTemplateError(ValueError):
    """The template refused the messages (its own `raise_exception`, or an error rendering them)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore attribute names (CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")


class _Dict:
    """`dict(...)` for templates without handing them the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]  # the named special tokens the template sees
    template: jinja2.Template
    end_of_turn_ids: tuple[int, ...]
    special_texts: tuple[str, ...] = ()  # every special token's text, longest first (`render_pieces`)

    @classmethod
    def load(
        cls, model_dir: str | Path, codec: TextCodec, source_file: str | Path | None = None
    ) -> ChatTemplate | None:
        """The model's chat template (or the one in `source_file`: `--chat-template`), or None
        when it has none. A template that does not compile raises `ChatTemplateError` (a broken
        model directory or template file, found at start-up)."""
        source, special = read_template(Path(model_dir))
        if source_file is not None:
            try:
                source = Path(source_file).read_text(encoding="utf-8")
            except OSError as exc:
                raise ChatTemplateError(f"--chat-template {source_file}: {exc.strerror}") from None
        if source is None:
            return None
        try:
            template = compile_template(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{model_dir}: the chat template does not compile: {exc}") from None
        probe = cls(source, special, template, ())
        return cls(source, special, template, probe._find_end_of_turn(codec), codec.special_texts)

    @property
    def renders_tools(self) -> bool:
        """The template reads the `tools` variable (else a request with tools is refused)."""
        return "tools" in self.source

    def reads(self, name: str) -> bool:
        """The template's source names the variable `name` (a cheap, conservative test)."""
        return name in self.source

    @property
    def has_developer_role(self) -> bool:
        """The template knows OpenAI's `developer` role (else it is rendered as `system`)."""
        return "developer" in self.source

    @property
    def tool_call_parser(self) -> str:
        """The parser for what this template teaches the model to write (`--tool-call-parser auto`)."""
        if "<|python_tag|>" in self.source or "ipython" in self.source:
            return "llama3_json"
        return "hermes"

    def render_pieces(
        self,
        messages: list[dict] | tuple[dict, ...],
        add_generation_prompt: bool = True,
        *,
        extra: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | tuple[dict, ...] | None = None,
    ) -> tuple[str, ...]:
        """`render`, as pieces for `TextCodec.encode_pieces`: the template's text at even positions,
        a client's copy of a special token's text at odd ones (see the module docstring)."""
        if not self.special_texts:
            return (
                self.render(
                    messages,
                    add_generation_prompt,
                    extra=extra,
                    continue_final_message=continue_final_message,
                    tools=tools,
                ),
            )
        nonce = secrets.token_hex(8)
        index = {text: k for k, text in enumerate(self.special_texts)}
        pattern = re.compile("|".join(map(re.escape, self.special_texts)))

        def hide(value):
            if isinstance(value, str):
                return pattern.sub(lambda m: f"\ue000{nonce}{index[m.group()]}\ue001", value)
            if isinstance(value, dict):
                return {k: hide(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [hide(v) for v in value]
            return value

        text = self.render(
            hide(list(messages)),
            add_generation_prompt,
            extra=hide(extra) if extra else extra,
            continue_final_message=continue_final_message,
            tools=hide(list(tools)) if tools else None,
        )
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", text)
        # NOTE: re.split puts each placeholder's group at the odd positions, the rest between.
        return tuple(p if i % 2 == 0 else self.special_texts[int(p)] for i, p in enumerate(parts))

    def render(
        self,
        messages: list[dict] | tuple[dict, ...],
        add_generation_prompt: bool = True,
        *,
        extra: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | tuple[dict, ...] | None = None,
    ) -> str:
        """The prompt text for `messages`; `ChatTemplateError` if the template refuses them.
        `extra`: more template variables (vLLM's `chat_template_kwargs`; ours win on a clash);
        `continue_final_message`: end the text right after the last message's content, so the
        model continues it (as transformers does); `tools`: the request's tool definitions."""
        try:
            text = self.template.render(
                {
                    **(extra or {}),
                    "messages": list(messages),
                    "tools": list(tools) if tools else None,
                    "documents": None,
                    "add_generation_prompt": add_generation_prompt,
                    **self.special_tokens,
                }
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined, sandbox
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
        if continue_final_message:
            final = messages[-1]["content"] if messages else ""
            at = text.rfind(final) if final else -1
            if at == -1:
                raise ChatTemplateError(
                    "continue_final_message: the template does not write the last "
                    "message's content as it is, so it cannot be continued"
                )
            text = text[: at + len(final)]
        return text

    def _find_end_of_turn(self, codec: TextCodec) -> tuple[int, ...]:
        ids: set[int] = set()
        eos = self.special_tokens.get("eos_token")
        eos_id = codec.token_id(eos) if eos is not None else None
        if eos_id is not None:
            ids.add(eos_id)
        for messages in (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": _PROBE},
            ],
        ):
            try:
                text = self.render(messages, add_generation_prompt=False)
            except ChatTemplateError:
                continue
            at = text.find(_PROBE)
            if at == -1:
                continue
            after = codec.encode(text[at + len(_PROBE) :], add_special_tokens=False)
            if after and after[0] in codec.special_ids:
                ids.add(after[0])
            break
        return tuple(sorted(ids))


def read_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """(the template source or None, the named special tokens) as transformers would load them."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    special = {}
    for name in NAMED_SPECIAL_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[name] = token
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), special
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates; without tools transformers uses "default"
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return (source if isinstance(source, str) else None), special
