"""A small T5-style (Unigram, SentencePiece-like) tokenizer whose vocabulary is built deterministically.

Training a tokenizer here gives a different vocabulary on every run, so fixtures would not be
byte-identical; instead the vocabulary is a fixed word list plus every printable ASCII character, so any
ASCII text tokenizes (whole words where known, characters otherwise) and the same text always gives the
same ids.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

# Words of scene descriptions (and of the synthetic-shapes captions), kept sorted for stable ids.
WORDS = sorted(
    set(
        """
        a an the of on in at to and with by from over under into onto near far left right up down top bottom
        moving moves move walking running flying floating rolling bouncing spinning jumping falling rising
        slowly quickly fast slow static still
        red green blue yellow orange purple pink white black gray grey brown cyan magenta golden silver
        circle square triangle star ball box cube shape shapes object objects line dot
        background sky sea ocean wave waves beach sand water river lake mountain mountains forest tree trees
        grass field city street road car cars bird birds cat cats dog dogs fish horse person people man woman
        child face hand hands light dark sun moon cloud clouds rain snow fire smoke night day sunset sunrise
        bright tones overexposed blurred details subtitles style works paintings images overall worst quality
        low high compression residue ugly incomplete extra fingers poorly drawn faces deformed disfigured
        misshapen limbs fused picture messy three legs many walking backwards jpeg
        video photo cinematic realistic beautiful small large big tiny huge diagonal diagonally across corner
        surfing riding playing dancing sitting standing looking
        """.split()
    )
)
SPECIAL = ["<pad>", "</s>", "<unk>"]


def build_vocab(words: Iterable[str] = WORDS) -> list[tuple[str, float]]:
    """(piece, log-probability score) pairs: specials, words (preferred), then single characters."""
    vocab: list[tuple[str, float]] = [(tok, 0.0) for tok in SPECIAL]
    vocab.append(("\u2581", -3.0))
    seen = {tok for tok, _ in vocab}
    for word in words:
        piece = "\u2581" + word
        if piece not in seen:
            vocab.append((piece, -4.0))
            seen.add(piece)
    for ch in string.printable.strip():
        for piece in (ch, "\u2581" + ch):
            if piece not in seen:
                vocab.append((piece, -10.0))
                seen.add(piece)
    return vocab


def build_tokenizer(words: Iterable[str] = WORDS):
    """A transformers T5 tokenizer over `build_vocab(words)` (pad=0, eos=1, unk=2, no sentinel ids)."""
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=build_vocab(words), extra_ids=0)


def save_tokenizer(path: Path, words: Iterable[str] = WORDS):
    tok = build_tokenizer(words)
    tok.save_pretrained(str(path))
    return tok
