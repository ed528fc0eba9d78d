"""Causal Wan2.1 (Self-Forcing / CausVid converted folders, model_index `_class_name` "CausalWanPipeline").

Defaults are Self-Forcing's; a converted folder states its own values in model_index.json, which win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.configs.base import SamplingParam
from composer.configs.wan import WanT2VConfig
from composer.registry.configs import register_configs


@dataclass
class CausalWanConfig(WanT2VConfig):
    """Block-autoregressive sampling: blocks of latent frames, a few-step schedule, a KV cache."""

    num_frames_per_block: int = 3
    denoising_step_list: tuple[float, ...] = (1000, 750, 500, 250)
    warp_denoising_step: bool = True
    timestep_shift: float = 5.0
    num_train_timesteps: int = 1000
    context_noise: float = 0.0  # timestep of the clean pass that writes a finished block's keys/values
    local_attn_size: int = -1  # frames a block attends to (sink included); -1: every earlier frame
    sink_size: int = 0  # first frames that stay in the window for good


@dataclass
class CausalWanSamplingParam(SamplingParam):
    """Self-Forcing at 480p: 832x480, 81 frames (21 latent frames = 7 blocks of 3), 4 steps, no CFG."""

    negative_prompt: str | None = None
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 4
    guidance_scale: float = 1.0
    fps: int = 16
    start_image: Any = field(
        default=None, metadata={"help": "causal models: an image file to start from (image-to-video; Python also "
                                        "takes a PIL image or uint8 array [H, W, 3])"}
    )
    start_video: Any = field(
        default=None, metadata={"help": "causal models: a video file to continue (its last 4k+1 frames; Python also "
                                        "takes uint8 frames [T, H, W, 3] or a list of frames)"}
    )
    rollout_blocks: int | None = field(
        default=None,
        metadata={"help": "causal models: blocks per rollout; longer videos restart the KV cache from an overlap"},
    )
    overlap_frames: int = field(
        default=3, metadata={"help": "causal models: latent frames carried into the next rollout / prompt"}
    )
    kv_cache: bool = field(
        default=True, metadata={"help": "causal models: use the KV cache (off: recompute every frame, for checks)"}
    )
    prompt_switch: str = field(
        default="restart",
        metadata={"help": "causal models, at a prompt switch: 'restart' (a fresh KV cache from the last "
                          "overlap_frames under the new prompt), 'keep' (the cache goes on: cached frames keep the "
                          "old prompt's cross-attention) or 'recache' (every frame the cache saw is recomputed under "
                          "the new prompt); see docs/causal-streaming.md", "choices": ("restart", "keep", "recache")},
    )


register_configs(
    CausalWanConfig,
    CausalWanSamplingParam,
    hf_model_paths=[],
    model_detectors=[lambda path, class_name: class_name == "CausalWanPipeline"],
    name="causal-wan2.1-t2v",
)
