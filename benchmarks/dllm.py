"""Decoding strategies of diffusion language models on the embedded `tiny-dllm` (addition; composer/text/tasks.py).

For each strategy (`decoding=`), over --problems held-out problems run as batches of --batch prompts: **forwards /
token** (model forwards per generated token, one row's view: forwards of a batch / the mean answer length with its
EOS), **tokens/s** (generated tokens of every row / seconds), **accuracy** (answers right) and the ratios against
the exact path in the same run (**fewer fwd**: exact's forwards per token / this one's; **acc delta**: points).
Then throughput of the exact path and of the fastest strategy at batch 1, 8 and 32 prompts, and peak memory.

    python benchmarks/dllm.py                                   # 300 problems, CPU (2 cores: ~2 min)
    python benchmarks/dllm.py --threshold 0.5 --temperature 1.0     # sampled: where the strategies part ways
    python benchmarks/dllm.py --device cuda --dtype fp32 --json dllm.json
    python benchmarks/dllm.py --model-path PATH --prompt-file prompts.txt   # any LLaDA2 folder: speed only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

STRATEGIES = ["exact", "threshold", "hierarchical", "credit", "threshold+smooth", "threshold+kv",
              "credit+kv", "hierarchical+kv+smooth"]


def run(gen, prompts: list[str], answers: list[str] | None, decoding: str, batch: int, **settings) -> dict:
    from composer.text import tasks

    right = forwards = tokens = rows = 0
    seconds = 0.0
    for start in range(0, len(prompts), batch):
        part = prompts[start:start + batch]
        began = time.perf_counter()
        results = gen.generate_text(part, decoding=decoding, seed=start, **settings)
        seconds += time.perf_counter() - began
        forwards += results[0].stats.forwards * len(part)  # every row took part in each forward of its batch
        tokens += sum(len(r.token_ids) for r in results)
        rows += len(part)
        if answers is not None:
            right += sum(tasks.correct(r.text, a) for r, a in zip(results, answers[start:start + batch]))
    return {"decoding": decoding, "batch": batch, "forwards_per_token": forwards / max(tokens, 1),
            "tokens_per_second": tokens / seconds, "seconds": seconds, "tokens": tokens, "rows": rows,
            "accuracy": right / rows if answers is not None else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="tiny-dllm")
    parser.add_argument("--prompt-file", default=None, help="prompts, one a line (no scoring): for other models")
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="prompts a call in the strategy table")
    parser.add_argument("--threshold", type=float, default=0.9, help="the strategies' commit threshold")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from composer.text import TextGenerator, tasks

    gen = TextGenerator.from_pretrained(args.model_path, device=args.device, dtype=args.dtype, progress=False)
    if args.prompt_file:
        prompts = [line.strip() for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        answers = None
    else:
        problems = tasks.held_out_problems(args.problems)
        prompts, answers = [p for p, _ in problems], [a for _, a in problems]
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    gen.generate_text(prompts[:2])  # warm-up
    rows = []
    for decoding in args.strategies.split(","):
        settings = {} if decoding == "exact" else {"threshold": args.threshold}
        rows.append(run(gen, prompts, answers, decoding, args.batch, temperature=args.temperature, **settings))
    exact = rows[0]
    print(f"{'decoding':24} {'fwd/token':>9} {'fewer fwd':>9} {'tokens/s':>9} {'accuracy':>8} {'acc delta':>9}")
    for row in rows:
        acc = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f}%"
        delta = "-" if row["accuracy"] is None else f"{100 * (row['accuracy'] - exact['accuracy']):+.1f}"
        row["fewer_forwards"] = exact["forwards_per_token"] / row["forwards_per_token"]
        print(f"{row['decoding']:24} {row['forwards_per_token']:9.3f} {row['fewer_forwards']:8.2f}x "
              f"{row['tokens_per_second']:9.1f} {acc:>8} {delta:>9}")
    fastest = min(rows[1:], key=lambda r: r["forwards_per_token"]) if len(rows) > 1 else exact
    print(f"\nthroughput (tokens/s), {min(len(prompts), 96)} prompts:")
    throughput = []
    for decoding in dict.fromkeys(["exact", fastest["decoding"]]):
        settings = {} if decoding == "exact" else {"threshold": args.threshold}
        line = []
        for batch in (1, 8, 32):
            r = run(gen, prompts[:min(len(prompts), 96)], None, decoding, batch, temperature=args.temperature,
                    **settings)
            throughput.append(r)
            line.append(f"batch {batch}: {r['tokens_per_second']:.1f}")
        print(f"  {decoding:24} " + "  ".join(line))
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
    if peak is not None:
        print(f"peak GPU memory {peak:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"strategies": rows, "throughput": throughput, "peak_gib": peak,
                                               "device": args.device, "model": args.model_path}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
