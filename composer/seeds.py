"""Seeds: what a request that leaves its seed to chance gets, drawn in one place, from one range."""

from __future__ import annotations

import random

# Drawn seeds are in [0, 2**32): every engine and numpy take them, and a JSON client reads them exactly. A seed given
# by the user may be larger (up to request_check.SEED_MAX, what torch.Generator.manual_seed takes).
DRAWN_SEED_RANGE = 2**32


def draw_seed() -> int:
    """A fresh seed for a request that gave none (the result reports it, so the output can be made again)."""
    return random.SystemRandom().randrange(DRAWN_SEED_RANGE)
