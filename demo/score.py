"""Prompt-following score: read a video's frames and check the object's colour, motion and shape.

The analysis knows nothing about how the video was made:
- background: the median colour of the first frame's border;
- object mask: pixels far from the background colour (over a fixed floor and half the frame's peak);
- colour: the mask's mean colour, nearest palette entry;
- direction: the centroid's velocity up to the first reversal (a bounce), nearest of 8 directions;
- shape: how much of its bounding box the mask fills (square ~1.0, circle ~0.79, triangle ~0.5), over
  frames where the object does not touch the border.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from demo.shapes import COLORS, DIRECTION_WORDS, DIRECTIONS, SHAPES

_PROMPT = re.compile(
    r"a (?P<color>\w+) (?P<shape>\w+) moving (?P<direction>(?:up|down)(?: and (?:left|right))?|left|right)"
)
_WORDS_TO_DIRECTION = {words: name for name, words in DIRECTION_WORDS.items()}


@dataclass
class Target:
    color: str
    shape: str
    direction: str

    @staticmethod
    def from_prompt(prompt: str) -> Target:
        match = _PROMPT.search(prompt)
        if match is None:
            raise ValueError(f"cannot read a shape prompt from {prompt!r} (expected 'a <color> <shape> moving <dir>')")
        return Target(match["color"], match["shape"], _WORDS_TO_DIRECTION[match["direction"]])


@dataclass
class Analysis:
    color: str | None
    shape: str | None
    direction: str | None
    mean_rgb: np.ndarray | None = None
    area: float = 0.0  # mean mask area in pixels
    fill: float | None = None
    velocity: np.ndarray | None = None
    visible_frames: int = 0

    def matches(self, target: Target) -> dict[str, bool]:
        return {
            "color": self.color == target.color,
            "shape": self.shape == target.shape,
            "direction": self.direction == target.direction,
        }


def object_masks(frames: np.ndarray, threshold: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks [T, H, W] of pixels that differ from the background, and the background colour.

    A pixel is object when its distance from the background is over `threshold` and over half the frame's
    peak distance: a soft edge (a decoder's blur) then does not widen the mask into a round halo, which would
    make every shape read as a circle and pull the mean colour towards the background."""
    f = frames.astype(np.float32)
    border = np.concatenate([f[0, 0], f[0, -1], f[0, :, 0], f[0, :, -1]])
    background = np.median(border, axis=0)
    distance = np.linalg.norm(f - background, axis=-1)
    peak = np.percentile(distance.reshape(len(distance), -1), 99.5, axis=1).reshape(-1, 1, 1)
    return distance > np.maximum(threshold, 0.5 * peak), background


def _nearest(value: np.ndarray, table: dict[str, tuple[float, ...]]) -> str:
    names = list(table)
    distances = [np.linalg.norm(value - np.asarray(table[n], dtype=np.float32)) for n in names]
    return names[int(np.argmin(distances))]


def classify_fill(fill: float) -> str:
    if fill >= 0.88:
        return "square"
    if fill >= 0.64:
        return "circle"
    return "triangle"


def analyze(frames: np.ndarray, min_area: float = 12.0) -> Analysis:
    """Analyse uint8 frames [T, H, W, 3] holding one dominant object."""
    masks, _ = object_masks(frames)
    areas = masks.sum(axis=(1, 2))
    visible = areas >= min_area
    if visible.sum() == 0:
        return Analysis(None, None, None)
    pixels = frames[masks].astype(np.float32)
    mean_rgb = pixels.mean(axis=0)
    color = _nearest(mean_rgb, COLORS)

    fills, centroids = [], []
    h, w = masks.shape[1:]
    for mask, ok in zip(masks, visible):
        if not ok:
            centroids.append(None)
            continue
        ys, xs = np.nonzero(mask)
        centroids.append(np.array([xs.mean(), ys.mean()]))
        y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
        if y0 > 0 and x0 > 0 and y1 < h - 1 and x1 < w - 1:  # not cut by the border
            fills.append(mask.sum() / ((y1 - y0 + 1) * (x1 - x0 + 1)))
    fill = float(np.median(fills)) if fills else None
    shape = classify_fill(fill) if fill is not None else None
    velocity = _initial_velocity(centroids)
    direction = None
    if velocity is not None and np.linalg.norm(velocity) > 0.3:
        unit = velocity / np.linalg.norm(velocity)
        direction = max(DIRECTIONS, key=lambda d: float(np.dot(unit, DIRECTIONS[d])))
    return Analysis(color, shape, direction, mean_rgb, float(areas[visible].mean()), fill, velocity, int(visible.sum()))


def _initial_velocity(centroids: list[np.ndarray | None]) -> np.ndarray | None:
    """Mean centroid velocity from the first visible frame up to the first reversal of either axis."""
    points = [c for c in centroids if c is not None]
    if len(points) < 2:
        return None
    steps = np.diff(np.stack(points), axis=0)
    first = steps[0]
    end = len(steps)
    for i in range(1, len(steps)):
        flipped = [(steps[i][a] * first[a] < 0) and abs(steps[i][a]) > 0.5 and abs(first[a]) > 0.5 for a in (0, 1)]
        if any(flipped):
            end = i
            break
    return steps[:end].mean(axis=0)


@dataclass
class Score:
    """Accuracy per attribute over a set of prompts, and all of them at once."""

    per_prompt: list[tuple[str, dict[str, bool]]] = field(default_factory=list)

    def add(self, prompt: str, frames: np.ndarray) -> dict[str, bool]:
        result = analyze(frames).matches(Target.from_prompt(prompt))
        self.per_prompt.append((prompt, result))
        return result

    def accuracy(self, attribute: str) -> float:
        if not self.per_prompt:
            return 0.0
        if attribute == "overall":
            return float(np.mean([all(r.values()) for _, r in self.per_prompt]))
        return float(np.mean([r[attribute] for _, r in self.per_prompt]))

    def summary(self) -> dict[str, float]:
        return {a: self.accuracy(a) for a in ("color", "shape", "direction", "overall")}


# Chance levels of the attributes, for reading a score.
CHANCE = {"color": 1 / len(COLORS), "shape": 1 / len(SHAPES), "direction": 1 / len(DIRECTIONS)}
