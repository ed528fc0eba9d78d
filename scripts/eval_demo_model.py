#!/usr/bin/env python
"""Score the embedded shapes models: prompt following (colour, shape, direction read from the frames) over
seeded prompts, and drift over long causal rollouts.

    python scripts/eval_demo_model.py                   # the shipped text-to-video model, and drift
    python scripts/eval_demo_model.py --causal          # also the causal model on the same prompts
    python scripts/eval_demo_model.py --model-path O/shapes-t2v --causal-model-path O/shapes-causal --causal

Once `composer eval demo`: the scorer is the demo's (demo/), which the engine does not import, so it runs
from a source checkout like the training script.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# The demo package is a folder of the checkout, not of the installed package: find it from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.demo.packaged import CAUSAL_NAME, T2V_NAME, packaged_model  # noqa: E402
from composer.errors import ComposerError, ConfigError, ModelNotFoundError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The options of the former `composer eval demo`, unchanged."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--model-path", default=None,
                   help="text-to-video model (default: the embedded one); any folder is loaded as that model's family, "
                        "so a renamed copy or a retrained model is scored at the shapes world's size and settings")
    p.add_argument("--causal-model-path", default=None, help="causal model scored by --causal and the drift figure (default: embedded)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="prompts and generation seeds start here")
    p.add_argument("--num-inference-steps", "--steps", type=int, default=None, help="override the model default")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--causal", action="store_true", help="also score the causal model on the same prompts")
    p.add_argument("--causal-guidance-scale", type=float, default=None,
                   help="CFG scale of the causal model (default: the model's; 1 disables CFG)")
    p.add_argument("--drift-prompts", type=int, default=8, help="long rollouts for the drift figure (0: skip)")
    p.add_argument("--drift-frames", type=int, default=129, help="frames per long rollout")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--runtime", nargs="+", default=[], metavar="KEY=VALUE",
                   help="runtime settings for both models, as from_pretrained keywords (e.g. cache=teacache "
                        "cache_threshold=0.2): what an approximation costs in prompt score")
    return p


def folder(path: str | None, name: str) -> Path | str:
    """The model to score: the given path, else the embedded model of that name."""
    found = path or packaged_model(name)
    if found is None:
        raise ModelNotFoundError(f"the embedded {name} model is not installed; pass a model path")
    return found


def check_options(args: argparse.Namespace) -> None:
    """Every bad option in one ConfigError before any model loads (a wrong --json path would otherwise surface
    only after the whole evaluation)."""
    errors = []
    for name, low in (("num_prompts", 1), ("drift_prompts", 0), ("drift_frames", 1)):
        if getattr(args, name) < low:
            errors.append(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= {low}")
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            errors.append(f"--json {args.json}: the folder {parent} does not exist")
        elif Path(args.json).is_dir():
            errors.append(f"--json {args.json}: is a folder; give a file path")
        else:
            try:  # probe: the results must be writable after minutes of scoring
                with tempfile.NamedTemporaryFile(dir=parent, prefix=".eval-probe-"):
                    pass
            except OSError as exc:
                errors.append(f"--json {args.json}: cannot write in {parent} ({exc.strerror})")
    if errors:
        raise ConfigError("invalid options:\n  " + "\n  ".join(errors))


def runtime_settings(pairs: list[str]) -> dict[str, str]:
    """KEY=VALUE pairs -> keywords (RuntimeArgs checks and converts the values)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--runtime takes KEY=VALUE pairs, got {pair!r}")
        out[key.replace("-", "_")] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Score, print the reports, and write the JSON when asked."""
    from composer.generator import VideoGenerator

    check_options(args)
    from demo.evaluate import demo_prompts, measure_drift, score_prompts

    prompts = demo_prompts(args.num_prompts, args.seed)
    runtime = runtime_settings(args.runtime)
    overrides = {k: v for k, v in (("num_inference_steps", args.num_inference_steps),
                                   ("guidance_scale", args.guidance_scale)) if v is not None}
    results: dict = {}
    # the score reads the shapes world (64x64, 17 frames), so a folder whose name the registry does not know is
    # still sampled as a shapes model, not with the defaults of the architecture's real checkpoints
    gen = VideoGenerator.from_pretrained(folder(args.model_path, T2V_NAME), progress=False, model_family=T2V_NAME,
                                         **runtime)
    t2v = score_prompts(gen, prompts, args.seed, **overrides)
    print(t2v.report())
    results["t2v"] = t2v.score.summary()
    if args.causal or args.drift_prompts:
        causal = VideoGenerator.from_pretrained(folder(args.causal_model_path, CAUSAL_NAME), progress=False,
                                                model_family=CAUSAL_NAME, **runtime)
        causal_overrides = {} if args.causal_guidance_scale is None else {"guidance_scale": args.causal_guidance_scale}
        if args.causal:
            scored = score_prompts(causal, prompts, args.seed, **causal_overrides)
            print("causal " + scored.report())
            results["causal"] = scored.score.summary()
        if args.drift_prompts:
            drift = measure_drift(causal, prompts[: args.drift_prompts], args.drift_frames, seed=args.seed,
                                  **causal_overrides)
            print(drift.report())
            results["drift"] = [vars(c) for c in drift.chunks]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": len(prompts), "seed": args.seed, **results}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run; a ComposerError (a missing model, a bad option) prints as one line and exits 1, as in `composer`."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ComposerError as exc:
        print(f"eval_demo_model.py: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
