"""Train the embedded text model tiny-dllm (demo/dllm.py) and write its folder; then score it on held-out problems.

    python scripts/train_dllm.py --out composer/demo/models/tiny-dllm          # ~20 min on 2 cores
    python scripts/train_dllm.py --minutes 0.2 --out /tmp/tiny-dllm            # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's demo/


def main() -> int:
    from demo.dllm import DllmTraining, save_folder, train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(DllmTraining):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=300, help="held-out problems scored after training")
    args = parser.parse_args()
    settings = DllmTraining(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DllmTraining)})
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = train(settings)
    folder = save_folder(model, args.out, settings)
    print(f"wrote {folder}")

    from composer.text import TextGenerator, tasks

    gen = TextGenerator.from_pretrained(folder, progress=False)
    problems = tasks.held_out_problems(args.problems)
    results = gen.generate_text([p for p, _ in problems], seed=0)
    right = sum(tasks.correct(r.text, a) for r, (_, a) in zip(results, problems))
    print(f"exact path: {right}/{len(problems)} held-out problems right ({100 * right / len(problems):.1f}%), "
          f"{results[0].stats.tokens_per_forward:.2f} tokens a forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
