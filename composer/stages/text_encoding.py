"""TextEncodingStage: prompts (and negative prompts for CFG) -> text encoder hidden states."""

from __future__ import annotations

import html
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from composer.batch import ForwardBatch
from composer.logging import get_logger
from composer.stages.base import Stage, tokenizer_lock
from composer.stages.validators import V, VerificationResult

logger = get_logger(__name__)


@dataclass
class PromptWarnings:
    """What the text encoding said of a request's prompts (a prompt longer than the encoder reads), per batch row:
    attached to the batch, copied onto each result (GenerationResult.warnings) and a served job's `warnings`."""

    rows: dict[int, list[str]] = field(default_factory=dict)


class PromptLengths:
    """What a text encoding stage says of a prompt's length before encoding it: `prompt_tokens` (the prompt's
    tokens as the encoder counts them, template and padding aside) against `max_length`, the tokens it reads
    (its max_sequence_length); the rest is cut, as diffusers cuts it, and now said."""

    max_length: int
    encoder_name = "the text encoder"

    def prompt_tokens(self, text: str) -> int:
        raise NotImplementedError

    def truncation_warnings(self, field_name: str, texts: list[str]) -> dict[int, list[str]]:
        """One message per text longer than the encoder reads, by row: "prompt is 700 tokens; the text encoder
        reads the first 512 (its max_sequence_length): the last 188 are dropped"."""
        rows: dict[int, list[str]] = {}
        counted: dict[str, int] = {}
        if "_tail" not in self.__dict__:  # what the template adds after the prompt (T5's end token, a chat turn's end)
            self._tail = self.prompt_tokens("")
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                continue
            tokens = counted[text] = counted[text] if text in counted else self.prompt_tokens(text)
            for kept, encoder in self.token_limits():
                if tokens > kept:
                    name = field_name if len(texts) == 1 else f"{field_name}[{row}]"
                    rows.setdefault(row, []).append(
                        f"{name} is {tokens - self._tail} tokens; {encoder} reads the first {kept - self._tail} "
                        f"(its max_sequence_length): the last {tokens - kept} are dropped")
        return rows

    def token_limits(self) -> list[tuple[int, str]]:
        """(tokens read, by which encoder): one encoder here; a stage with a second one adds it."""
        return [(self.max_length, self.encoder_name)]

    def warn_truncated(self, batch: ForwardBatch, negative: list[str] | None) -> None:
        """Log a WARNING per truncated prompt of the request and attach them (PromptWarnings) to the batch."""
        rows = self.truncation_warnings("prompt", list(batch.prompt))
        for row, messages in (self.truncation_warnings("negative_prompt", negative) if negative else {}).items():
            rows.setdefault(row, []).extend(messages)
        for messages in rows.values():
            for message in messages:
                logger.warning(message)
        self._said_texts().update(t for t in [*batch.prompt, *(negative or [])] if isinstance(t, str))
        batch.attach(PromptWarnings(rows))

    def warn_new_texts(self, texts: list[str]) -> None:
        """A WARNING for a truncated prompt encoded outside a request's own encoding (a causal stream's next
        segment), once per text."""
        said = self._said_texts()
        for text in texts:
            if text not in said:
                said.add(text)
                for messages in self.truncation_warnings("prompt", [text]).values():
                    for message in messages:
                        logger.warning(message)

    def _said_texts(self) -> set[str]:
        if len(self.__dict__.setdefault("_said", set())) > 256:  # a long-running server: forget, and say again
            self._said.clear()
        return self._said


def clean_prompt(text: str) -> str:
    """The reference cleaning: ftfy (when installed), HTML unescaped twice, whitespace collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class TextEncodingStage(PromptLengths, Stage):
    """Tokenize to `max_length` (pad + truncate), encode with the attention mask, and zero the embeddings
    past each prompt's length (what Wan was trained with). Encodings are cached per text (LRU), so a
    repeated prompt, and the negative prompt of every CFG request, is encoded once."""

    def __init__(
        self,
        text_encoder: torch.nn.Module,
        tokenizer,
        max_length: int,
        clean: bool = True,
        cache_size: int = 32,
    ):
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.clean = clean
        self.cache_size = cache_size
        self._lock = threading.RLock()  # the cache is shared by concurrent requests (a causal stream's switches)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def prompt_tokens(self, text: str) -> int:
        """The prompt's tokens as encoded (cleaned, with the end token), without the cut at max_length."""
        text = clean_prompt(text) if self.clean else text
        with tokenizer_lock(self.tokenizer):
            return len(self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False).input_ids)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        shape = [batch.batch_size, self.max_length, None]
        result.add_check("prompt_embeds", batch.prompt_embeds, V.shape(shape), V.all_finite)
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.shape(shape), V.all_finite)

    @torch.no_grad()
    def _encode_uncached(self, texts: list[str]) -> torch.Tensor:
        with tokenizer_lock(self.tokenizer):
            inputs = self.tokenizer(texts, padding="max_length", max_length=self.max_length, truncation=True,
                                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        device = next(self.text_encoder.parameters()).device
        mask = inputs.attention_mask.to(device)
        hidden = self.text_encoder(inputs.input_ids.to(device), mask).last_hidden_state
        return hidden.masked_fill(~mask.bool().unsqueeze(-1), 0.0)  # zero past each prompt's length

    def encode(self, texts: list[str]) -> torch.Tensor:
        """As `_encode`, one request at a time (the cache and the encoder are shared by concurrent requests)."""
        with self._lock:
            self.warn_new_texts(texts)
            return self._encode(texts)

    def _encode(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), max_length, hidden] embeddings, from the cache where possible."""
        if self.clean:
            texts = [clean_prompt(t) for t in texts]
        found: dict[str, torch.Tensor] = {}
        for text in texts:
            if text in self._cache:
                self._cache.move_to_end(text)
                found[text] = self._cache[text]
        todo = list(dict.fromkeys(t for t in texts if t not in found))
        if todo:
            for text, emb in zip(todo, self._encode_uncached(todo)):
                found[text] = self._cache[text] = emb
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        rows = [found[text] for text in texts]
        return torch.stack(rows)

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        self.warn_truncated(batch, batch.negative_prompt if batch.do_classifier_free_guidance else None)
        batch.prompt_embeds = self.encode(batch.prompt)
        if batch.do_classifier_free_guidance:
            negative = batch.negative_prompt or [""] * batch.batch_size
            batch.negative_prompt_embeds = self.encode(negative)
        return batch
