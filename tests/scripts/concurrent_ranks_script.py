"""Concurrent requests under torchrun: every rank loads with ulysses_degree=2 and runs the same three requests from
three threads (two text-to-video jobs of different seeds and a stream on the causal model, started in a different
order on each rank); rank 0 plans every transformer call. argv: t2v_folder causal_folder out_dir."""

import contextlib
import os
import sys
import threading

import numpy as np
import torch

from composer import VideoGenerator

torch.set_num_threads(1)
t2v_folder, causal_folder, out_dir = sys.argv[1:4]
rank = int(os.environ["RANK"])
gen = VideoGenerator.from_pretrained(t2v_folder, dtype="fp32", progress=False, ulysses_degree=2, dist_timeout=60)
causal = VideoGenerator.from_pretrained(causal_folder, dtype="fp32", progress=False, ulysses_degree=2,
                                        dist_timeout=60)
results = {}
errors = []


def guarded(fn):
    def run(arg):
        try:
            fn(arg)
        except BaseException:  # a thread's exception would otherwise only be printed: the script must fail
            import traceback

            errors.append(f"{fn.__name__}({arg}): {traceback.format_exc()}")
    return run


def job(seed):
    out = gen.generate_video("a red ball moves left", height=48, width=80, num_frames=9, num_inference_steps=3,
                             guidance_scale=5.0, seed=seed)
    results[f"t2v{seed}"] = out.frames


def stream(seed):
    chunks = causal.stream_video([("a red ball moves left", 2), ("a blue cube", 1)], seed=seed, height=32,
                                 width=32, guidance_scale=3.0)
    results[f"stream{seed}"] = np.concatenate([c.frames for c in chunks])


work = [(job, 1), (job, 2), (stream, 3), (stream, 4)]
if rank == 1:
    work.reverse()  # threads start in another order on this rank: rank 0's plan decides
threads = [threading.Thread(target=guarded(fn), args=(arg,)) for fn, arg in work]
schedulers = gen.pipeline.engines[0].scheduler, causal.pipeline.engines[0].scheduler
if rank == 0:  # rank 0's plans decide: held until both requests of each model queued a unit, so they share a call
    with contextlib.ExitStack() as stack:
        for scheduler in schedulers:
            stack.enter_context(scheduler.held())
        for t in threads:
            t.start()
        for scheduler in schedulers:
            assert scheduler.wait_for_units(2, 120), "two requests never queued a unit together"
else:
    for t in threads:
        t.start()
for t in threads:
    t.join()
if errors:
    sys.exit(f"rank {rank}: " + "\n".join(errors))
stats = [scheduler.stats for scheduler in schedulers]
torch.save({"frames": {k: torch.from_numpy(v) for k, v in results.items()},
            "calls": [s.calls for s in stats], "units": [s.units for s in stats],
            "tasks": [gen.core.submitted, causal.core.submitted]}, f"{out_dir}/rank{rank}.pt")
print(f"rank {rank} done", flush=True)
