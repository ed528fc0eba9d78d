"""ModelInputs: what the transformer sees besides the noisy latents and the timestep, for one guidance branch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

CrossKV = list[tuple[torch.Tensor, ...]]  # per block: text (k, v), then an image model's image (k, v)


@dataclass
class ModelInputs:
    """One branch's conditioning (the prompt, or the negative prompt under CFG) and causal context.

    - `text` [B, L, D]: text encoder states, or `cross_kv`: each block's cross-attention (k, v), computed once
      per prompt;
    - `kv_cache` + `frame_offset`: a causal pass over frames [frame_offset, frame_offset + F) against a KVCache;
    - `attn_mask` [S, S] and `context` [B, C, f, h, w] with `context_timestep` [B, f]: the uncached causal
      reference, whose clean context frames are prepended to the input (and cut from the output);
    - `image` [B * n, N, D]: an image model's CLIP image states when `text` is given (with `cross_kv` their k/v
      are in it); `condition` [B, C', F, H, W]: latents concatenated to the input on the channel axis (I2V: the
      frame mask and the encoded condition video);
    - `text_mask` [B, L] (1: a text token, 0: padding), `pooled_text` [B, D] and `guidance` [B] (an embedded
      guidance scale): what a transformer like HunyuanVideo's takes beside the text states (passed as diffusers
      names them: `encoder_attention_mask`, `pooled_projections`, `guidance`);
    - `text_2` [B, L2, D2] with `text_mask_2`: a second text encoder's states (HunyuanVideo-1.5's ByT5), passed as
      `encoder_hidden_states_2` / `encoder_attention_mask_2`;
    - `extra`: a family's own transformer inputs, passed by keyword, one row per video like the fields above (VACE's
      `control_hidden_states` and `control_hidden_states_scale`): a new conditioning needs no field here.
    """

    text: torch.Tensor | None = None
    cross_kv: CrossKV | None = None
    kv_cache: Any = None
    frame_offset: int = 0
    attn_mask: torch.Tensor | None = None
    context: torch.Tensor | None = None
    context_timestep: torch.Tensor | None = None
    image: torch.Tensor | None = None
    condition: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    pooled_text: torch.Tensor | None = None
    guidance: torch.Tensor | None = None
    text_2: torch.Tensor | None = None
    text_mask_2: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None

    def at(self, frame_offset: int, **changes: Any) -> ModelInputs:
        """The same conditioning for a pass starting at another frame."""
        return dataclasses.replace(self, frame_offset=frame_offset, **changes)

    def model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.cross_kv is not None:
            kwargs["cross_kv"] = self.cross_kv
        else:
            kwargs["encoder_hidden_states"] = self.text
            if self.image is not None:
                kwargs["encoder_hidden_states_image"] = self.image
        if self.kv_cache is not None or self.frame_offset:
            kwargs["frame_offset"] = self.frame_offset
        if self.kv_cache is not None:
            kwargs["kv_cache"] = self.kv_cache
        if self.attn_mask is not None:
            kwargs["attn_mask"] = self.attn_mask
        if self.text_mask is not None:
            kwargs["encoder_attention_mask"] = self.text_mask
        if self.pooled_text is not None:
            kwargs["pooled_projections"] = self.pooled_text
        if self.guidance is not None:
            kwargs["guidance"] = self.guidance
        if self.text_2 is not None:
            kwargs["encoder_hidden_states_2"] = self.text_2
        if self.text_mask_2 is not None:
            kwargs["encoder_attention_mask_2"] = self.text_mask_2
        if self.extra:
            kwargs.update(self.extra)
        return kwargs

    @staticmethod
    def batched(branches: list[ModelInputs]) -> ModelInputs:
        """The branches as one batch (rows in branch order). A KV cache cannot be concatenated: batched
        branches share one cache object holding every branch's rows."""
        first = branches[0]
        if any(b.kv_cache is not first.kv_cache for b in branches):
            raise ValueError("batched guidance branches must share one KV cache (allocated for all their rows)")
        if any(b.frame_offset != first.frame_offset or b.attn_mask is not first.attn_mask for b in branches):
            raise ValueError("batched guidance branches must cover the same frames")

        def cat(values):
            return None if values[0] is None else torch.cat(values)

        cross_kv = None
        if first.cross_kv is not None:
            cross_kv = [
                tuple(torch.cat(parts) for parts in zip(*(b.cross_kv[i] for b in branches)))
                for i in range(len(first.cross_kv))
            ]

        def masks(mask_of, states_of):  # a branch without padding: all its tokens count
            if all(mask_of(b) is None for b in branches):
                return None
            return torch.cat([mask_of(b) if mask_of(b) is not None else
                              torch.ones(states_of(b).shape[:2], dtype=torch.int64, device=states_of(b).device)
                              for b in branches])

        extra = None
        if first.extra:
            if any(set(b.extra or ()) != set(first.extra) for b in branches):
                raise ValueError("batched guidance branches must give the same extra transformer inputs")
            extra = {name: torch.cat([b.extra[name] for b in branches]) for name in first.extra}
        text_mask = masks(lambda b: b.text_mask, lambda b: b.text)
        text_mask_2 = masks(lambda b: b.text_mask_2, lambda b: b.text_2)
        return ModelInputs(
            text=cat([b.text for b in branches]), cross_kv=cross_kv, kv_cache=first.kv_cache,
            frame_offset=first.frame_offset, attn_mask=first.attn_mask,
            context=cat([b.context for b in branches]), context_timestep=cat([b.context_timestep for b in branches]),
            image=cat([b.image for b in branches]), condition=cat([b.condition for b in branches]),
            text_mask=text_mask, pooled_text=cat([b.pooled_text for b in branches]),
            guidance=cat([b.guidance for b in branches]), text_2=cat([b.text_2 for b in branches]),
            text_mask_2=text_mask_2, extra=extra,
        )
