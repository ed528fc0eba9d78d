"""`composer convert self-forcing`: turn a Self-Forcing / CausVid checkpoint into a causal model folder.
`composer convert quantize`: write a copy of a model folder whose transformer holds quantized weights."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints of other formats into composer model folders")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{self-forcing,quantize}")
    sf = kinds.add_parser(
        "self-forcing",
        allow_abbrev=False,
        help="Self-Forcing / CausVid generator checkpoint + Wan2.1 base folder -> CausalWanPipeline folder",
    )
    sf.add_argument("--checkpoint", required=True, help="the .pt file ({'generator': ..., ['generator_ema': ...]})")
    sf.add_argument("--base", required=True, help="Wan2.1 T2V diffusers folder or hub id the model was trained from")
    sf.add_argument("--out", required=True, help="folder to write")
    sf.add_argument("--use-ema", action="store_true", help="take 'generator_ema' instead of 'generator'")
    sf.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast weights (default: keep)")
    sf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    sf.add_argument("--num-frames-per-block", type=int, default=3)
    sf.add_argument("--denoising-steps", default="1000,750,500,250", help="comma-separated timesteps")
    sf.add_argument("--no-warp-denoising-step", action="store_true", help="use the step list as is")
    sf.add_argument("--timestep-shift", type=float, default=5.0)
    sf.add_argument("--context-noise", type=float, default=0.0)
    sf.add_argument("--local-attn-size", type=int, default=-1, help="frames attended (sink included); -1: all")
    sf.add_argument("--sink-size", type=int, default=0, help="first frames kept in the window")
    sf.set_defaults(run=run)
    q = kinds.add_parser(
        "quantize",
        allow_abbrev=False,
        help="model folder -> a copy whose transformer(s) hold weight-only quantized weights (torchao), loaded "
             "as they are: quantize once, load many times (docs/quantization.md)",
    )
    q.add_argument("--model-path", default=None, help="model folder or hub id (default: the embedded model)")
    q.add_argument("--quantize", required=True, choices=["int8", "fp8"], help="int8; fp8 on a GPU with fp8 support")
    q.add_argument("--out", required=True, help="folder to write")
    q.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="precision of what stays unquantized and of the scales (default fp32)")
    q.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    q.set_defaults(run=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from composer.convert.quantize import quantize_folder

    out = quantize_folder(args.model_path, args.out, args.quantize, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}: composer generate --model-path {out} --prompt ...")
    return 0


def run(args: argparse.Namespace) -> int:
    from composer.convert.self_forcing import CausalSettings, convert_self_forcing
    from composer.errors import ConfigError
    from composer.runtime import to_torch_dtype

    try:
        steps = [float(s) for s in args.denoising_steps.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--denoising-steps must be comma-separated numbers, got {args.denoising_steps!r}") from None
    settings = CausalSettings(
        num_frames_per_block=args.num_frames_per_block, denoising_step_list=steps,
        warp_denoising_step=not args.no_warp_denoising_step, timestep_shift=args.timestep_shift,
        context_noise=args.context_noise, local_attn_size=args.local_attn_size, sink_size=args.sink_size,
    )
    out = convert_self_forcing(
        args.checkpoint, args.base, args.out, use_ema=args.use_ema, settings=settings,
        dtype=to_torch_dtype(args.dtype) if args.dtype else None, overwrite=args.overwrite,
    )
    print(f"wrote {out}: composer generate --model-path {out} --prompt ...")
    return 0
