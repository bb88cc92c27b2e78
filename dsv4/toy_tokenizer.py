"""A small, real byte-level BPE tokenizer for random checkpoints (``dsv4 init-checkpoint``).

It makes the text path (``--prompt TEXT``, ``--chat``, decoded ``text``) run end to end on a
checkpoint written by this library, with files transformers' ``AutoTokenizer`` loads.

Invariants:
- Every id is ``< config.vocab_size``. The special tokens sit at the ids the config declares
  (``bos_token_id``, each ``eos_token_id``, ``pad_token_id``); the 256 bytes take the lowest
  remaining ids in byte order, so with the presets' BOS 256, EOS 257 and padding 258 byte ``b``
  is id ``b``, as in the built-in model's byte-level vocabulary. The two chat role tokens come
  next, then the merges, learnt deterministically from a fixed corpus, fill what is left.
- Any text round-trips: ``decode(encode(text))`` (special tokens skipped) is ``text``.
- ``tokenizer_config.json`` sets ``add_bos_token`` (a prompt starts with BOS), the special tokens
  and a chat template that writes ``bos_token``, role tokens and, after each assistant turn,
  ``eos_token``.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from dsv4.config import DeepseekV4Config
from dsv4.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

__all__ = ["CHAT_TEMPLATE", "build_toy_tokenizer", "save_toy_tokenizer"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    "{{ eos_token }}"
    "{% else %}{{ message['content'] }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

_CORPUS = """\
The model reads the prompt and then it writes the answer one token at a time. Each new token
is the one the model thinks is the most likely to come next, and the text that comes out is the
sum of the tokens it has written. The tokenizer turns the text into tokens and the tokens back
into text; a token is a byte or a merge of the bytes that are often seen together in the text.
Hello, world! This is a small test of the tokenizer: there are some words in it that come again
and again, so that the merges of the tokenizer are the parts of the words that are the most
common in the text, such as the, and, in, is, on, to, at, it, that, this, there and then.
"""


def _bytes_to_unicode() -> list[str]:
    """The byte-level alphabet (GPT-2's): the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _learn_merges(corpus: str, limit: int) -> list[tuple[str, str]]:
    """Up to ``limit`` BPE merges of ``corpus``: each the most frequent adjacent pair (ties by
    the smallest pair), among pairs seen at least twice. Deterministic."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: Counter[tuple[str, ...]] = Counter(
        tuple(word) for word, _ in pre.pre_tokenize_str(corpus)
    )
    merges: list[tuple[str, str]] = []
    while len(merges) < limit:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        words = Counter({_merge(word, best): count for word, count in words.items()})
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _special_tokens(config: DeepseekV4Config) -> dict[int, str]:
    """The declared special ids and their tokens (the first name given to an id wins)."""
    eos = config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, tuple) else [] if eos is None else [eos]
    named: list[tuple[int | None, str]] = [(config.bos_token_id, BOS)]
    named += [
        (eid, EOS if i == 0 else f"<｜end▁of▁sentence{i}｜>") for i, eid in enumerate(eos_ids)
    ]
    named.append((config.pad_token_id, PAD))
    specials: dict[int, str] = {}
    for token_id, token in named:
        if token_id is None:
            continue
        if not 0 <= token_id < config.vocab_size:
            raise ValueError(f"special token id {token_id} is outside [0, {config.vocab_size})")
        specials.setdefault(token_id, token)
    return specials


def build_toy_tokenizer(config: DeepseekV4Config) -> Tokenizer:
    """The tokenizer described in the module docstring, for ``config``'s vocabulary."""
    specials = _special_tokens(config)
    if config.vocab_size < len(specials) + 256 + 2:
        raise ValueError(
            f"a byte-level tokenizer needs a vocabulary of at least {len(specials) + 258} tokens; "
            f"this one has {config.vocab_size}"
        )
    free = iter(i for i in range(config.vocab_size) if i not in specials)
    vocab: dict[str, int] = {token: token_id for token_id, token in specials.items()}
    for char in _bytes_to_unicode():
        vocab[char] = next(free)
    for role in (USER, ASSISTANT):
        vocab[role] = next(free)
    remaining = config.vocab_size - len(vocab)
    merges = _learn_merges(_CORPUS, remaining)
    for left, right in merges:
        if left + right not in vocab:
            vocab[left + right] = next(free)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if config.bos_token_id is not None:
        bos = specials[config.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0",
            pair=f"{bos} $A:0 {bos} $B:1",
            special_tokens=[(bos, config.bos_token_id)],
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in (*specials.values(), USER, ASSISTANT)
        ]
    )
    return tokenizer


def save_toy_tokenizer(directory: str | Path, config: DeepseekV4Config) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``config`` into ``directory``;
    return the file names written. Raises ``OSError`` when they cannot be written."""
    directory = Path(directory)
    tokenizer = build_toy_tokenizer(config)
    specials = _special_tokens(config)
    token_config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": config.bos_token_id is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    eos = config.eos_token_id
    first_eos = eos[0] if isinstance(eos, tuple) and eos else eos
    for key, token_id in (
        ("bos_token", config.bos_token_id),
        ("eos_token", first_eos),
        ("pad_token", config.pad_token_id),
    ):
        if isinstance(token_id, int):
            token_config[key] = specials[token_id]
    token_config["chat_template"] = CHAT_TEMPLATE
    tokenizer.save(str(directory / TOKENIZER_FILE))
    (directory / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(token_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
