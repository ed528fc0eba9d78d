"""A text model under torchrun with tensor parallel: every rank loads the folder with tp_size=2 and generates the
same requests; each rank saves its ids. argv: folder out_dir."""

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
shard = gen.pipeline.modules["model"].model.transformer["blocks"][0].q_proj.weight.shape[0]
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump({"ids": results, "q_rows": shard}, f)
print(f"rank {rank} done", flush=True)
