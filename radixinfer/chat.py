"""Chat messages to prompt ids, for `LLM.chat` and the server's chat completions: the tokenizer's
own chat template when it has one, else a simple built-in template (the byte-level tokenizer of
the presets has none)::

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


def check_messages(messages: object) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts of strings; ``ValueError`` naming
    ``messages`` otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    return list(messages)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of a conversation, for the model to write the assistant's next message."""
    apply_template = getattr(tokenizer, "apply_chat_template", None)
    ids = apply_template(messages) if apply_template is not None else None
    return ids if ids is not None else tokenizer.encode(builtin_chat_text(messages))
