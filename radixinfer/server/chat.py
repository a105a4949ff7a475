"""Chat messages to prompt ids: the tokenizer's own chat template when it has one, else a simple
built-in
template (the byte-level tokenizer of the presets has none)::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

Each message is its role tag and its text on lines of their own; the prompt ends with the
assistant's tag, so the model writes the next message.
"""

from __future__ import annotations

from radixinfer.tokenizer import Tokenizer


def builtin_chat_text(messages: list[dict[str, str]]) -> str:
    """``messages`` in the built-in template, with the assistant's turn opened."""
    turns = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(turns) + "<|assistant|>\n"


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of a conversation, for the model to write the assistant's next message."""
    apply_template = getattr(tokenizer, "apply_chat_template", None)
    ids = apply_template(messages) if apply_template is not None else None
    return ids if ids is not None else tokenizer.encode(builtin_chat_text(messages))
