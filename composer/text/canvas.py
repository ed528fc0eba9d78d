"""Block diffusion over canvases (DiffusionGemma): a causal encoder reads the prompt and every finished canvas into
a KV cache; a bidirectional decoder denoises the next canvas of `canvas_length` tokens against it.

Per canvas: encode the tokens not yet in the cache; start from uniformly random tokens (the request's generator);
each step runs the decoder (self-conditioned on the previous step's logits) and lets the folder's scheduler
(diffusers' BlockRefinementScheduler in its uniform mode, DiscreteDDIMScheduler or EntropyBoundScheduler; a fresh
copy per request, since schedulers keep state) commit and renoise; a scheduler with `corrector_steps` spends part
of the step budget on corrector sweeps; a row whose prediction stayed the same `stability_threshold` steps with a
mean entropy under `confidence_threshold` is frozen, and the canvas ends once every row is. After a canvas, a row
that holds EOS is finished (`eos_early_stop`).

These are the rules of diffusers' DiffusionGemmaPipeline (0.42), which composer follows step for step so the ids
are the same for the same folder, prompt, settings and seed (tests/test_text_diffusion_gemma.py). transformers renamed the
encoder cache argument of DiffusionGemma's forwards and decoder mask from `past_key_values` (5.23) to `cache` (5.24,
whose forwards still take the old name but whose decoder mask does not): composer passes it under the name each
function's signature has (`cache_keyword`).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from composer.stages.base import Stage, tokenizer_lock


def cache_keyword(fn: Any) -> str:
    """The name under which `fn` (a DiffusionGemma forward or its decoder-mask builder) takes the encoder's KV cache:
    `cache` where its signature has it (transformers >= 5.24), else `past_key_values` (5.23)."""
    try:
        parameters = inspect.signature(fn).parameters  # follows a deprecation decorator's __wrapped__
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in parameters else "past_key_values"


class ChatTokenizationStage(Stage):
    """Prompts (or conversations) -> token ids, always in the processor's chat template (as DiffusionGemmaPipeline
    encodes them)."""

    def __init__(self, processor: Any, limits: Any = None):
        self.processor = processor
        self.limits = limits

    def forward(self, batch):
        from composer.text.pipeline import prompt_tokens_checked, warn_unknown_tokens

        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        with tokenizer_lock(tokenizer):  # (its padding settings are the object's: one call at a time)
            batch = self._encode(batch)
            prompt_tokens_checked(batch, self.limits)
            warn_unknown_tokens(tokenizer, batch)
        return batch

    def _encode(self, batch):
        conversations = batch.messages or [[{"role": "user", "content": p}] for p in batch.prompts]
        many = len(conversations) > 1
        encoded = self.processor.apply_chat_template(
            conversations if many else conversations[0], add_generation_prompt=batch.sampling.add_generation_prompt,
            tokenize=True, return_tensors="pt", return_dict=True,
            **({"padding": True} if many else {}))  # prompts of different lengths: padded as the tokenizer pads
        ids = encoded["input_ids"]
        mask = encoded.get("attention_mask")
        batch.input_ids = ids.long() if ids.ndim == 2 else ids.long().unsqueeze(0)
        batch.prompt_mask = (torch.ones_like(batch.input_ids) if mask is None else mask.reshape(batch.input_ids.shape)
                             ).long()
        return batch


class CanvasDenoisingStage(Stage):
    """The canvas loop over transformers' DiffusionGemmaForBlockDiffusion; `blocks` yields after every canvas."""

    def __init__(self, model: torch.nn.Module, scheduler: Any, eos_id: int | None, device: torch.device):
        self.model = model
        self.scheduler = scheduler
        self.eos_id = eos_id
        self.device = device

    def forward(self, batch):
        for _ in self.blocks(batch):
            pass
        return batch

    def steps(self, batch):
        """The loop as a task's pieces: the count of final tokens after each canvas (its forwards run where the task
        runs: they share no call)."""
        return self.blocks(batch)

    def _scheduler(self) -> Any:
        return type(self.scheduler).from_config(self.scheduler.config)  # the request's own (schedulers keep state)

    @torch.inference_mode()
    def blocks(self, batch) -> Iterator[int]:
        from transformers import DynamicCache

        sp = batch.sampling
        model, device, generator = self.model, self.device, batch.generator
        scheduler = self._scheduler()
        ids = batch.input_ids.to(device)
        mask = batch.prompt_mask.to(device)
        rows, prompt_length = ids.shape
        canvas_length = model.config.canvas_length
        canvases = -(-sp.gen_length // canvas_length)
        corrector = getattr(scheduler.config, "corrector_steps", 0)
        steps = sp.num_inference_steps
        corrected = (steps - 1) // (1 + corrector) if corrector > 0 else 0
        predictor = steps - corrected * corrector
        extra = {"block_length": canvas_length} if "block_length" in inspect.signature(
            scheduler.set_timesteps).parameters else {}
        scheduler.set_timesteps(predictor, device=device, **extra)
        accepted = set(inspect.signature(scheduler.step).parameters)
        step_kwargs = {k: v for k, v in {"mask_token_id": None, "temperature": sp.temperature,
                                         "generator": generator}.items() if k in accepted}
        text_config = model.config.get_text_config(decoder=True)
        cache = DynamicCache(config=text_config)
        make_mask = model.model.decoder.create_diffusion_decoder_attention_mask
        encoder_cache, mask_cache = cache_keyword(model.model.encoder.forward), cache_keyword(make_mask)
        decode = functools.partial(self._decode, cache_name=cache_keyword(model.forward))
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        stability = max(sp.stability_threshold, 1)
        start = time.perf_counter()
        for _ in range(canvases):
            length = ids.shape[1]
            positions = torch.arange(length, length + canvas_length, device=device).unsqueeze(0)
            cached = cache.get_seq_length()
            model.model.encoder(input_ids=ids[:, cached:], attention_mask=mask, **{encoder_cache: cache},
                                position_ids=torch.arange(cached, length, device=device).unsqueeze(0))
            decoder_mask = make_mask(
                config=model.config, inputs_embeds=torch.empty((rows, canvas_length, 0), device=device),
                decoder_attention_mask=F.pad(mask.bool(), (0, canvas_length), value=True), **{mask_cache: cache})
            canvas = torch.randint(0, text_config.vocab_size, (rows, canvas_length), device=device,
                                   generator=generator)
            conditioning = None
            frozen = torch.zeros(rows, dtype=torch.bool, device=device)
            best = canvas
            history = torch.full((stability, rows, canvas_length), -1, dtype=torch.long, device=device)
            for step in range(predictor):
                if batch.cancel is not None:
                    batch.cancel.check()
                logits = decode(canvas, cache, conditioning, decoder_mask, positions)
                batch.stats.forwards += 1
                out = scheduler.step(model_output=logits, timestep=step, sample=canvas, return_dict=True,
                                     **step_kwargs)
                canvas, conditioning = out.prev_sample, out.pred_logits
                if step < corrected:
                    for _ in range(corrector):
                        sweep = decode(canvas, cache, conditioning, decoder_mask, positions)
                        batch.stats.forwards += 1
                        canvas = scheduler.step_correct(model_output=sweep, timestep=step, sample=canvas,
                                                        generator=generator).prev_sample
                if sp.confidence_threshold is not None:
                    guess = torch.where(frozen[:, None], best, conditioning.argmax(dim=-1))
                    steady = (history == guess[None]).all(dim=-1).all(dim=0)
                    history = torch.roll(history, shifts=-1, dims=0)
                    history[-1] = guess
                    entropy = torch.distributions.Categorical(logits=conditioning.float()).entropy().mean(-1)
                    frozen = frozen | (steady & (entropy < sp.confidence_threshold))
                    best = guess
                    canvas = torch.where(frozen[:, None], best, canvas)
                    if bool(frozen.all()):
                        break
            ids = torch.cat([ids, canvas], dim=-1)
            mask = F.pad(mask, (0, canvas_length), value=1)
            batch.sequences = ids[:, prompt_length:]
            batch.stats.seconds = time.perf_counter() - start
            yield ids.shape[1] - prompt_length  # whole canvases: the last may run past gen_length, as diffusers
            if sp.eos_early_stop and self.eos_id is not None:
                finished = finished | (canvas == self.eos_id).any(dim=-1)
                if bool(finished.all()):
                    break
        batch.sequences = ids[:, prompt_length:]
        batch.stats.seconds = time.perf_counter() - start

    def _decode(self, canvas, cache, conditioning, decoder_mask, positions, cache_name: str) -> torch.Tensor:
        return self.model(decoder_input_ids=canvas, **{cache_name: cache},
                          self_conditioning_logits=conditioning, decoder_attention_mask=decoder_mask,
                          decoder_position_ids=positions).logits.clone()
