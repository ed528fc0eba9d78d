"""Causal Wan2.1 (Self-Forcing / CausVid): block-autoregressive text-to-video with a KV cache, streaming.

Folder: model_index.json `_class_name` "CausalWanPipeline" (written by `composer convert self-forcing`), a
`CausalWanTransformer3DModel` transformer, Wan2.1's UMT5 text encoder, tokenizer and VAE; the sampling
settings (num_frames_per_block, denoising_step_list, warp_denoising_step, timestep_shift, context_noise,
local_attn_size, sink_size) are entries of model_index.json.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from composer.batch import ForwardBatch
from composer.cache.kv_pool import KVPool
from composer.configs.causal_wan import CausalWanConfig
from composer.errors import InvalidInputError
from composer.pipelines.base import ComposedPipeline
from composer.stages.causal_denoising import (
    CausalDenoisingStage,
    CausalPlan,
    checked_segments,
    switch_problem,
)
from composer.stages.decoding import DecodingStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.start_frames import StartFrameEncodingStage, StartFrames, read_start_frames
from composer.stages.text_encoding import TextEncodingStage


class CausalWanPipeline(ComposedPipeline):
    """validate -> encode text -> encode start frames -> causal block denoising (KV cache) -> decode."""

    class_names = ("CausalWanPipeline",)
    required_modules = ("text_encoder", "tokenizer", "vae", "transformer")
    config_class = CausalWanConfig
    config: CausalWanConfig
    # Its sampler draws every row's noise, block after block, from the request's one generator (Self-Forcing's
    # order), so rows of a batch would not be the videos single requests with their seeds make: one per request.
    batches_videos = False

    def sampling_defaults(self) -> dict[str, Any]:
        return {"num_inference_steps": len(self.config.denoising_step_list)}

    def create_stages(self) -> None:
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        patch = transformer.config.patch_size
        self.add_stage(
            InputValidationStage(
                spatial_multiple=spatial * max(patch[1], patch[2]), temporal_factor=temporal,
                fixed_steps=len(self.config.denoising_step_list), supports_flow_shift=False,
            )
        )
        text = TextEncodingStage(
            self.modules["text_encoder"], self.modules["tokenizer"],
            max_length=self.config.text_encoder_max_length, clean=self.config.clean_prompts,
        )
        self.add_stage(text)
        self.add_stage(StartFrameEncodingStage(vae))
        self.add_stage(
            CausalDenoisingStage(
                self.make_engine(transformer), text.encode, self.config, spatial_factor=spatial,
                kv_cache_offload=self.runtime.kv_cache_offload, progress=self.runtime.progress,
                kv_pool=KVPool(self.runtime.kv_cache_memory, transformer.device),
            )
        )
        self.add_stage(DecodingStage(vae))

    # -- request planning ----------------------------------------------------------------------------
    def prepare(
        self,
        batch: ForwardBatch,
        sampling,
        segments: Iterable[tuple[str, int]] | None = None,
        keep_video: bool = True,
    ) -> None:
        """Turn a request into segments of blocks: explicit (prompt, num_blocks) pairs, or the prompt for
        as many blocks as `num_frames` asks (after any start frames)."""
        n = self.config.num_frames_per_block
        temporal = self.modules["vae"].config.scale_factor_temporal
        start_frames = read_start_frames(sampling.start_image, sampling.start_video, temporal)
        start_latent_frames = 0 if start_frames is None else (len(start_frames) - 1) // temporal + 1
        if start_frames is not None:
            batch.attach(StartFrames(start_frames))

        if segments is None:  # the prompt (checked by the input validation stage) for num_frames' blocks
            prompt = batch.prompt[0] if isinstance(batch.prompt, list) and batch.prompt else None
            # num_frames stays as given: an invalid one is reported by the input validation stage as typed
            segments = [(prompt, self._blocks_for(batch.num_frames, start_latent_frames))]
        elif isinstance(segments, (list, tuple)):
            segments = list(checked_segments(segments))  # an explicit list is checked up front
            total_blocks = sum(b for _, b in segments if isinstance(b, int))
            batch.num_frames = (start_latent_frames + total_blocks * n - 1) * temporal + 1  # they set the length
            if segments and isinstance(segments[0][0], str):
                batch.prompt = [segments[0][0]] * batch.batch_size
        if sampling.rollout_blocks is not None and sampling.rollout_blocks < 1:
            raise InvalidInputError(f"rollout_blocks must be >= 1, got {sampling.rollout_blocks}")
        if (problem := switch_problem(sampling.prompt_switch, sampling.kv_cache)) is not None:
            raise InvalidInputError(f"prompt_switch = {sampling.prompt_switch!r}: expected {problem}")
        if sampling.overlap_frames < 0:
            raise InvalidInputError(f"overlap_frames must be >= 0, got {sampling.overlap_frames}")
        batch.attach(CausalPlan(
            segments=segments, rollout_blocks=sampling.rollout_blocks, overlap_frames=sampling.overlap_frames,
            use_kv_cache=sampling.kv_cache, keep_video=keep_video, switch=sampling.prompt_switch,
        ))

    def _blocks_for(self, num_frames: int, start_latent_frames: int) -> int:
        """Blocks to generate so the video has `num_frames` frames (0 when num_frames is invalid: the
        input validation stage reports that)."""
        n = self.config.num_frames_per_block
        temporal = self.modules["vae"].config.scale_factor_temporal
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % temporal:
            return 0
        latent = (num_frames - 1) // temporal + 1
        generated = latent - start_latent_frames
        if generated <= 0 or generated % n:
            valid = [
                (start_latent_frames + k * n - 1) * temporal + 1
                for k in range(max(1, generated // n), max(1, generated // n) + 2)
            ]
            raise InvalidInputError(
                f"num_frames = {num_frames} gives {latent} latent frames; after {start_latent_frames} start frame(s) "
                f"{generated} remain to generate, which is not a positive multiple of the model's "
                f"{n}-frame blocks (nearest valid num_frames: {', '.join(map(str, valid))})"
            )
        return generated // n


EntryClass = CausalWanPipeline
