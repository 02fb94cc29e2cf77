"""Chat messages -> one prompt string, by the checkpoint's chat template (HF ``tokenizer_config.json``
``chat_template``, Jinja, rendered in a sandbox as transformers does), or DEFAULT_CHAT_TEMPLATE for the presets."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Kimi's turn markers; the byte-level presets learn nothing of them, but a stable rendering makes a second turn
# extend the first one's prompt (a prefix-cache hit)
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
ROLES = ("system", "user", "assistant", "developer")


class ChatTemplateError(ValueError):
    """The template failed on these messages (its own raise_exception, or a Jinja error)."""


def _raise(message: str):
    raise ChatTemplateError(message)


def load_chat_template(checkpoint: str | Path) -> str:
    """The checkpoint's chat template: tokenizer_config.json's ``chat_template`` (a string, or HF's list of named
    templates: the "default" one), else DEFAULT_CHAT_TEMPLATE."""
    path = Path(checkpoint) / "tokenizer_config.json"
    if not path.is_file():
        return DEFAULT_CHAT_TEMPLATE
    tpl = json.loads(path.read_text()).get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl else DEFAULT_CHAT_TEMPLATE


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self._tpl = env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages``: [{"role", "content": str}]; BOS is the tokenizer's (added to the ids, not the text)."""
        try:
            return self._tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="",
                                    eos_token="")
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
