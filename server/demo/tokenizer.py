"""A CLIP tokenizer whose vocabulary is the dataset's words, built offline.

Every lowercase letter is in the vocabulary (alone and word-final), so any prompt
tokenizes; the dataset's words each become one token through a chain of BPE merges.
"""

from __future__ import annotations

import itertools
import json
import string
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer

from server.demo.dataset import COLORS, SHAPES

WORDS = ("a", *COLORS, *SHAPES)
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: merge the best-ranked adjacent pair until none applies."""
    pieces = [*word[:-1], word[-1] + "</w>"]
    while len(pieces) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(itertools.pairwise(pieces))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """Merges that make each word one token: whatever earlier merges leave, join left to right."""
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = _bpe(word, {m: r for r, m in enumerate(merges)})
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces[0:2] = [pieces[0] + pieces[1]]
    return merges


def build_tokenizer() -> CLIPTokenizer:
    merges = _merges(WORDS)
    tokens = [*string.ascii_lowercase, *(c + "</w>" for c in string.ascii_lowercase)]
    tokens += [left + right for left, right in merges]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*tokens, BOS, EOS]))}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "vocab.json").write_text(json.dumps(vocab))
        lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
        (Path(folder) / "merges.txt").write_text("\n".join(lines) + "\n")
        # transformers 5's CLIPTokenizer(vocab_file=...) builds a broken tokenizer; from_pretrained works
        tokenizer = CLIPTokenizer.from_pretrained(
            folder, model_max_length=77, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
        )
    split = [w for w in WORDS if len(tokenizer.tokenize(w)) != 1]
    if split:
        raise RuntimeError(f"the tokenizer splits {split}: the BPE merges are wrong")
    return tokenizer
