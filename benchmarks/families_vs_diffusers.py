"""composer against diffusers on every family beyond Wan2.1 T2V (which `wan_vs_diffusers.py` covers in depth): the
same tiny model folder, prompt, image, seed, size and steps through both engines, in one process.

For each family: the transformer time per denoising step (composer: its denoising stages, over the steps;
diffusers: the sum of its transformers' calls, over the steps), the whole video's time, their ratios
(diffusers / composer: > 1 means composer is faster), and the largest difference between the two videos' uint8
frames (a sanity check: same weights, same maths). Each folder is built locally by composer.testing in exact
diffusers layout (random weights, seeded), so the figures say how the engines compare, not how a real
checkpoint runs; `--model-overrides` scales the tiny models up.

    python benchmarks/families_vs_diffusers.py
    python benchmarks/families_vs_diffusers.py --families wan2.2-a14b,wan2.2-ti2v --steps 10 --threads 1
    python benchmarks/families_vs_diffusers.py --families wan2.1-i2v --model-overrides num_layers=4 num_heads=4

Timing: one warmup of each engine, then `--repeats` runs of each, interleaved (composer, diffusers, diffusers,
composer, ...) so that load from other processes hits both alike; medians. `time.perf_counter`, with a CUDA
synchronize around each timed transformer call on GPU.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROMPT = "a red fox running through fresh snow"
NEGATIVE_PROMPT = "blurry, low quality"


@dataclass(frozen=True)
class Family:
    """How to build a tiny folder of the family, which diffusers pipeline runs it, and the request."""

    builder: str  # a composer.testing function
    diffusers_class: str
    request: dict = field(default_factory=dict)
    image: bool = False
    video: bool = False  # video-to-video: a moving seeded pattern as `video` (`strength` in the request)
    control: bool = False  # VACE: a control video of the request's size, a mask and a reference image
    animate: int = 0  # Wan Animate: a character image, pose and face videos of this many frames


FAMILIES: dict[str, Family] = {
    "wan2.1-i2v": Family("build_tiny_wan_i2v", "WanImageToVideoPipeline",
                         dict(height=48, width=80, num_frames=9, guidance_scale=5.0), image=True),
    "wan2.2-a14b": Family("build_tiny_wan22_a14b", "WanPipeline",
                          dict(height=48, width=80, num_frames=9, guidance_scale=4.0)),
    "wan2.2-ti2v": Family("build_tiny_wan22_ti2v", "WanPipeline",
                          dict(height=64, width=96, num_frames=9, guidance_scale=5.0)),
    "wan2.2-ti2v-image": Family("build_tiny_wan22_ti2v", "WanImageToVideoPipeline",
                                dict(height=64, width=96, num_frames=9, guidance_scale=5.0), image=True),
    "wan2.2-i2v-a14b": Family("build_tiny_wan22_i2v_a14b", "WanImageToVideoPipeline",
                              dict(height=48, width=80, num_frames=9, guidance_scale=3.5), image=True),
    "hunyuanvideo": Family("build_tiny_hunyuan", "HunyuanVideoPipeline",
                           dict(height=48, width=80, num_frames=9)),
    # CFG at the folder guider's scale (diffusers' __call__ takes none)
    "hunyuanvideo-1.5": Family("build_tiny_hunyuan15", "HunyuanVideo15Pipeline",
                               dict(height=48, width=80, num_frames=9)),
    # diffusers sizes the video from the image (60x40: 64x48, its bucket nearest 3:2); composer is given that size
    "hunyuanvideo-1.5-i2v": Family("build_tiny_hunyuan15_i2v", "HunyuanVideo15ImageToVideoPipeline",
                                   dict(height=48, width=64, num_frames=9), image=True),
    "wan2.1-v2v": Family("build_tiny_wan", "WanVideoToVideoPipeline",
                         dict(height=48, width=80, num_frames=9, guidance_scale=5.0, strength=0.75), video=True),
    "wan2.1-vace": Family("build_tiny_wan_vace", "WanVACEPipeline",
                          dict(height=48, width=80, num_frames=9, guidance_scale=5.0, conditioning_scale=0.8),
                          control=True),
    # diffusion forcing: 33 frames in three windows of at most 17, asynchronous, the overlap re-noised
    "skyreels-v2-df": Family("build_tiny_skyreels_df", "SkyReelsV2DiffusionForcingPipeline",
                             dict(height=48, width=80, num_frames=33, guidance_scale=5.0, base_num_frames=17,
                                  overlap_history=5, addnoise_condition=20, ar_step=1, causal_block_size=1)),
    # 13 frames in three segments of 5 (one frame carried over), no CFG (the family's and diffusers' default)
    "wan2.2-animate": Family("build_tiny_wan_animate", "WanAnimatePipeline",
                             dict(height=48, width=80, guidance_scale=1.0, segment_frame_length=5), animate=13),
}


def make_video(count: int = 9, width: int = 70, height: int = 40) -> list:
    """A seeded pattern moving right, `count` PIL frames of another size than the video (the resize path)."""
    from PIL import Image

    base = (np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)
    return [Image.fromarray(np.roll(base, 3 * i, axis=1)) for i in range(count)]


def make_mask(count: int, width: int, height: int) -> list:
    """A VACE mask: keep the left half of every frame (black), redraw the right half (white)."""
    from PIL import Image

    mask = np.zeros((height, width), np.uint8)
    mask[:, width // 2:] = 255
    return [Image.fromarray(mask) for _ in range(count)]


def make_image(width: int = 60, height: int = 40):
    """A smooth seeded RGB image of another size than the video (the resize path)."""
    from PIL import Image

    small = (np.random.default_rng(0).random((4, 5, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TransformerTimer:
    """Sums the time of every call of the given modules (forward pre / post hooks)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device):
        self.device = device
        self.seconds = 0.0
        self._start = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._before)
            module.register_forward_hook(self._after)

    def _before(self, *_):
        synchronize(self.device)
        self._start = time.perf_counter()

    def _after(self, *_):
        synchronize(self.device)
        self.seconds += time.perf_counter() - self._start


def load_diffusers(folder: Path, class_name: str, device: torch.device):
    import diffusers

    if class_name in ("WanImageToVideoPipeline", "WanVideoToVideoPipeline", "SkyReelsV2DiffusionForcingPipeline",
                      "WanVACEPipeline", "WanAnimatePipeline"):
        import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing as df
        import diffusers.pipelines.wan.pipeline_wan_animate as animate
        import diffusers.pipelines.wan.pipeline_wan_i2v as i2v
        import diffusers.pipelines.wan.pipeline_wan_vace as vace
        import diffusers.pipelines.wan.pipeline_wan_video2video as v2v

        for module in (i2v, v2v, df, vace, animate):  # diffusers 0.42.1's prompt cleaning there calls ftfy even when absent
            if not hasattr(module, "ftfy"):
                module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    pipe = getattr(diffusers, class_name).from_pretrained(str(folder)).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_kwargs(pipe, sampling, request: dict) -> dict:
    """The request in diffusers' names, with the sampling values composer resolved for it (the family's and the
    folder's defaults) wherever diffusers' pipeline takes the same knob."""
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs = {k: v for k, v in request.items() if k in accepted}
    for name in ("negative_prompt", "guidance_scale", "guidance_scale_2", "true_cfg_scale"):
        value = getattr(sampling, name, None)
        if name in accepted and value is not None and name not in kwargs:
            kwargs[name] = value
    return kwargs


def run_family(name: str, family: Family, root: Path, args, device: torch.device) -> dict:
    import composer.testing as testing
    from composer import VideoGenerator

    overrides = dict(args.overrides)
    folder = getattr(testing, family.builder)(root / name, **overrides)
    request = dict(family.request, num_inference_steps=args.steps, seed=args.seed)
    if family.image:
        request["image"] = make_image()
    if family.video:
        request["video"] = make_video(request["num_frames"])
    if family.control:  # VACE: the control at the request's size (diffusers conditions on the video's own size)
        size = dict(width=request["width"], height=request["height"])
        request.update(video=make_video(request["num_frames"], **size), mask=make_mask(request["num_frames"], **size),
                       reference_images=make_image())
    if family.animate:  # Wan Animate: the character image, the poses and a face (at 20 pixels: resized)
        request.update(image=make_image(), pose_video=make_video(family.animate, request["width"], request["height"]),
                       face_video=make_video(family.animate, 20, 20))
    # the steps that run (video-to-video runs the last int(steps x strength) of the schedule)
    steps = int(args.steps * request["strength"]) if "strength" in request else args.steps
    if "ar_step" in request:  # diffusion forcing: one transformer pass per iteration of each window's schedule
        steps = forcing_iterations(request, args.steps)
    gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype="fp32", progress=False)
    # Wan Animate's denoising stage also encodes and decodes each segment with the VAE: time its transformer calls
    ours_timer = TransformerTimer([gen.pipeline.modules["transformer"]], device) if family.animate else None
    if family.animate:  # every segment runs the steps
        from composer.stages.animate import segment_starts

        steps *= len(segment_starts(family.animate, request["segment_frame_length"], 1))
    pipe = load_diffusers(folder, family.diffusers_class, device)
    transformers = [m for n in ("transformer", "transformer_2") if isinstance(m := getattr(pipe, n, None),
                                                                              torch.nn.Module)]
    timer = TransformerTimer(transformers, device)
    first = gen.generate_video(PROMPT, negative_prompt=NEGATIVE_PROMPT, **request)
    call = diffusers_kwargs(pipe, first.sampling, {k: v for k, v in request.items() if k != "seed"})
    if family.diffusers_class == "HunyuanVideoPipeline":
        # diffusers hard-codes the template's length in the released Llama tokenizer (95 tokens); composer counts
        # it with the folder's tokenizer, so a tiny folder's tokenizer needs diffusers told the same crop
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        crop = gen.pipeline.stage("TemplateTextEncodingStage").crop_start
        call["prompt_template"] = {"template": DEFAULT_PROMPT_TEMPLATE["template"], "crop_start": crop}
    if family.diffusers_class.startswith("HunyuanVideo15"):  # the same for its chat template (108 hard-coded)
        pipe.prompt_template_encode_start_idx = gen.pipeline.stage("ChatTextEncodingStage").crop_start

    def run_composer() -> tuple[np.ndarray, float, float]:
        if ours_timer is not None:
            ours_timer.seconds = 0.0
        result = gen.generate_video(PROMPT, negative_prompt=NEGATIVE_PROMPT, **request)
        denoise = sum(v for k, v in result.timings.items() if "DenoisingStage" in k)
        return result.frames, denoise if ours_timer is None else ours_timer.seconds, result.timings["total"]

    def run_diffusers() -> tuple[np.ndarray, float, float]:
        timer.seconds = 0.0
        start = time.perf_counter()
        torch.manual_seed(args.seed)  # what SkyReels-V2 DF draws its re-noised overlap from (composer: the seed)
        out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(args.seed), output_type="np", **call)
        synchronize(device)
        total = time.perf_counter() - start
        return (np.clip(out.frames[0], 0, 1) * 255).round().astype(np.uint8), timer.seconds, total

    run_diffusers()  # warmup (composer's was the first call above)
    ours, theirs = [], []
    for i in range(args.repeats):
        order = (run_composer, run_diffusers) if i % 2 == 0 else (run_diffusers, run_composer)
        for fn in order:
            (ours if fn is run_composer else theirs).append(fn())
    frames_ours, frames_theirs = ours[-1][0], theirs[-1][0]
    diff = int(np.abs(frames_ours.astype(np.int16) - frames_theirs.astype(np.int16)).max())
    return dict(
        family=name, steps=args.steps, frames=frames_ours.shape,
        step_ours=statistics.median(r[1] for r in ours) / steps,
        step_theirs=statistics.median(r[1] for r in theirs) / steps,
        video_ours=statistics.median(r[2] for r in ours), video_theirs=statistics.median(r[2] for r in theirs),
        diff=diff,
    )


def forcing_iterations(request: dict, steps: int) -> int:
    """Transformer passes (per guidance branch) of a diffusion-forcing request: every window's schedule."""
    from composer.stages.diffusion_forcing import forcing_schedule, plan_windows

    block = request["causal_block_size"]
    windows = plan_windows(request["num_frames"], request["base_num_frames"], request.get("overlap_history"), block, 4)
    return sum(len(forcing_schedule(w.frames, torch.zeros(steps), request["ar_step"], w.prefix, block).timesteps)
               for w in windows)


def parse_overrides(pairs: list[str]) -> list[tuple[str, object]]:
    out = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not value:
            raise SystemExit(f"--model-overrides: expected KEY=VALUE, got {pair!r}")
        try:
            out.append((key, int(value)))
        except ValueError:
            out.append((key, float(value)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated: {', '.join(FAMILIES)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--model-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="sizes for the tiny-model builders (e.g. num_layers=4 num_heads=4)")
    args = parser.parse_args()
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)} (expected {', '.join(FAMILIES)})")
    args.overrides = parse_overrides(args.model_overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    device = torch.device(args.device)

    print(f"{device}, fp32, {torch.get_num_threads()} threads, {args.steps} steps, median of {args.repeats} runs "
          f"per engine after a warmup, interleaved; ratios diffusers / composer (> 1: composer faster)")
    print(f"{'family':<20} {'frames':>14} {'step composer':>14} {'diffusers':>10} {'ratio':>6} "
          f"{'video composer':>15} {'diffusers':>10} {'ratio':>6} {'max diff':>9}")
    with tempfile.TemporaryDirectory(prefix="composer-families-") as tmp:
        for name in names:
            try:
                r = run_family(name, FAMILIES[name], Path(tmp), args, device)
            except AttributeError as error:  # a builder this checkout does not have yet
                print(f"{name:<20} skipped: {error}")
                continue
            shape = "x".join(str(n) for n in r["frames"][:3])
            print(f"{name:<20} {shape:>14} {r['step_ours'] * 1e3:>12.1f}ms {r['step_theirs'] * 1e3:>8.1f}ms "
                  f"{r['step_theirs'] / r['step_ours']:>5.2f}x {r['video_ours']:>14.2f}s {r['video_theirs']:>9.2f}s "
                  f"{r['video_theirs'] / r['video_ours']:>5.2f}x {r['diff']:>9}", flush=True)


if __name__ == "__main__":
    main()
