"""Chat messages to prompt ids: a tokenizer's own chat template (its special tokens written once, no BOS
added on top), and the built-in template when a tokenizer has none."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from radixinfer.chat import builtin_chat_text, chat_prompt_ids
from radixinfer.tokenizer import ByteTokenizer, HFTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def word_tokenizer(chat_template: str | None) -> HFTokenizer:
    """A word-level tokenizer built here (no files), which adds BOS like a Llama tokenizer."""
    words = ["<s>", "</s>", "<unk>", "[system]", "[user]", "[assistant]", "Be", "brief.", "Hi!"]
    rust = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = chat_template
    return HFTokenizer(fast)


def test_the_tokenizers_template_writes_its_own_bos_once():
    tokenizer = word_tokenizer(TEMPLATE)
    ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert ids == [0, 3, 6, 7, 4, 8, 5]  # <s> [system] Be brief. [user] Hi! [assistant]
    assert tokenizer.encode("Hi!") == [0, 8]  # a plain prompt still gets its BOS


def test_without_a_template_the_builtin_one_is_used():
    assert word_tokenizer(None).apply_chat_template(MESSAGES) is None
    text = builtin_chat_text(MESSAGES)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    assert chat_prompt_ids(ByteTokenizer(), MESSAGES) == list(text.encode())
