"""TemplateTextEncodingStage: prompts -> a decoder LLM's hidden states read through a chat template, plus a CLIP
pooled vector (HunyuanVideo's two text encoders).

    Llama:  template.format(prompt) -> tokens (right-padded to crop + max_length) -> hidden_states[-(skip + 1)]
            -> drop the first `crop` positions (BOS and the template's system part) -> states [n, D] + mask
    CLIP:   prompt -> 77 tokens -> pooler_output [D2]

Rows are padded to the longest prompt of the request (prompt and negative prompt together) rather than to
`max_length`: the dropped positions are padding every row shares, which the transformer masks anyway, so the
result is the same and a request whose rows have equal lengths needs no mask at all (any attention backend).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from composer.batch import ForwardBatch, PromptExtras
from composer.logging import get_logger
from composer.stages.base import Stage, tokenizer_lock
from composer.stages.text_encoding import PromptLengths
from composer.stages.validators import V, VerificationResult

logger = get_logger(__name__)

Encoded = tuple[torch.Tensor, torch.Tensor]  # (states [n, D] of the n prompt tokens, pooled [D2])


class TemplateTextEncodingStage(PromptLengths, Stage):
    """Writes `prompt_embeds` [B, L, D] (and `negative_prompt_embeds` under CFG) and attaches `PromptExtras`
    (token masks, None when no row is padded, and the CLIP pooled vectors). Encodings are cached per text."""

    def __init__(
        self,
        text_encoder: torch.nn.Module,
        tokenizer,
        text_encoder_2: torch.nn.Module,
        tokenizer_2,
        template: str,
        max_length: int,
        crop_start: int | None = None,
        hidden_layers_to_skip: int = 2,
        max_length_2: int = 77,
        cache_size: int = 32,
    ):
        if template.count("{}") != 1:
            raise ValueError(f"the prompt template must hold one '{{}}' where the prompt goes, got {template!r}")
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.template = template
        self.max_length = max_length
        self.crop_start = self.count_template_tokens() if crop_start is None else crop_start
        self.hidden_layers_to_skip = hidden_layers_to_skip
        self.max_length_2 = max_length_2
        self.cache_size = cache_size
        self._lock = threading.RLock()  # the cache is shared by concurrent requests (a causal stream's switches)
        self._cache: OrderedDict[str, Encoded] = OrderedDict()

    def count_template_tokens(self) -> int:
        """Tokens before the prompt: BOS (when the tokenizer adds one) and the template's text before '{}'."""
        prefix = self.template.split("{}")[0]
        with tokenizer_lock(self.tokenizer):
            count = len(self.tokenizer(prefix, add_special_tokens=True).input_ids)
        logger.debug("prompt template: %d tokens before the prompt are cropped", count)
        return count

    def prompt_tokens(self, text: str) -> int:
        """The prompt's tokens in the template, the template's text before it (the crop) left out."""
        with tokenizer_lock(self.tokenizer):
            ids = self.tokenizer(self.template.format(text), truncation=False, verbose=False).input_ids
        return len(ids) - self.crop_start

    def token_limits(self) -> list[tuple[int, str]]:
        return [(self.max_length, "the text encoder")]

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        shape = [batch.batch_size, None, None]
        result.add_check("prompt_embeds", batch.prompt_embeds, V.shape(shape), V.all_finite)
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.shape(shape), V.all_finite)

    @torch.no_grad()
    def _encode_uncached(self, text: str) -> Encoded:
        device = next(self.text_encoder.parameters()).device
        with tokenizer_lock(self.tokenizer):
            inputs = self.tokenizer(
                [self.template.format(text)], max_length=self.crop_start + self.max_length, padding="max_length",
                truncation=True, padding_side="right", return_attention_mask=True, return_tensors="pt",
            )
        mask = inputs.attention_mask.to(device)
        out = self.text_encoder(input_ids=inputs.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
        states = out.hidden_states[-(self.hidden_layers_to_skip + 1)][0, self.crop_start:]
        length = int(inputs.attention_mask[0, self.crop_start:].sum())  # host-side: no device sync
        device_2 = next(self.text_encoder_2.parameters()).device
        with tokenizer_lock(self.tokenizer_2):
            ids_2 = self.tokenizer_2(
                [text], padding="max_length", max_length=self.max_length_2, truncation=True, return_tensors="pt"
            ).input_ids
        pooled = self.text_encoder_2(ids_2.to(device_2), output_hidden_states=False).pooler_output[0]
        return states[:max(length, 1)], pooled

    def encode(self, texts: list[str]) -> list[Encoded]:
        """As `_encode`, one request at a time (the cache and the encoder are shared by concurrent requests)."""
        with self._lock:
            return self._encode(texts)

    def _encode(self, texts: list[str]) -> list[Encoded]:
        """Each text's (states, pooled), from the cache where possible."""
        rows = []
        for text in texts:
            if text in self._cache:
                self._cache.move_to_end(text)
            else:
                self._cache[text] = self._encode_uncached(text)
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            rows.append(self._cache[text])
        return rows

    @staticmethod
    def _stack(rows: list[Encoded], length: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                        torch.Tensor]:
        """Rows right-padded with zeros to `length`: states [B, length, D], mask [B, length] (or None), pooled."""
        states = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, length - s.shape[0])) for s, _ in rows])
        mask = None
        if masked:
            mask = torch.stack([(torch.arange(length) < s.shape[0]).to(torch.int64) for s, _ in rows])
        return states, mask, torch.stack([p for _, p in rows])

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        self.warn_truncated(batch, batch.negative_prompt if batch.do_classifier_free_guidance else None)
        prompt_rows = self.encode(batch.prompt)
        negative_rows = self.encode(batch.negative_prompt) if batch.do_classifier_free_guidance else []
        lengths = [s.shape[0] for s, _ in prompt_rows + negative_rows]
        length, masked = max(lengths), min(lengths) != max(lengths)
        batch.prompt_embeds, mask, pooled = self._stack(prompt_rows, length, masked)
        extras = PromptExtras(mask=mask, pooled=pooled)
        if negative_rows:
            batch.negative_prompt_embeds, extras.negative_mask, extras.negative_pooled = self._stack(
                negative_rows, length, masked
            )
        batch.attach(extras)
        return batch
