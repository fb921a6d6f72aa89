"""Chat prompts: the model's Jinja chat template, or a documented fallback.

The template is `lp-serve --chat-template FILE` (read and compiled at start-up by
`read_template_file`, which names the file and the line of a syntax error), else the model
directory's: `chat_template.jinja` if present, else the `chat_template` field of
`tokenizer_config.json` (a string, or a list of named templates, of which "default" is
used). It is rendered in a sandboxed Jinja environment with the
variables Hugging Face templates expect: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `tools` (the request's, or None), a request's `chat_template_kwargs` (for
example Qwen3's `enable_thinking`; they cannot replace those names), plus the
`raise_exception` and
`strftime_now` helpers, a `tojson` filter that keeps non-ASCII text (with transformers'
`indent`, `separators` and `sort_keys` arguments) and the loop-control extension
(`{% break %}`, `{% continue %}`), as transformers renders them. GPT-OSS's harmony
template (macros, `namespace()`, `loop.last`, string methods) needs nothing more; the
tiny GPT-OSS checkpoints carry one of our own.

Fallback, when the model has no template:
- if the tokenizer knows `<|im_start|>` and `<|im_end|>` (Qwen and other ChatML models),
  ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
  `<|im_start|>assistant\\n`;
- otherwise plain text: `{role}: {content}\\n` per message, then `assistant:`.

The rendered text is tokenized without adding special tokens (the template adds them).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool", "developer")
# Template variables the server sets, which chat_template_kwargs cannot replace.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


class ChatTemplateError(ValueError):
    """The template rejected the messages (raise_exception) or failed to render."""


def _token_str(tok) -> str:
    if isinstance(tok, dict):  # older tokenizer_config.json: {"content": "...", ...}
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


def load_template(model_dir) -> tuple[str | None, dict]:
    """(template source or None, tokenizer_config dict) from a model directory."""
    if model_dir is None:
        return None, {}
    d = Path(model_dir)
    config = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            config = {}
    jinja_path = d / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(), config
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return (tmpl if isinstance(tmpl, str) and tmpl else None), config


class ChatFormatter:
    def __init__(self, template: str | None, tokenizer_config: dict | None = None,
                 tokenizer=None):
        cfg = tokenizer_config or {}
        self.source = template
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self._template = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(template)  # TemplateSyntaxError: not Jinja
        chatml = False
        if tokenizer is not None:
            chatml = (tokenizer.token_to_id("<|im_start|>") is not None
                      and tokenizer.token_to_id("<|im_end|>") is not None)
        self.fallback = "chatml" if chatml else "plain"

    @classmethod
    def from_model_dir(cls, model_dir, tokenizer=None, *,
                       template: str | None = None) -> ChatFormatter:
        """The model directory's template, or `template` (Jinja source) in its place; the
        special tokens come from the directory's tokenizer_config.json either way."""
        own, config = load_template(model_dir)
        return cls(template if template is not None else own, config, tokenizer)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               kwargs: dict | None = None, tools: list | None = None) -> str:
        """`kwargs`: more template variables (a request's chat_template_kwargs); `tools`:
        the request's function tools (OpenAI's shape). The fallback formats take neither."""
        if self._template is not None:
            try:
                return self._template.render(
                    **(kwargs or {}), messages=messages,
                    add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                    eos_token=self.eos_token, tools=tools,
                )
            except ChatTemplateError:
                raise
            except Exception as exc:  # noqa: BLE001 - any template failure is the request's
                raise ChatTemplateError(
                    f"chat template failed: {type(exc).__name__}: {exc}") from None
        if self.fallback == "chatml":
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                           for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


def read_template_file(path) -> str:
    """The Jinja source in `path`, compiled once to check it; ValueError naming the file
    (and the line of a syntax error) when it is missing, unreadable, empty or not Jinja."""
    from jinja2 import TemplateSyntaxError

    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"cannot read chat template file {str(path)!r}: {why}") from None
    if not source.strip():
        raise ValueError(f"chat template file {str(path)!r} is empty")
    try:
        ChatFormatter(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat template file {str(path)!r} is not a valid Jinja template: "
                         f"line {exc.lineno}: {exc.message}") from None
    return source


def _raise(message):
    raise ChatTemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
