"""Scoring the demo models: prompt following over seeded prompts, and drift over long causal rollouts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from demo.score import CHANCE, Score, Target, analyze
from demo.shapes import ClipSpec, caption


def demo_prompts(count: int, seed: int = 0, size: int = 64) -> list[str]:
    """`count` single-object captions drawn like the training data (seeded)."""
    rng = np.random.default_rng(seed)
    return [caption(ClipSpec.sample(rng, size, max_objects=1)) for _ in range(count)]


@dataclass
class PromptScore:
    score: Score
    seconds: float

    def report(self) -> str:
        summary = self.score.summary()
        n = len(self.score.per_prompt)
        lines = [f"prompt following over {n} prompts ({self.seconds:.1f} s):"]
        for attribute in ("color", "shape", "direction"):
            lines.append(f"  {attribute:<9} {summary[attribute] * 100:5.1f}%   (chance {CHANCE[attribute] * 100:.1f}%)")
        chance = CHANCE["color"] * CHANCE["shape"] * CHANCE["direction"]
        lines.append(f"  {'overall':<9} {summary['overall'] * 100:5.1f}%   (all three right; chance {chance * 100:.2f}%)")
        return "\n".join(lines)


def score_prompts(generator, prompts: list[str], seed: int = 0, **sampling) -> PromptScore:
    """Generate each prompt (seed + i) and score the frames."""
    score, start = Score(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        frames = generator.generate_video(prompt, seed=seed + i, **sampling).frames
        score.add(prompt, frames)
    return PromptScore(score, time.perf_counter() - start)


@dataclass
class ChunkStats:
    color: float  # share of rollouts whose object has the prompted colour in this chunk
    shape: float
    present: float  # share with an object visible at all
    area: float  # mean object area (pixels)
    speed: float  # mean centroid speed (pixels per frame, up to the chunk's first bounce): is it still moving?


@dataclass
class DriftReport:
    chunk_frames: int
    chunks: list[ChunkStats] = field(default_factory=list)
    seconds: float = 0.0
    rollouts: int = 0

    def report(self) -> str:
        if not self.chunks:
            return "no chunks"
        first, last = self.chunks[0], self.chunks[-1]
        lines = [f"temporal drift over {self.rollouts} long rollouts of {len(self.chunks)} chunks x {self.chunk_frames} "
                 f"frames ({self.seconds:.1f} s):",
                 "  chunk  color  shape  present   area  speed"]
        for i, c in enumerate(self.chunks):
            lines.append(f"  {i:5d}  {c.color * 100:4.0f}%  {c.shape * 100:4.0f}%  {c.present * 100:6.0f}%  {c.area:5.1f}"
                         f"  {c.speed:5.2f}")
        area_change = (last.area - first.area) / first.area * 100 if first.area else float("nan")
        lines.append(
            f"  first -> last chunk: color {first.color * 100:.0f}% -> {last.color * 100:.0f}%, shape "
            f"{first.shape * 100:.0f}% -> {last.shape * 100:.0f}%, object area {area_change:+.0f}%, speed "
            f"{first.speed:.2f} -> {last.speed:.2f} px/frame"
        )
        return "\n".join(lines)


def measure_drift(generator, prompts: list[str], num_frames: int, chunk_frames: int = 17, seed: int = 0,
                  **sampling) -> DriftReport:
    """Long rollouts of a causal model, each cut into chunks of `chunk_frames` analysed on their own."""
    start = time.perf_counter()
    per_chunk: list[list[tuple[bool, bool, bool, float, float]]] = []
    for i, prompt in enumerate(prompts):
        target = Target.from_prompt(prompt)
        frames = generator.generate_video(prompt, seed=seed + i, num_frames=num_frames, **sampling).frames
        for c in range(len(frames) // chunk_frames):
            analysis = analyze(frames[c * chunk_frames:(c + 1) * chunk_frames])
            if len(per_chunk) <= c:
                per_chunk.append([])
            per_chunk[c].append((analysis.color == target.color, analysis.shape == target.shape,
                                 analysis.color is not None, analysis.area,
                                 0.0 if analysis.velocity is None else float(np.linalg.norm(analysis.velocity))))
    report = DriftReport(chunk_frames, seconds=time.perf_counter() - start, rollouts=len(prompts))
    for rows in per_chunk:
        arr = np.array(rows, dtype=float)
        report.chunks.append(ChunkStats(*arr.mean(axis=0)))
    return report
