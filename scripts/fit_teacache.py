"""Fit TeaCache's rescaling polynomial for a model: how much the transformer's output changes between two steps,
as a function of how much its timestep-modulated input (the signal TeaCache plans from) changed.

For every prompt and step count, the exact path runs once; at each step the signal's relative L1 change and the
output's relative L1 change against the previous step make one (x, y) point. A polynomial of `--degree` is fitted
to the points (numpy.polyfit, highest power first, the order `teacache_coefficients` uses). Put the printed line
in the family's PipelineConfig under the transformer's hidden size, with a threshold measured by
`benchmarks/step_cache.py` in `teacache_thresholds` (docs/step-caching.md).

    python scripts/fit_teacache.py                                    # the embedded shapes model
    python scripts/fit_teacache.py --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers --device cuda \\
        --prompts-file prompts.txt --steps 30,50 --height 480 --width 832 --num-frames 33

Several step counts (and flow shifts) give the fit x values across the range a user's schedule will have.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_PROMPTS = (
    "a red circle moving left", "a blue square moving up", "a green triangle moving right",
    "a yellow circle moving down", "a purple square moving left", "a white triangle moving up",
    "an orange circle moving right", "a cyan square moving down",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="model folder or hub id (default: the shapes model)")
    parser.add_argument("--prompts-file", default=None, help="one prompt per line (default: 8 shapes prompts)")
    parser.add_argument("--steps", default="20,30,50", help="comma-separated step counts")
    parser.add_argument("--degree", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-frames", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")

    from composer import VideoGenerator
    from composer.accel.step_cache import TeaCacheEngineHook, relative_l1
    from composer.engine import EngineHook

    prompts = (Path(args.prompts_file).read_text().splitlines() if args.prompts_file else list(DEFAULT_PROMPTS))
    prompts = [p.strip() for p in prompts if p.strip()]
    size = {k: v for k, v in (("num_frames", args.num_frames), ("height", args.height), ("width", args.width))
            if v is not None}
    gen = VideoGenerator.from_pretrained(args.model_path, device=args.device, dtype=args.dtype, progress=False)
    model = next(iter(gen.pipeline.denoisers().values()))
    signal = TeaCacheEngineHook(model, None, 0.0, (), None).signal  # the blocks' timestep-modulated input

    class Recorder(EngineHook):
        def __init__(self):
            self.steps: list[tuple[float, torch.Tensor]] = []

        def around_model(self, call, model_call):
            out = call(model_call)
            if model_call.kind == "step" and model_call.step is not None:
                self.steps.append((model_call.step.timestep, out.detach().float().cpu()))
            return out

    recorder = Recorder()
    for engine in gen.pipeline.engines:
        engine.add_hook(recorder)

    xs, ys = [], []
    for steps in (int(s) for s in args.steps.split(",")):
        for i, prompt in enumerate(prompts):
            recorder.steps.clear()
            gen.generate_video(prompt, seed=args.seed + i, num_inference_steps=steps, **size)
            with torch.no_grad():
                signals = [signal(t) for t, _ in recorder.steps]
            for j in range(1, len(recorder.steps)):
                xs.append(relative_l1(signals[j], signals[j - 1]))
                ys.append(relative_l1(recorder.steps[j][1], recorder.steps[j - 1][1]))
        print(f"{steps} steps: {len(prompts)} prompts, {len(xs)} points so far", flush=True)
    x, y = np.array(xs), np.array(ys)
    coefficients = np.polyfit(x, y, args.degree)
    fitted = np.polyval(coefficients, x)
    r2 = 1 - float(np.sum((y - fitted) ** 2) / np.sum((y - y.mean()) ** 2))
    width = getattr(model.config, "hidden_size", "?")
    print(f"{len(x)} points, signal change {x.min():.3g}..{x.max():.3g}, output change {y.min():.3g}..{y.max():.3g}, "
          f"R^2 {r2:.3f}")
    print(f"teacache_coefficients entry: {width}: ({', '.join(f'{c:.8e}' for c in coefficients)}),")


if __name__ == "__main__":
    main()
