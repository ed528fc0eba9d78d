"""Synthetic clips of coloured shapes moving at constant velocity and bouncing off the walls, with captions
built from a small vocabulary ("a red circle moving left on a black background").

Everything is seeded: `ClipSpec.sample(rng)` draws a spec, `render(spec)` draws its frames (anti-aliased by
supersampling), `caption(spec)` words it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "purple": (160, 60, 220),
    "cyan": (40, 220, 230),
    "white": (240, 240, 240),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"black": (0, 0, 0)}
SHAPES = ("circle", "square", "triangle")
# unit vectors in image coordinates (y grows downwards)
DIRECTIONS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
    "up-left": (-0.7071, -0.7071),
    "up-right": (0.7071, -0.7071),
    "down-left": (-0.7071, 0.7071),
    "down-right": (0.7071, 0.7071),
}
CLEAR_FRAMES = 4  # frames of motion before any bounce, by default
DIRECTION_WORDS = {  # how a direction reads in a caption
    "left": "left", "right": "right", "up": "up", "down": "down",
    "up-left": "up and left", "up-right": "up and right", "down-left": "down and left", "down-right": "down and right",
}


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    color: str
    direction: str
    size: float  # radius / half side, in pixels
    x: float  # start centre
    y: float
    speed: float  # pixels per frame


@dataclass(frozen=True)
class ClipSpec:
    objects: tuple[ShapeSpec, ...]
    background: str = "black"

    @staticmethod
    def sample(rng: np.random.Generator, size: int = 64, max_objects: int = 1,
               clear_frames: int = CLEAR_FRAMES) -> ClipSpec:
        """A random spec whose objects move `clear_frames` frames in their named direction before any bounce.
        The draws do not depend on `clear_frames` (only where they land), so one seed gives the same shapes,
        colours, directions and captions for every value."""
        background = str(rng.choice(list(BACKGROUNDS)))
        count = int(rng.integers(1, max_objects + 1))
        colors = rng.choice(list(COLORS), count, replace=False)
        objects = []
        for color in colors:
            radius = float(rng.uniform(0.13, 0.19) * size)
            direction = str(rng.choice(list(DIRECTIONS)))
            # 1.6-2.6 px/frame at 64x64: a 17-frame clip crosses about half the frame, so the named direction
            # is most of what happens (at most one bounce); faster, the walls decide most of the motion
            speed = float(rng.uniform(0.025, 0.04) * size)
            # Start where the first clear_frames steps stay clear of the walls, so the motion a caption names
            # is what the clip opens with; bounces come later.
            reach = np.abs(DIRECTIONS[direction]) * speed * clear_frames
            start = []
            for axis in (0, 1):
                lo, hi = radius, size - radius
                if DIRECTIONS[direction][axis] > 0:
                    hi -= reach[axis]
                elif DIRECTIONS[direction][axis] < 0:
                    lo += reach[axis]
                if lo > hi:
                    raise ValueError(f"clear_frames={clear_frames} does not fit: a {radius:.1f} px shape at "
                                     f"{speed:.2f} px/frame runs into a wall of the {size} px frame first")
                start.append(float(rng.uniform(lo, hi)))
            objects.append(ShapeSpec(str(rng.choice(SHAPES)), str(color), direction, radius, start[0], start[1], speed))
        return ClipSpec(tuple(objects), background)


def caption(spec: ClipSpec) -> str:
    parts = [f"a {o.color} {o.shape} moving {DIRECTION_WORDS[o.direction]}" for o in spec.objects]
    return " and ".join(parts) + f" on a {spec.background} background"


def trajectory(obj: ShapeSpec, num_frames: int, size: int) -> np.ndarray:
    """Centres [T, 2] (x, y) moving at constant velocity and bouncing off the walls."""
    lo, hi = obj.size, size - obj.size
    dx, dy = DIRECTIONS[obj.direction]
    out = np.zeros((num_frames, 2))
    x, y, vx, vy = obj.x, obj.y, dx * obj.speed, dy * obj.speed
    for t in range(num_frames):
        out[t] = (x, y)
        x, y = x + vx, y + vy
        if x < lo or x > hi:
            vx, x = -vx, float(np.clip(2 * (lo if x < lo else hi) - x, lo, hi))
        if y < lo or y > hi:
            vy, y = -vy, float(np.clip(2 * (lo if y < lo else hi) - y, lo, hi))
    return out


REACH = 1.15  # every shape lies within REACH * r of its centre (the triangle's circumradius; the others less)


def _coverage(shape: str, cx: float, cy: float, r: float, xs: np.ndarray, ys: np.ndarray, ss: int = 4) -> np.ndarray:
    """Fraction of each pixel of the window with pixel columns `xs` and rows `ys` that the shape covers
    (supersampled ss x ss)."""
    sub = (np.arange(ss) + 0.5) / ss
    gx, gy = np.meshgrid((xs[:, None] + sub).ravel(), (ys[:, None] + sub).ravel())
    if shape == "circle":
        inside = (gx - cx) ** 2 + (gy - cy) ** 2 <= r**2
    elif shape == "square":
        inside = (np.abs(gx - cx) <= r * 0.89) & (np.abs(gy - cy) <= r * 0.89)  # about a circle's area
    else:  # upward triangle inscribed in a circle of radius REACH * r
        rr = r * REACH
        top, base = cy - rr, cy + rr * 0.5
        half_width = (gy - top) / (base - top) * rr * 0.866
        inside = (gy >= top) & (gy <= base) & (np.abs(gx - cx) <= half_width)
    return inside.reshape(len(ys), ss, len(xs), ss).mean(axis=(1, 3))


def _window(centre: float, reach: float, size: int) -> np.ndarray:
    """Pixel indices that a shape centred at `centre` reaching `reach` pixels either side can touch."""
    return np.arange(max(0, int(np.floor(centre - reach)) - 1), min(size, int(np.ceil(centre + reach)) + 1))


def render(spec: ClipSpec, num_frames: int = 17, size: int = 64) -> np.ndarray:
    """uint8 frames [T, size, size, 3]. Each shape is drawn only in the window of pixels it can touch, which
    is what makes rendering training data cheap."""
    frames = np.empty((num_frames, size, size, 3), dtype=np.float32)
    frames[:] = BACKGROUNDS[spec.background]
    paths = [trajectory(o, num_frames, size) for o in spec.objects]
    for t in range(num_frames):
        for obj, path in zip(spec.objects, paths):
            cx, cy = path[t]
            xs, ys = _window(cx, REACH * obj.size, size), _window(cy, REACH * obj.size, size)
            alpha = _coverage(obj.shape, cx, cy, obj.size, xs, ys)[..., None]
            view = frames[t, ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1]
            view[:] = view * (1 - alpha) + np.array(COLORS[obj.color], dtype=np.float32) * alpha
    return frames.round().clip(0, 255).astype(np.uint8)


def vocabulary() -> list[str]:
    """Every word a caption can use."""
    words = {"a", "moving", "on", "background", "and", *SHAPES, *COLORS, *BACKGROUNDS}
    for phrase in DIRECTION_WORDS.values():
        words.update(phrase.split())
    return sorted(words)
