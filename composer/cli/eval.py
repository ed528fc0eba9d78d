"""`composer eval demo`: how well the embedded shapes models follow prompts, and how long rollouts drift."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="score models on built-in evaluations")
    kinds = p.add_subparsers(dest="suite", required=True, metavar="{demo}")
    demo = kinds.add_parser(
        "demo", allow_abbrev=False,
        help="prompt following (colour, shape, direction read from the frames) of the shapes models, and drift",
    )
    demo.add_argument("--model-path", default=None,
                      help="text-to-video model (default: the embedded one); any folder is loaded as that model's family, "
                           "so a renamed copy or a retrained model is scored at the shapes world's size and settings")
    demo.add_argument("--causal-model-path", default=None, help="causal model scored by --causal and the drift figure (default: embedded)")
    demo.add_argument("--num-prompts", type=int, default=50)
    demo.add_argument("--seed", type=int, default=0, help="prompts and generation seeds start here")
    demo.add_argument("--num-inference-steps", "--steps", type=int, default=None, help="override the model default")
    demo.add_argument("--guidance-scale", type=float, default=None)
    demo.add_argument("--causal", action="store_true", help="also score the causal model on the same prompts")
    demo.add_argument("--causal-guidance-scale", type=float, default=None,
                      help="CFG scale of the causal model (default: the model's; 1 disables CFG)")
    demo.add_argument("--drift-prompts", type=int, default=8, help="long rollouts for the drift figure (0: skip)")
    demo.add_argument("--drift-frames", type=int, default=129, help="frames per long rollout")
    demo.add_argument("--json", default=None, help="also write the results here")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from composer.demo.evaluate import demo_prompts, measure_drift, score_prompts
    from composer.demo.folders import CAUSAL_NAME, T2V_NAME, packaged_model
    from composer.errors import ModelNotFoundError
    from composer.generator import VideoGenerator

    def folder(path, name):
        found = path or packaged_model(name)
        if found is None:
            raise ModelNotFoundError(f"the embedded {name} model is not installed; pass a model path")
        return found

    prompts = demo_prompts(args.num_prompts, args.seed)
    overrides = {k: v for k, v in (("num_inference_steps", args.num_inference_steps),
                                   ("guidance_scale", args.guidance_scale)) if v is not None}
    results: dict = {}
    # the score reads the shapes world (64x64, 17 frames), so a folder whose name the registry does not know is
    # still sampled as a shapes model, not with the defaults of the architecture's real checkpoints
    gen = VideoGenerator.from_pretrained(folder(args.model_path, T2V_NAME), progress=False, model_family=T2V_NAME)
    t2v = score_prompts(gen, prompts, args.seed, **overrides)
    print(t2v.report())
    results["t2v"] = t2v.score.summary()
    if args.causal or args.drift_prompts:
        causal = VideoGenerator.from_pretrained(folder(args.causal_model_path, CAUSAL_NAME), progress=False,
                                                model_family=CAUSAL_NAME)
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
