"""Build the GPT-2-small comparison checkpoint: random GPT-2 weights and a byte-level BPE tokenizer.

    python benchmarks/make_gpt2_checkpoint.py checkpoints/gpt2-small --dtype float16

writes a transformers checkpoint dir (``config.json``, ``model.safetensors``, tokenizer files) that
``radixinfer bench --model checkpoints/gpt2-small`` and transformers both load. Offline and
deterministic: the weights are seeded (``--seed``), and the tokenizer is trained with the
``tokenizers`` library on a text this script generates from the same seed, so two machines build the
same files.

The tokenizer is of the kind the seed engine's GPT-2-small figures were measured with: byte-level
BPE (GPT-2's pre-tokenizer and decoder), ``--bpe-vocab`` ids (``<|endoftext|>`` at id 0, the 256
byte symbols, then merges), padded with plain added tokens ``<pad0>``, ``<pad1>``, ... up to GPT-2's
``--vocab`` of 50,257 ids, so every id a random model emits decodes to some text. Its merges differ
from the tokenizer those figures used (trained on other text), so the same prompt text may take a
different number of tokens: benchmarks/RESULTS.md gives the prompt lengths of each workload with it.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

EOS = "<|endoftext|>"

# Common English and Python words; the generated text mixes them with made-up words (for the variety
# a BPE of 8,192 ids needs), numbers, punctuation and code-like lines.
_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four between state
keep eye never last let thought city tree cross farm hard start might story saw far sea draw left
late run def return class import from None True False self yield lambda while for in not and or if
elif else try except finally with as pass break continue raise assert global del print len range
list dict set tuple str int float bool open file path value key items append extend index count sort
join split strip format
""".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()
_VOWELS = "a e i o u ai ea ee io ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
_PUNCTUATION = [".", ",", ",", ";", ":", "!", "?"]


class _Draw:
    """Choices from ``random.Random.random`` only: the one method whose sequence Python keeps stable
    across versions for a given seed."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed).random

    def below(self, n: int) -> int:
        return int(self._random() * n)

    def pick(self, items: Sequence[str]) -> str:
        return items[self.below(len(items))]

    def chance(self, p: float) -> bool:
        return self._random() < p


def _word(draw: _Draw) -> str:
    if draw.chance(0.55):
        # Zipf-like: earlier words of the list come up more often
        return _WORDS[int(len(_WORDS) * draw.below(1000) ** 2 / 1e6)]
    syllables = 1 + draw.below(3)
    word = "".join(
        draw.pick(_ONSETS) + draw.pick(_VOWELS) + draw.pick(_CODAS) for _ in range(syllables)
    )
    return word.capitalize() if draw.chance(0.1) else word


def _line(draw: _Draw) -> str:
    kind = draw.below(10)
    if kind < 6:  # a sentence
        words = [_word(draw) for _ in range(4 + draw.below(14))]
        words[0] = words[0].capitalize()
        for i in range(1, len(words) - 1):
            if draw.chance(0.08):
                words[i] += draw.pick(_PUNCTUATION[1:4])
        return " ".join(words) + draw.pick(_PUNCTUATION[:1] * 4 + _PUNCTUATION[5:])
    if kind < 9:  # a line of code
        indent = " " * (4 * draw.below(4))
        name, other = _word(draw).lower(), _word(draw).lower()
        arg = str(draw.below(10 ** (1 + draw.below(4))))
        forms = (
            f"{name} = {other}({arg})",
            f"def {name}_{other}(self, {other}={arg}):",
            f"if {name} is not None and {other} > {arg}:",
            f"return [{name}.{other} for {name} in {other}s]",
            f'{name}["{other}"] += {arg}',
            f"# {' '.join(_word(draw) for _ in range(3 + draw.below(6)))}",
        )
        return indent + forms[draw.below(len(forms))]
    return (
        f"{draw.below(10000)}. [{draw.below(300)}] ({_word(draw)}: {draw.below(10**6) / 100:.2f})"
    )


def generated_corpus(seed: int, num_lines: int) -> Iterator[str]:
    """``num_lines`` lines of made-up text (sentences, code, numbers), fixed by ``seed``."""
    draw = _Draw(seed)
    for _ in range(num_lines):
        yield _line(draw)


def train_tokenizer(bpe_vocab: int, vocab: int, max_length: int, seed: int, corpus_lines: int):
    """A transformers ``GPT2TokenizerFast``: byte-level BPE of ``bpe_vocab`` ids trained on
    `generated_corpus`, padded with plain added tokens to ``vocab`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(seed, corpus_lines), trainer=trainer)
    hf_tok = GPT2TokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS)
    hf_tok.add_tokens([f"<pad{i}>" for i in range(vocab - len(hf_tok))])
    hf_tok.model_max_length = max_length
    return hf_tok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint dir to write")
    parser.add_argument("--n-layer", type=int, default=12, help="[12, GPT-2 small]")
    parser.add_argument("--n-embd", type=int, default=768, help="[768]")
    parser.add_argument("--n-head", type=int, default=12, help="[12]")
    parser.add_argument("--n-positions", type=int, default=1024, help="context length [1024]")
    parser.add_argument("--vocab", type=int, default=50257, help="model and tokenizer ids [50257]")
    parser.add_argument(
        "--bpe-vocab", type=int, default=8192, help="trained BPE ids, padded to --vocab [8192]"
    )
    parser.add_argument(
        "--corpus-lines", type=int, default=60_000, help="generated training text [60000]"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and training text [0]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 257 < args.bpe_vocab <= args.vocab:
        raise SystemExit(
            f"--bpe-vocab must be in (257, --vocab={args.vocab}], got {args.bpe_vocab}"
        )
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_tok = train_tokenizer(
        args.bpe_vocab, args.vocab, args.n_positions, args.seed, args.corpus_lines
    )
    hf_tok.save_pretrained(args.out)
    eos_id = hf_tok.convert_tokens_to_ids(EOS)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"saved {args.out}: {len(hf_tok)} tokenizer ids, eos {eos_id}, {params:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
