"""`offload = auto` under a parallel layout (torchrun): every rank plans on its own device, then all take the most
conservative of the ranks' plans, so the placement, the VAE tiling and the budget that checks each request are
the same on every rank (ranks that placed the weights differently, or refused a request another accepted, would
run different code and never meet in their collectives)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer.errors import MemoryBudgetError
from composer.logging import get_logger
from composer.memory.plan import HEADROOM, OFFLOAD_ORDER, MemoryPlan, device_peak
from composer.memory.predict import MemoryPredictor, fmt_bytes

logger = get_logger(__name__)

FAILED = -1  # a rank's plan entry when even the weights do not fit its budget


def agree_plan(state: Any, predictor: MemoryPredictor, plan_here: Callable[[], MemoryPlan], make_request,
               video: dict[str, Any]) -> MemoryPlan:
    """Every rank calls this together (`state`: composer.parallel.state.ParallelState). `plan_here()` plans on this
    rank (MemoryBudgetError when nothing fits). Returns the plan every rank uses: the latest placement in
    OFFLOAD_ORDER any rank chose, the VAE tiled when any rank tiles it, and the smallest budget; raises
    MemoryBudgetError on every rank when any rank's weights do not fit."""
    error: MemoryBudgetError | None = None
    try:
        own = plan_here()
        mine = [OFFLOAD_ORDER.index(own.offload), int(own.vae_tiling), own.budget]
    except MemoryBudgetError as exc:
        own, error = None, exc
        mine = [FAILED, 0, 0]
    ranks = [[int(v) for v in entry] for entry in state.gather(mine)]  # the ranks' one load-time agreement call
    failed = [r for r, entry in enumerate(ranks) if entry[0] == FAILED]
    if failed:
        if error is not None:
            raise error
        raise MemoryBudgetError(f"offload = auto: the weights do not fit the memory budget of rank(s) "
                                f"{', '.join(map(str, failed))} (their error names the numbers); every rank stops")
    mode = OFFLOAD_ORDER[max(entry[0] for entry in ranks)]
    tiled = any(entry[1] for entry in ranks)
    budget = min(entry[2] for entry in ranks)
    assert own is not None
    if (mode, tiled, budget) == (own.offload, own.vae_tiling, own.budget):
        plan = own
    else:
        batch, sampling, key = make_request()
        request = predictor.request(batch, sampling, key=key, tiled_decode=tiled)
        peak, on_device = device_peak(predictor, mode, request)
        plan = MemoryPlan(mode, tiled, budget, peak, on_device, request, video, own.considered)
        if not plan.fits:  # (the rank with the smallest budget fitted a placement no later than this one)
            logger.warning("memory plan: the ranks' plan does not fit a %dx%dx%d video in %s (%s after headroom)",
                           video["num_frames"], video["height"], video["width"], fmt_bytes(budget),
                           fmt_bytes(budget / (1 + HEADROOM)))
    if state.is_main:
        each = "; ".join(f"rank {r}: {OFFLOAD_ORDER[e[0]]}{' + tiled VAE' if e[1] else ''} within "
                         f"{fmt_bytes(e[2])}" for r, e in enumerate(ranks))
        logger.info("memory plan, one for the %d ranks (the most conservative of theirs, the smallest budget): %s; "
                    "each rank's own: %s", state.world_size, plan.describe(), each)
    return plan
