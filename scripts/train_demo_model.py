#!/usr/bin/env python
"""Train the embedded default models (shapes-t2v and shapes-causal) from scratch on 2 CPU cores.

    python scripts/train_demo_model.py                      # everything, into composer/demo/models
    python scripts/train_demo_model.py --stages t2v,save    # redo the DiT from the saved VAE and latents
    python scripts/train_demo_model.py --quick --out /tmp/x # a smoke test in a minute

Stages (each saves its result under --work, so later stages can be re-run alone):
  vae     a small AutoencoderKLWan on the synthetic frames
  data    render clips, encode them, measure latent mean/std (written into the VAE config)
  t2v     text encoder + DiT by flow matching, with caption dropout for CFG
  causal  the block-causal DiT by diffusion forcing on longer clips
  save    write the model folders (fp16) and score a few prompts
Seeded: the same flags give the same models.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

# The training code (demo/) is a folder of the checkout, not of the installed package: find it from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.demo.packaged import CAUSAL_NAME, PACKAGED, T2V_NAME  # noqa: E402
from demo import train as T  # noqa: E402
from demo import vae as V  # noqa: E402

STAGES = ("vae", "data", "t2v", "causal", "save")

QUICK = dict(vae_image_steps=6, vae_crop_steps=4, vae_full_steps=2, num_clips=24, num_causal_clips=12, dit_steps=12,
             causal_steps=8, dit_batch=8, causal_batch=4)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=PACKAGED, help="where the model folders go")
    p.add_argument("--work", type=Path, default=None, help="intermediate results (default: <out>/../.demo-train)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu",
                   help="where to train: cpu, cuda, cuda:1, auto (the DiT stages draw their batches on the CPU)")
    p.add_argument("--quick", action="store_true", help="a few steps of everything (smoke test)")
    p.add_argument("--eval-prompts", type=int, default=16, help="prompts scored after saving (0: skip)")
    for f in dataclasses.fields(T.TrainConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None, help=f"default {f.default}")
    return p.parse_args()


# What each stage reads from --work, and what it writes there for the stages after it.
NEEDS = {"vae": (), "data": ("vae",), "t2v": ("data.pt",),
         "causal": ("data.pt", "tokenizer", "text_encoder", "transformer"),
         "save": ("vae", "tokenizer", "text_encoder", "transformer", "causal.pt")}
MAKES = {"vae": ("vae",), "data": ("data.pt",), "t2v": ("tokenizer", "text_encoder", "transformer"),
         "causal": ("causal.pt",), "save": ()}


def missing_inputs(stages: list[str], work: Path) -> list[str]:
    """What the requested stages need from --work that neither an earlier requested stage nor a past run made."""
    made, missing = set(), []
    for stage in (s for s in STAGES if s in stages):
        for name in NEEDS[stage]:
            if name not in made and not (work / name).exists():
                made.add(name)  # said once
                maker = next(s for s in STAGES if name in MAKES[s])
                missing.append(f"the {stage} stage needs {work / name}: run the {maker} stage first (same --work)")
        made.update(MAKES[stage])
    return missing


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from composer.runtime import RuntimeArgs

    runtime = RuntimeArgs(device=args.device)
    errors = [e for e in runtime.validation_errors() if e.startswith("device")]
    if errors:
        sys.exit(f"--device: {errors[0]}")
    args.device = str(runtime.torch_device)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(T.TrainConfig) if getattr(args, f.name) is not None}
    cfg = T.TrainConfig(**{**(QUICK if args.quick else {}), **overrides})
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        sys.exit(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    work = args.work or args.out.parent / ".demo-train"
    missing = missing_inputs(stages, work)
    if missing:
        sys.exit("cannot run --stages " + ",".join(stages) + ":\n  " + "\n  ".join(missing))
    work.mkdir(parents=True, exist_ok=True)
    log_file = (work / "train.log").open("a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    needed = {name for stage in stages for name in NEEDS[stage]}  # what to load from --work
    log(f"config: {cfg}")
    start = time.perf_counter()
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    if "vae" in stages:
        t = time.perf_counter()
        V.train_vae(cfg, log, device=args.device).cpu().save_pretrained(work / "vae")
        log(f"vae trained in {time.perf_counter() - t:.0f} s")

    if "data" in stages:
        t = time.perf_counter()
        import numpy as np

        vae = AutoencoderKLWan.from_pretrained(work / "vae")
        rng = np.random.default_rng(cfg.seed + 10)
        clips, captions = T.make_clips(cfg.num_clips, cfg.frames, cfg, rng, cfg.clear_frames)
        vae.to(args.device)
        latents = V.encode_latents(vae, clips)
        V.set_latent_stats(vae, latents)
        long_clips, long_captions = T.make_clips(cfg.num_causal_clips, cfg.causal_frames, cfg, rng, cfg.clear_frames)
        long_latents = V.encode_latents(vae, long_clips)
        vae.cpu().save_pretrained(work / "vae")  # now with latents_mean / latents_std
        torch.save({"latents": V.normalize(latents, vae), "captions": captions,
                    "long_latents": V.normalize(long_latents, vae), "long_captions": long_captions}, work / "data.pt")
        log(f"data: {len(clips)} + {len(long_clips)} clips encoded in {time.perf_counter() - t:.0f} s")
    data = torch.load(work / "data.pt") if "data.pt" in needed else None

    if "t2v" in stages:
        t = time.perf_counter()
        tokenizer, encoder, dit = T.train_t2v(cfg, data["latents"], data["captions"], log, device=args.device)
        tokenizer.save_pretrained(work / "tokenizer")
        encoder.cpu().save_pretrained(work / "text_encoder")
        dit.cpu().save_pretrained(work / "transformer")
        log(f"t2v trained in {time.perf_counter() - t:.0f} s")
    if "transformer" in needed:
        tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
        encoder = UMT5EncoderModel.from_pretrained(work / "text_encoder").eval()
        dit = WanTransformer3DModel.from_pretrained(work / "transformer").eval()

    if "causal" in stages:
        t = time.perf_counter()
        causal = T.train_causal(cfg, dit, tokenizer, encoder, data["long_latents"], data["long_captions"], log,
                                device=args.device)
        torch.save(causal.cpu().state_dict(), work / "causal.pt")
        log(f"causal trained in {time.perf_counter() - t:.0f} s")

    if "save" in stages:
        from composer.configs.demo import ShapesCausalSamplingParam, ShapesT2VSamplingParam
        from composer.convert.self_forcing import CausalSettings
        from composer.models.wan.causal import CausalWanTransformer3DModel
        from composer.models.wan.config import WanTransformerConfig
        from demo.folders import save_causal_folder, save_t2v_folder, write_folder_settings

        vae = AutoencoderKLWan.from_pretrained(work / "vae")
        t2v_dir = save_t2v_folder(args.out / T2V_NAME, tokenizer, encoder, vae, dit, cfg.text_max_length,
                                  flow_shift=cfg.train_shift)
        causal = CausalWanTransformer3DModel(WanTransformerConfig.from_dict(dict(dit.config)))
        causal.load_state_dict(torch.load(work / "causal.pt"))
        settings = CausalSettings(num_frames_per_block=cfg.frames_per_block,
                                  denoising_step_list=list(cfg.causal_sampling_steps),
                                  timestep_shift=cfg.train_shift)
        save_causal_folder(args.out / CAUSAL_NAME, causal, t2v_dir, settings)
        write_folder_settings(t2v_dir, T2V_NAME, ShapesT2VSamplingParam)
        write_folder_settings(args.out / CAUSAL_NAME, CAUSAL_NAME, ShapesCausalSamplingParam)
        size = sum(f.stat().st_size for d in (t2v_dir, args.out / CAUSAL_NAME) for f in d.rglob("*") if f.is_file())
        log(f"wrote {t2v_dir} and {args.out / CAUSAL_NAME} ({size / 2**20:.1f} MiB)")
        if args.eval_prompts:
            from composer.generator import VideoGenerator
            from demo.evaluate import demo_prompts, score_prompts

            gen = VideoGenerator.from_pretrained(t2v_dir, progress=False)
            log(score_prompts(gen, demo_prompts(args.eval_prompts, seed=1000), seed=1000).report())
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
