"""TextEncodingStage: prompts (and negative prompts for CFG) -> text encoder hidden states."""

from __future__ import annotations

import html
import re
import threading
from collections import OrderedDict

import torch

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


def clean_prompt(text: str) -> str:
    """The reference cleaning: ftfy (when installed), HTML unescaped twice, whitespace collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class TextEncodingStage(Stage):
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

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        shape = [batch.batch_size, self.max_length, None]
        result.add_check("prompt_embeds", batch.prompt_embeds, V.shape(shape), V.all_finite)
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.shape(shape), V.all_finite)

    @torch.no_grad()
    def _encode_uncached(self, texts: list[str]) -> torch.Tensor:
        inputs = self.tokenizer(
            texts,
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs.attention_mask.to(device)
        hidden = self.text_encoder(inputs.input_ids.to(device), mask).last_hidden_state
        return hidden.masked_fill(~mask.bool().unsqueeze(-1), 0.0)  # zero past each prompt's length

    def encode(self, texts: list[str]) -> torch.Tensor:
        """As `_encode`, one request at a time (the cache and the encoder are shared by concurrent requests)."""
        with self._lock:
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
        batch.prompt_embeds = self.encode(batch.prompt)
        if batch.do_classifier_free_guidance:
            negative = batch.negative_prompt or [""] * batch.batch_size
            batch.negative_prompt_embeds = self.encode(negative)
        return batch
