"""`composer serve` on one rank of a launch (argv: serve's flags), with a test-only failure on rank 1: a prompt
starting "boom-rank1" fails there in latent preparation, before the first denoising step; rank 0 meanwhile
goes on to that step's sync point."""

import os
import sys

from composer.cli.main import main

if int(os.environ.get("RANK", "0")) == 1:
    from composer.stages.latents import LatentPreparationStage

    original = LatentPreparationStage.forward

    def forward(self, batch):
        if batch.prompt and str(batch.prompt[0]).startswith("boom-rank1"):
            raise RuntimeError("injected failure on rank 1")
        return original(self, batch)

    LatentPreparationStage.forward = forward

sys.exit(main(["serve", *sys.argv[1:]]))
