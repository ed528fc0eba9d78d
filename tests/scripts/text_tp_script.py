"""A text model under torchrun with tensor parallel: every rank loads the folder with tp_size=2 and generates the
same requests, one after another and then at once; each rank saves its ids and its forward batcher's counts.
argv: folder out_dir."""

import json
import os
import sys

import torch

from composer import TextGenerator

torch.set_num_threads(1)
folder, out_dir = sys.argv[1:3]
rank = int(os.environ["RANK"])
gen = TextGenerator.from_pretrained(folder, progress=False, tp_size=2, dist_timeout=60)
results = {}
for name, settings in {"sampled": {"temperature": 1.0, "seed": 1},
                       "threshold": {"decoding": "threshold", "threshold": 0.3, "seed": 2},
                       "kv": {"decoding": "threshold+kv", "threshold": 0.3, "seed": 3}}.items():
    results[name] = gen.generate_text("what is two plus two ?", gen_length=16, num_inference_steps=4,
                                      **settings).token_ids
# no seed: rank 0 draws it for every rank (sampled tokens, the same on every rank)
unseeded = gen.generate_text("what is two plus two ?", gen_length=16, num_inference_steps=4, temperature=1.0)
# the same requests at once, submitted in another order on each rank: rank 0 plans every forward (held until all
# three have queued their first one, so that they share calls), the other rank runs the same calls
requests = {"sampled": ("what is two plus two ?", {"temperature": 1.0, "seed": 1}),
            "threshold": ("what is two plus two ?", {"decoding": "threshold", "threshold": 0.3, "seed": 2}),
            "kv": ("what is two plus two ?", {"decoding": "threshold+kv", "threshold": 0.3, "seed": 3})}
batcher = gen.pipeline.batcher
before = (batcher.stats.calls, batcher.stats.units, batcher.stats.batched_units)
order = list(requests) if rank == 0 else list(reversed(requests))
with batcher.held():
    futures = {name: gen.submit_text(requests[name][0], gen_length=16, num_inference_steps=4, **requests[name][1])
               for name in order}
    if rank == 0:
        assert batcher.wait_for_units(3, 60), "the three requests' first forwards never queued"
concurrent = {name: futures[name].result(timeout=120).token_ids for name in requests}
stats = [a - b for a, b in zip((batcher.stats.calls, batcher.stats.units, batcher.stats.batched_units), before)]
shard = gen.pipeline.modules["model"].model.transformer["blocks"][0].q_proj.weight.shape[0]
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump({"ids": results, "q_rows": shard, "concurrent": concurrent, "stats": stats,
               "unseeded": [unseeded.seed, unseeded.token_ids]}, f)
print(f"rank {rank} done", flush=True)
