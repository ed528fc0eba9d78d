"""A user's own script under torchrun: every rank loads with ulysses_degree=2 and generates; composer joins the
process group from torchrun's environment itself. argv: folder out_dir mode (ok | fail-rank1 | bad-input-rank1)."""

import os
import sys

import torch

from composer import VideoGenerator

folder, out_dir, mode = sys.argv[1:4]
rank = int(os.environ["RANK"])
# A failing mode ends when the rank waiting for its failed peer gives up, after dist_timeout: 10 s there (the test
# asks for every rank gone within 120 s), 20 s for the run that must succeed on a busy machine.
gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, ulysses_degree=2,
                                     dist_timeout=20 if mode == "ok" else 10)
if mode == "fail-rank1" and rank == 1:  # an exception inside a stage, on one rank only
    from composer.stages.denoising import DenoisingStage

    def broken(self, batch):  # rank 0 meanwhile waits in the first step's all-to-all
        raise RuntimeError("injected failure in the denoising stage on rank 1")

    DenoisingStage.forward = broken
height = 64 if (mode == "bad-input-rank1" and rank == 1) else 48  # valid, but not what the other rank asked
result = gen.generate_video("a red ball moves left", height=height, width=80, num_frames=9, num_inference_steps=2,
                            guidance_scale=5.0, seed=7, output_path=f"{out_dir}/video.mp4")
torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames)}, f"{out_dir}/rank{rank}.pt")
print(f"rank {rank} done", flush=True)
