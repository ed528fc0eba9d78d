"""Prompt switches of a causal stream: restart, keep and recache (`prompt_switch`) on the demo's shapes-causal.

Each run streams two segments, (p0, --before blocks) then (p1, --after blocks), where p1 changes p0's colour and
direction ("a red circle moving left" -> "a blue circle moving right"), for every seed and prompt pair, in each
mode. Read from the decoded frames (the demo's object mask: pixels far from the background colour):

- **new colour by**: frames after the switch (0: its first frame) until the new colour dominates the object and
  keeps dominating for `HOLD` frames (or to the end): a frame's *new-colour share* is the share of its object's
  pixels nearer the new colour's RGB than the old one's. "never" counts runs where that does not happen.
- **1st block**: the mean new-colour share over the 4 frames the first block after the switch decodes to (the
  VAE blends a latent frame's 4 frames, so the colour often turns within them); **share after** the mean over
  every frame after the switch, a frame without an object counting 0; **visible** the share of the frames after
  the switch that show an object at all.
- **dir ok**: the share of runs whose object moves in the new direction after the switch (the demo scorer's
  direction read from the frames after it, up to the first bounce).
- **jump / within**: smoothness across the switch. A pair of consecutive frames differs by its mean absolute
  difference (uint8 units, all pixels and channels). *jump* is that of the last frame before the switch and the
  first after; *within* the mean of the same pairs at the other latent-frame boundaries inside the segments (a
  latent frame decodes to 4 frames, which the VAE blends; the pairs that straddle two latent frames are the fair
  comparison). jump / within = 1: the switch is as smooth as the video around it. A new colour is itself a
  large pixel difference, so **moved** / **within** give the same for the object's centroid (pixels it moves
  between the two frames; runs where the object is missing on either side are left out): a jump in position is
  a cut, a new colour is the prompt.
- **prefill**: `stats.prefill_seconds` of the stream, median over runs. With --before <= rollout_blocks the first
  rollout has no prefill, so this is the switch's own: restart prefills overlap_frames latent frames, recache every
  frame the old cache saw, keep only copies the old cache into the new one. **block** is the median block time.

    python benchmarks/prompt_switch.py                      # 4 seeds x 4 pairs x 3 modes on CPU (2-core: ~2 min)
    python benchmarks/prompt_switch.py --seeds 8 --device cuda --json switch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for _path in (BENCH_DIR, REPO_ROOT):  # the repository's composer and demo/ (the shapes scorer) first
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

MODES = ("restart", "keep", "recache")
PAIRS = [  # (before, after): a new colour and a new direction, the same shape
    ("a red circle moving left", "a blue circle moving right"),
    ("a green square moving up", "a yellow square moving down"),
    ("a purple triangle moving right", "a cyan triangle moving left"),
    ("a blue circle moving down", "a red circle moving up"),
]
HOLD = 8  # frames (two latent frames) the new colour must keep dominating
MIN_AREA = 12  # pixels: a smaller mask is no object (the demo scorer's floor)


# -- measures on uint8 frames [T, H, W, 3] --------------------------------------------------------------------
def new_colour_shares(frames: np.ndarray, old: str, new: str) -> np.ndarray:
    """Per frame, the share of the object's pixels nearer the `new` palette colour than the `old` one (NaN
    where no object is visible). The object mask is the demo scorer's (distance from the first frame's border
    colour), so it needs no knowledge of how the video was made."""
    from demo.score import object_masks
    from demo.shapes import COLORS

    masks, _ = object_masks(frames)
    a, b = np.asarray(COLORS[old], np.float32), np.asarray(COLORS[new], np.float32)
    shares = np.full(len(frames), np.nan)
    for t, mask in enumerate(masks):
        if mask.sum() < MIN_AREA:
            continue
        pixels = frames[t][mask].astype(np.float32)
        shares[t] = float(np.mean(np.linalg.norm(pixels - b, axis=1) < np.linalg.norm(pixels - a, axis=1)))
    return shares


def frames_until_dominant(shares: np.ndarray, start: int, hold: int = HOLD) -> int | None:
    """Frames after `start` until the share is over one half and stays so for `hold` frames (or to the end);
    None when that never happens."""
    above = np.nan_to_num(shares, nan=0.0) > 0.5
    for t in range(start, len(shares)):
        if above[t:t + hold].all():
            return t - start
    return None


def mean_abs_diffs(frames: np.ndarray) -> np.ndarray:
    """d[t] = mean |frame t - frame t-1| over pixels and channels (d[0] = NaN)."""
    f = frames.astype(np.float32)
    return np.concatenate([[np.nan], np.abs(f[1:] - f[:-1]).mean(axis=(1, 2, 3))])


def latent_boundaries(num_frames: int, temporal: int = 4) -> list[int]:
    """Frames t whose pair (t - 1, t) straddles two latent frames: 1, 5, 9, ... (the first latent frame decodes
    to one frame, every later one to `temporal`)."""
    return list(range(1, num_frames, temporal))


def smoothness(frames: np.ndarray, switch: int) -> tuple[float, float]:
    """(the jump at the switch, the mean of the other latent-frame boundaries' differences)."""
    d = mean_abs_diffs(frames)
    others = [d[t] for t in latent_boundaries(len(frames)) if t != switch]
    return float(d[switch]), float(np.mean(others))


def centroids(frames: np.ndarray) -> np.ndarray:
    """[T, 2] the object mask's centroid (x, y) per frame; NaN where no object is visible."""
    from demo.score import object_masks

    masks, _ = object_masks(frames)
    out = np.full((len(frames), 2), np.nan)
    for t, mask in enumerate(masks):
        if mask.sum() >= MIN_AREA:
            ys, xs = np.nonzero(mask)
            out[t] = xs.mean(), ys.mean()
    return out


def motion_smoothness(frames: np.ndarray, switch: int) -> tuple[float, float]:
    """(pixels the centroid moves across the switch, the mean of its moves at the other latent-frame boundaries);
    NaN where the object is missing."""
    c = centroids(frames)
    step = np.concatenate([[np.nan], np.linalg.norm(c[1:] - c[:-1], axis=1)])
    others = [step[t] for t in latent_boundaries(len(frames)) if t != switch and np.isfinite(step[t])]
    return float(step[switch]), float(np.mean(others)) if others else float("nan")


# -- runs -------------------------------------------------------------------------------------------------
@dataclass
class Run:
    mode: str
    seed: int
    before: str
    after: str
    until: int | None  # frames after the switch until the new colour dominates
    first_block: float
    share_after: float
    visible: float
    direction_ok: bool
    jump: float
    within: float
    moved: float  # centroid pixels across the switch (NaN: no object on a side)
    moved_within: float
    prefill_s: float
    block_s: float


@dataclass
class Summary:
    mode: str
    runs: int
    until_median: float | None
    until_mean: float | None
    never: int
    first_block: float
    share_after: float
    visible: float
    direction_ok: float
    jump: float
    within: float
    ratio: float
    moved: float
    moved_within: float
    moved_runs: int  # runs with the object on both sides of the switch
    prefill_s: float
    block_s: float
    rows: list[Run] = field(default_factory=list)


def run_one(gen, mode: str, seed: int, before: str, after: str, blocks: tuple[int, int]) -> Run:
    from demo.score import Target, analyze

    stream = gen.stream_video([(before, blocks[0]), (after, blocks[1])], seed=seed, prompt_switch=mode)
    chunks = list(stream)
    frames = stream.frames
    switch = next(c.start_frame for c in chunks if c.segment == 1)  # the first frame made under `after`
    old, new = Target.from_prompt(before), Target.from_prompt(after)
    shares = new_colour_shares(frames, old.color, new.color)
    jump, within = smoothness(frames, switch)
    moved, moved_within = motion_smoothness(frames, switch)
    return Run(
        mode=mode, seed=seed, before=before, after=after,
        until=frames_until_dominant(shares, switch),
        first_block=float(np.nan_to_num(shares[switch:switch + 4], nan=0.0).mean()),
        share_after=float(np.nan_to_num(shares[switch:], nan=0.0).mean()),
        visible=float(np.isfinite(shares[switch:]).mean()),
        direction_ok=analyze(frames[switch:]).direction == new.direction,
        jump=jump, within=within, moved=moved, moved_within=moved_within,
        prefill_s=stream.stats.prefill_seconds,
        block_s=statistics.median(stream.stats.block_seconds),
    )


def summarize(mode: str, rows: list[Run]) -> Summary:
    reached = [r.until for r in rows if r.until is not None]
    seen = [r for r in rows if np.isfinite(r.moved) and np.isfinite(r.moved_within)]
    jump, within = float(np.mean([r.jump for r in rows])), float(np.mean([r.within for r in rows]))
    return Summary(
        mode=mode, runs=len(rows),
        until_median=float(statistics.median(reached)) if reached else None,
        until_mean=float(np.mean(reached)) if reached else None,
        never=len(rows) - len(reached),
        first_block=float(np.mean([r.first_block for r in rows])),
        share_after=float(np.mean([r.share_after for r in rows])),
        visible=float(np.mean([r.visible for r in rows])),
        direction_ok=float(np.mean([r.direction_ok for r in rows])),
        jump=jump, within=within, ratio=float(np.mean([r.jump / r.within for r in rows])),
        moved=float(np.mean([r.moved for r in seen])) if seen else float("nan"),
        moved_within=float(np.mean([r.moved_within for r in seen])) if seen else float("nan"),
        moved_runs=len(seen),
        prefill_s=statistics.median(r.prefill_s for r in rows),
        block_s=statistics.median(r.block_s for r in rows),
        rows=rows,
    )


def print_table(summaries: list[Summary], args: argparse.Namespace) -> None:
    print(f"\nprompt switch on {args.model} ({args.device}, {torch.get_num_threads()} threads): "
          f"{args.before} + {args.after} blocks, {args.seeds} seeds x {len(PAIRS[:args.pairs])} pairs per mode")
    print(f"  {'mode':<8} {'new colour by':>14} {'never':>6} {'1st block':>10} {'share after':>12} {'visible':>8} "
          f"{'dir ok':>7} {'jump':>6} {'within':>7} {'jump/within':>12} {'moved':>6} {'within':>7} {'prefill':>10} "
          f"{'block':>9}")
    for s in summaries:
        until = "-" if s.until_median is None else f"{s.until_median:.0f} ({s.until_mean:.1f})"
        print(f"  {s.mode:<8} {until:>14} {s.never:>6} {s.first_block:>10.2f} {s.share_after:>12.2f} "
              f"{s.visible * 100:>7.0f}% {s.direction_ok * 100:>6.0f}% {s.jump:>6.1f} {s.within:>7.1f} "
              f"{s.ratio:>12.2f} {s.moved:>6.2f} {s.moved_within:>7.2f} {s.prefill_s * 1e3:>7.1f} ms "
              f"{s.block_s * 1e3:>6.1f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=4, help="seeds 0 .. N-1 per prompt pair (default 4)")
    p.add_argument("--pairs", type=int, default=len(PAIRS), help=f"prompt pairs to use, of {len(PAIRS)} (default all)")
    p.add_argument("--before", type=int, default=6, help="blocks before the switch (default 6: one rollout)")
    p.add_argument("--after", type=int, default=3,
                   help="blocks after the switch (default 3: keep's and recache's cache then spans the 9 latent "
                        "frames the model was trained on; restart's 3 + 3)")
    p.add_argument("--model", default="shapes-causal", help="a shapes model folder or name (default shapes-causal)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write every run and the summaries here")
    args = p.parse_args(argv)
    for name in ("seeds", "pairs", "before", "after"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[Summary]:
    args = parse_args(argv)
    from wan_vs_diffusers import quiet_libraries, warn_if_busy

    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(args.model, device=args.device, progress=False)
    blocks = (args.before, args.after)
    list(gen.stream_video([(PAIRS[0][0], 1), (PAIRS[0][1], 1)], seed=0))  # warmup
    warn_if_busy("before the runs")
    start = time.perf_counter()
    rows: dict[str, list[Run]] = {m: [] for m in MODES}
    for before, after in PAIRS[:args.pairs]:
        for seed in range(args.seeds):
            for mode in MODES:  # the modes of one (pair, seed) back to back: load hits them alike
                rows[mode].append(run_one(gen, mode, seed, before, after, blocks))
    summaries = [summarize(m, rows[m]) for m in MODES]
    print_table(summaries, args)
    print(f"  ({time.perf_counter() - start:.0f} s. new colour by: frames after the switch, median (mean) of the "
          f"runs where it happened, held {HOLD} frames; jump/within: the mean of the runs' ratios; moved: px, over the "
          f"runs with the object on both sides: {', '.join(f'{s.mode} {s.moved_runs}' for s in summaries)})")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in summaries], indent=1))
    return summaries


if __name__ == "__main__":
    main()
