"""ChatTextEncodingStage: prompts -> a multimodal LLM's hidden states read through its chat template, plus a ByT5
encoding of the text the prompt quotes (HunyuanVideo-1.5's two text encoders).

    Qwen2.5-VL:  [system message, prompt] -> the tokenizer's chat template (with the assistant's turn opened)
                 -> tokens (right-padded to crop + max_length) -> hidden_states[-(skip + 1)]
                 -> drop the first `crop` positions (the system turn) -> states [n, D] + mask
    ByT5:        the prompt's quoted texts ("..." or “...”) as 'Text "a". Text "b". ' -> 256 byte tokens
                 -> last hidden state of the real tokens [n2, D2]; nothing when the prompt quotes no text

Rows are padded to the longest of the request (prompt and negative prompt together), each stream on its own, as
TemplateTextEncodingStage does: a request whose rows have equal lengths carries no mask.
"""

from __future__ import annotations

import re

import torch

from composer.batch import ForwardBatch, PromptExtras
from composer.logging import get_logger
from composer.stages.base import tokenizer_lock
from composer.stages.template_text_encoding import TemplateTextEncodingStage

logger = get_logger(__name__)

_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """The text a prompt quotes, as the reference gives it to ByT5 (`Text "a". Text "b". `), or None."""
    found = [a or b for a, b in _QUOTED.findall(prompt)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    return ". ".join(f'Text "{text}"' for text in found) + ". " if found else None


def _pad_rows(rows: list[torch.Tensor | None], width: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [n_i, D] (None: no tokens) right-padded with zeros to the longest: [B, L, D], and the mask [B, L]."""
    length = max(0 if r is None else r.shape[0] for r in rows)
    like = next(r for r in rows if r is not None)
    states = torch.zeros(len(rows), length, width, dtype=like.dtype, device=like.device)
    mask = torch.zeros(len(rows), length, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row is not None:
            states[i, :row.shape[0]] = row
            mask[i, :row.shape[0]] = 1
    return states, mask if masked else None


class ChatTextEncodingStage(TemplateTextEncodingStage):
    """Writes `prompt_embeds` [B, L, D] (and `negative_prompt_embeds` under CFG) and attaches `PromptExtras` (the
    token masks and the ByT5 glyph states with theirs). Encodings are cached per text."""

    def __init__(
        self,
        text_encoder: torch.nn.Module,
        tokenizer,
        glyph_encoder: torch.nn.Module,
        glyph_tokenizer,
        system_message: str,
        max_length: int,
        crop_start: int | None = None,
        hidden_layers_to_skip: int = 2,
        glyph_max_length: int = 256,
        cache_size: int = 32,
    ):
        self.system_message = system_message
        # the template is the tokenizer's chat template (`count_template_tokens` and `_encode_uncached` below)
        super().__init__(text_encoder, tokenizer, glyph_encoder, glyph_tokenizer, template="{}", max_length=max_length,
                         crop_start=crop_start, hidden_layers_to_skip=hidden_layers_to_skip,
                         max_length_2=glyph_max_length, cache_size=cache_size)

    def _conversation(self, prompt: str) -> list[list[dict[str, str]]]:
        # the reference gives an empty prompt as one space
        return [[{"role": "system", "content": self.system_message}, {"role": "user", "content": prompt or " "}]]

    def count_template_tokens(self) -> int:
        """Tokens before the prompt: the chat template's text up to the user's content (the system turn)."""
        marker = "\x00prompt\x00"
        with tokenizer_lock(self.tokenizer):
            text = self.tokenizer.apply_chat_template(self._conversation(marker), add_generation_prompt=True,
                                                      tokenize=False)[0]
            count = len(self.tokenizer(text.split(marker)[0], add_special_tokens=False).input_ids)
        logger.debug("chat template: %d tokens before the prompt are cropped", count)
        return count

    def prompt_tokens(self, text: str) -> int:
        """The prompt's tokens in the chat template, the system turn before it (the crop) left out."""
        with tokenizer_lock(self.tokenizer):
            ids = self.tokenizer.apply_chat_template(self._conversation(text), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
        return len(ids[0] if ids and isinstance(ids[0], list) else ids) - self.crop_start

    @torch.no_grad()
    def _encode_uncached(self, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = next(self.text_encoder.parameters()).device
        with tokenizer_lock(self.tokenizer):
            inputs = self.tokenizer.apply_chat_template(
                self._conversation(text), add_generation_prompt=True, tokenize=True, return_dict=True,
                padding="max_length", max_length=self.crop_start + self.max_length, truncation=True,
                return_tensors="pt",
            )
        mask = inputs["attention_mask"]
        out = self.text_encoder(input_ids=inputs["input_ids"].to(device), attention_mask=mask.to(device),
                                output_hidden_states=True)
        states = out.hidden_states[-(self.hidden_layers_to_skip + 1)][0, self.crop_start:]
        length = int(mask[0, self.crop_start:].sum())  # host-side: no device sync
        return states[:max(length, 1)], self._encode_glyph(text)

    def _encode_glyph(self, text: str) -> torch.Tensor | None:
        quoted = glyph_text(text)
        if quoted is None:
            return None
        device = next(self.text_encoder_2.parameters()).device
        with tokenizer_lock(self.tokenizer_2):
            tokens = self.tokenizer_2(quoted, padding="max_length", max_length=self.max_length_2, truncation=True,
                                      add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask
        states = self.text_encoder_2(input_ids=tokens.input_ids.to(device),
                                     attention_mask=mask.to(device).float())[0][0]
        return states[:int(mask.sum())]

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        self.warn_truncated(batch, batch.negative_prompt if batch.do_classifier_free_guidance else None)
        prompt_rows = self.encode(batch.prompt)
        negative_rows = []
        if batch.do_classifier_free_guidance:
            negative_rows = self.encode(batch.negative_prompt or [""] * batch.batch_size)
        rows = prompt_rows + negative_rows
        n = len(prompt_rows)
        lengths = [s.shape[0] for s, _ in rows]
        states, mask = _pad_rows([s for s, _ in rows], rows[0][0].shape[1], min(lengths) != max(lengths))
        batch.prompt_embeds = states[:n]
        extras = PromptExtras(mask=None if mask is None else mask[:n])
        glyphs = [g for _, g in rows]
        glyph, glyph_mask = None, None
        if any(g is not None for g in glyphs):
            glyph_lengths = [0 if g is None else g.shape[0] for g in glyphs]
            width = next(g for g in glyphs if g is not None).shape[1]
            glyph, glyph_mask = _pad_rows(glyphs, width, min(glyph_lengths) != max(glyph_lengths))
            extras.text_2, extras.mask_2 = glyph[:n], None if glyph_mask is None else glyph_mask[:n]
        if negative_rows:
            batch.negative_prompt_embeds = states[n:]
            extras.negative_mask = None if mask is None else mask[n:]
            if glyph is not None:
                extras.negative_text_2 = glyph[n:]
                extras.negative_mask_2 = None if glyph_mask is None else glyph_mask[n:]
        batch.attach(extras)
        return batch
