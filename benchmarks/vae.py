"""VAE decode per family: whole video, composer's exact tiles, diffusers' tiles, streamed blocks (docs/memory.md).

Each family's VAE is built at its released config with random weights (speed and memory do not depend on them), the
same seeded latents decoded each way, every (family, way) in a fresh subprocess so that its peak is its own:

- whole: `vae.decode` (composer's DecodingStage without tiling);
- exact-tiled: composer's `vae_tile_size` (trunk on whole frames, the last two up blocks in tiles of `--tile` latent
  pixels with a halo; the Wan VAE: composer/stages/vae_tiling.py; HunyuanVideo's, its GroupNorms taking the whole
  video's statistics from the tiles' sums, and HunyuanVideo-1.5's: composer/stages/vae_tiling_hunyuan.py);
- diffusers-tiled: diffusers' `enable_tiling()` (its default 256-pixel tiles, blended seams);
- streamed: composer's per-block decode of a causal stream (3 latent frames a block, the causal cache carried);
  the Wan2.1 VAE only (what the causal models use);
- taehv (with `--taehv FILE`): the tiny TAEHV preview decoder of that released weights file
  (github.com/madebyollin/taehv; composer's `preview_decoder`, composer/models/taehv.py) on the same latents, 3
  latent frames a call with its memory carried (as a causal stream decodes them); its
  row adds the PSNR of its frames against the full VAE's whole decode: its quality cost. The PSNR means something
  only with the released VAE (`--vae-path`) and real latents (`--latents`, e.g. a saved `GenerationResult.latents`);
  against random VAE weights and Gaussian latents it only shows that the comparison runs.

Per row: seconds, the peak (CUDA: `max_memory_allocated` above the weights; CPU: the rise of peak RSS, the process
run with MALLOC_MMAP_THRESHOLD_=65536 so freed memory leaves it), the peak the memory predictor's fake trace gives
for the same call, and the max uint8 difference against the whole decode.

- split-2 (CPU): composer's exact tiles split over 2 gloo ranks (`decode_tiled(..., group=)`, what a sequence-parallel
  layout with `vae_tile_size` runs): every rank runs the trunk and half the tiles, one all-reduce; each rank with half
  the cores. Seconds and peak are rank 0's (its RSS rise: its own process).

    python benchmarks/vae.py                                  # CPU, 5x256x256, every family
    python benchmarks/vae.py --device cuda --size 81x480x832 --families wan2.1
    python benchmarks/vae.py --device cuda --families wan2.1 --ways whole,taehv --taehv taew2_1.pth \
        --vae-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers --latents latents.pt    # the preview decoder's quality cost
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The released VAE configs (vae/config.json of the releases; diffusers' defaults where they are the release's).
FAMILIES = {
    "wan2.1": ("AutoencoderKLWan", {}),
    "wan2.2": ("AutoencoderKLWan", dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                                        num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True],
                                        is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                        scale_factor_spatial=16, scale_factor_temporal=4,
                                        latents_mean=[0.0] * 48, latents_std=[1.0] * 48)),  # (the release's own
    # per-channel statistics are 48 numbers each; any do for timing)
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", {}),
    "hunyuanvideo15": ("AutoencoderKLHunyuanVideo15", {}),
}
WAYS = ("whole", "exact-tiled", "diffusers-tiled", "streamed", "split-2")  # and "taehv" with --taehv


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vae_folder(path: str) -> Path:
    """A model folder's `vae/` (or a VAE folder itself); a hub id: its `vae/` files, downloaded or from the cache."""
    folder = Path(path).expanduser()
    if not folder.exists():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["vae/*"]))
    return folder / "vae" if (folder / "vae").is_dir() else folder


def build(family: str, device, dtype, fake: bool = False, vae_path: str | None = None):
    """The family's VAE (random weights at its released config, or the released weights of `vae_path`); `fake`:
    built under the caller's fake mode and device (a fake parameter's dtype is changed in place: Module.to cannot
    swap fake parameters)."""
    import diffusers
    import torch

    cls_name, config = FAMILIES[family]
    cls = getattr(diffusers, cls_name)
    if vae_path and not fake:
        return cls.from_pretrained(vae_folder(vae_path), torch_dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    vae = cls.from_config(cls.load_config(vae_folder(vae_path))) if vae_path else cls(**config)
    if fake:
        for param in vae.parameters():
            param.data = param.data.to(dtype)
        return vae.eval()
    return vae.to(device, dtype).eval()


def latents_for(vae, size: str, path: str | None = None):
    """Seeded Gaussian latents of the video size, or the latents saved at `path` ([B, C, T, h, w] or [C, T, h, w],
    the DiT's normalized latents, as `GenerationResult.latents`)."""
    import torch

    if path:
        z = torch.load(path, map_location="cpu", weights_only=True)
        return (z if z.ndim == 5 else z[None]).float()
    frames, height, width = (int(x) for x in size.split("x"))
    spatial = int(getattr(vae.config, "scale_factor_spatial", None) or getattr(vae, "spatial_compression_ratio", 8))
    temporal = int(getattr(vae.config, "scale_factor_temporal", None) or getattr(vae, "temporal_compression_ratio", 4))
    channels = vae.config.z_dim if hasattr(vae.config, "z_dim") else vae.config.latent_channels
    shape = (1, channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(0))


def decoder_for(way: str, vae, tile: int):
    """A function of the DiT's (normalized) latents -> video [B, 3, T, H, W]; None when the way does not apply."""
    import torch

    from composer.stages.decoding import StreamingVideoDecoder, denormalize_latents
    from composer.stages.vae_tiling import decode_exact_tiled, has_exact_tiled_decode

    def raw(z):
        return denormalize_latents(z, vae.config)

    if way == "whole":
        return lambda z: vae.decode(raw(z), return_dict=False)[0]
    if way == "exact-tiled":
        return (lambda z: decode_exact_tiled(vae, raw(z), tile=tile)) if has_exact_tiled_decode(vae) else None
    if way == "diffusers-tiled":
        if not hasattr(vae, "enable_tiling"):
            return None

        def tiled(z):
            vae.enable_tiling()
            try:
                return vae.decode(raw(z), return_dict=False)[0]
            finally:
                vae.disable_tiling()

        return tiled
    if way == "streamed":
        if type(vae).__name__ != "AutoencoderKLWan" or vae.config.patch_size is not None:
            return None

        def streamed(z):  # frames back as a [-1, 1] video, for the comparison
            decoder = StreamingVideoDecoder(vae)
            chunks = [StreamingVideoDecoder.decode_frames_together([decoder], [z[:, :, i:i + 3]])
                      for i in range(0, z.shape[2], 3)]
            frames = torch.cat(chunks, dim=1)  # uint8 [B, T, H, W, 3]
            return frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0

        return streamed
    raise ValueError(way)


def preview_decoder_for(path: str, z, device, dtype):
    """The TAEHV preview decoder of the weights file at `path` as a function of the DiT's latents -> video in [-1, 1]
    (it takes those latents as they are: no denormalization); None when the file is for other latents."""
    import torch

    from composer.models.taehv import load_preview_decoder

    preview = load_preview_decoder(path, device=device, dtype=dtype)
    if preview.config.latent_channels != z.shape[1]:
        return None

    def previews(latents):
        """3 latent frames a call, the memory carried: as a causal stream decodes them (the frames of one call
        over the whole video, at a fraction of its activations)."""
        state, parts = None, []
        for start in range(0, latents.shape[2], 3):
            video, state = preview.decode(latents[:, :, start:start + 3], state)
            parts.append(video)
        return torch.cat(parts, dim=2) * 2.0 - 1.0

    return previews


def _split_rank(rank: int, world: int, opts: dict, out_file: str) -> None:
    """One rank of the split-N way: the exact tiles shared over the gloo group of the ranks."""
    import torch
    import torch.distributed as dist

    from composer.stages.decoding import denormalize_latents, video_to_frames
    from composer.stages.vae_tiling import decode_exact_tiled

    ns = argparse.Namespace(**opts)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[ns.dtype]
    vae = build(ns.family, torch.device("cpu"), dtype, vae_path=ns.vae_path)
    z = latents_for(vae, ns.size, ns.latents).to(dtype)
    with torch.inference_mode():
        base = rss()
        dist.barrier()
        start = time.perf_counter()
        video = decode_exact_tiled(vae, denormalize_latents(z, vae.config), tile=ns.tile, group=dist.group.WORLD)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        if rank != 0:
            return
        frames = video_to_frames(video)
        del video
        reference = video_to_frames(decoder_for("whole", vae, ns.tile)(z))
    Path(out_file).write_text(json.dumps({"seconds": seconds, "peak": peak, "latents": list(z.shape),
                                          "max_uint8_diff": int((frames.int() - reference.int()).abs().max())}))


def measure_split(args, ranks: int) -> dict:
    """The split-N way: N gloo ranks on this machine, each with its share of the cores."""
    import tempfile

    from composer.stages.vae_tiling import has_exact_tiled_decode
    from composer.testing.distributed import spawn

    out = {"family": args.family, "way": args.way}
    if args.device != "cpu" or not has_exact_tiled_decode(_meta_vae(args.family)):
        return {**out, "skipped": True}
    opts = {k: getattr(args, k) for k in ("family", "dtype", "size", "tile", "vae_path", "latents")}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        spawn(_split_rank, ranks, opts, str(result), timeout_s=3600, collective_timeout_s=3600,
              threads=max(1, (os.cpu_count() or ranks) // ranks))
        row = json.loads(result.read_text())
    return {**out, **row, "traced": None}


def _meta_vae(family: str):
    """The family's VAE class on the meta device (what kind of decoder it has, without weights)."""
    import diffusers
    import torch

    cls_name, config = FAMILIES[family]
    with torch.device("meta"):
        return getattr(diffusers, cls_name)(**config)


def measure(args) -> dict:
    import torch

    if args.way.startswith("split-"):
        return measure_split(args, int(args.way.split("-")[1]))

    from composer.memory import traced_peak
    from composer.memory.trace import fake_mode
    from composer.stages.decoding import video_to_frames

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    vae = build(args.family, device, dtype, vae_path=args.vae_path)
    z = latents_for(vae, args.size, args.latents).to(device, dtype)
    out = {"family": args.family, "way": args.way, "latents": list(z.shape)}
    if args.way == "taehv":
        fn = preview_decoder_for(args.taehv, z, device, dtype)
    else:
        fn = decoder_for(args.way, vae, args.tile)
    if fn is None:
        return {**out, "skipped": True}
    with torch.inference_mode():
        # no warmup and the reference after: a CPU process's peak RSS is its lifetime's, so the way measured runs
        # first (on CUDA the peak is reset; its first call's kernel selection is in its seconds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            base = rss()
        start = time.perf_counter()
        video = fn(z)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["seconds"] = time.perf_counter() - start
        if device.type == "cuda":
            out["peak"] = torch.cuda.max_memory_allocated(device) - base
        else:
            out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        frames = video_to_frames(video)
        del video
        reference = video_to_frames(decoder_for("whole", vae, args.tile)(z))
    out["max_uint8_diff"] = int((frames.int() - reference.int()).abs().max())
    if args.way == "taehv":  # its quality cost; the predictor does not model the preview decoder
        from step_cache import psnr

        out["psnr_db"] = psnr(frames.numpy(), reference.numpy())
        out["traced"] = None
        return out
    # the predictor's view of the same call: a fake twin of this VAE
    mode = fake_mode()
    with mode, torch.device(device):
        twin = build(args.family, device, dtype, fake=True, vae_path=args.vae_path)
    twin_fn = decoder_for(args.way, twin, args.tile)
    fake_z = z.clone()
    out["traced"], _ = traced_peak(lambda: twin_fn(fake_z), mode=mode, device=device)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--size", default="5x256x256", help="FRAMESxHEIGHTxWIDTH of the video")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--tile", type=int, default=16,
                   help="exact-tiled: latent pixels a side (default 16; the memory planner uses 32)")
    p.add_argument("--taehv", default=None, metavar="FILE",
                   help="a TAEHV weights file (taew2_1.pth, taew2_2.pth, ...): adds the way 'taehv', the preview "
                        "decoder's time, peak and PSNR against the full VAE's whole decode")
    p.add_argument("--vae-path", default=None,
                   help="the released VAE's weights (a model folder, its vae/ folder, or a cached hub id) instead of "
                        "random ones: needed for a meaningful --taehv PSNR (give one family with --families)")
    p.add_argument("--latents", default=None, metavar="FILE",
                   help="decode these latents (torch.save of [B, C, T, h, w], the DiT's normalized latents, e.g. a "
                        "GenerationResult.latents) instead of Gaussian ones of --size")
    p.add_argument("--json", default=None)
    p.add_argument("--family", default=None, help=argparse.SUPPRESS)
    p.add_argument("--way", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.family:
        print("RESULT " + json.dumps(measure(args)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    ways = args.ways.split(",")
    if args.taehv and "taehv" not in ways:
        ways.append("taehv")
    if "taehv" in ways and not args.taehv:
        p.error("the way 'taehv' needs --taehv FILE")
    extra = []  # the options each measuring subprocess needs too
    for name, flag in (("taehv", "--taehv"), ("vae_path", "--vae-path"), ("latents", "--latents")):
        if getattr(args, name):
            extra += [flag, getattr(args, name)]
    print(f"{args.device} {args.dtype}, video {args.latents or args.size}, exact tiles of {args.tile} latent pixels, "
          f"{'the VAE of ' + args.vae_path if args.vae_path else 'random VAE weights'}")
    if args.taehv and not (args.vae_path and args.latents):
        print("NOTE: the taehv PSNR below is meaningless: it compares against "
              f"{'a VAE with random weights' if not args.vae_path else 'the VAE'}"
              f"{' on Gaussian latents' if not args.latents else ''}; give --vae-path and --latents to measure the "
              "preview decoder's quality cost")
    print(f"{'family':<13} {'way':<16} {'seconds':>8} {'peak':>10} {'traced':>10} {'uint8 diff':>10} {'PSNR':>8}")
    for family in args.families.split(","):
        for way in ways:
            cmd = [sys.executable, __file__, "--family", family, "--way", way, "--device", args.device, "--dtype",
                   args.dtype, "--size", args.size, "--tile", str(args.tile), *extra]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if res.returncode or line is None:
                print(f"{family:<13} {way:<16} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
                continue
            row = json.loads(line[len("RESULT "):])
            rows.append(row)
            if row.get("skipped"):
                print(f"{family:<13} {way:<16} {'(does not apply)':>8}")
                continue
            traced = "-" if row["traced"] is None else f"{row['traced'] / 2**20:.1f}Mi"
            quality = f"{row['psnr_db']:.2f}dB" if "psnr_db" in row else ""
            print(f"{family:<13} {way:<16} {row['seconds']:>8.2f} {row['peak'] / 2**20:>8.1f}Mi "
                  f"{traced:>10} {row['max_uint8_diff']:>10} {quality:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
