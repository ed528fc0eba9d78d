"""Benchmark the parallel layouts (Ulysses, ring, USP, tensor parallel, CFG parallel) against one process: time per
denoising step, bytes moved per transformer layer per step by each kind of collective (measured, next to the
analytic formula), peak memory per rank and, for tensor parallel, the transformer's parameter bytes per rank.

Every layout runs in fresh processes (its ranks launched by this script, or by torchrun with `--launcher
torchrun`) on one random mid-size tiny Wan: load through `VideoGenerator.from_pretrained(..., <degrees>)`, one
video of `--steps` steps (the first `--warmup` of them not timed). The ranks count the bytes of every
torch.distributed call made during each step by wrapping the calls in this benchmark's processes (the library
is not touched: all_to_all_single, all_gather_into_tensor / all_gather_single, all_reduce, batch_isend_irecv, and
as "other", expected to stay 0, broadcast, send, all_gather, reduce_scatter_tensor), tagged "layer" inside a
transformer block and "outside" elsewhere (the token gather after proj_out, the CFG exchange). Bytes are what
one rank sends: all-to-all (P-1)/P of its input, all-gather P-1 times its input, all-reduce 2(P-1)/P of the
tensor (the ring algorithm), point-to-point the tensor sent.

**On CPU these figures show overhead, not GPU speedup.** Gloo ranks (one thread each by default) share the
machine's few cores, so a wall-time ratio says how the layouts share this CPU, not what GPUs would gain; the CPU
time of a step summed over the ranks, against one process's, is the work each layout adds. The figures that carry
over to GPUs are the bytes (what a GPU run moves in the same dtype) and the memory per rank. On GPUs (`--device
cuda`, NCCL, one GPU per rank) the time ratios are the point.

    python benchmarks/parallel.py                         # every layout at 2 and 4 ranks, CPU fp32 (~5 min on 2 cores)
    python benchmarks/parallel.py --quick                 # smaller model, the 2-rank layouts (~1-1.5 min)
    python benchmarks/parallel.py --device cuda --launcher torchrun --only ulysses4,ring4,usp2x2
    python benchmarks/parallel.py --analytic wan2.1-14b   # the formulas for Wan2.1-14B, 720p, 8 GPUs (no run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PRESETS = {
    # 2 layers of width 512 (8 heads x 64, ffn 1024); 9 frames of 304x336 -> 3 latent frames of 19 x 21 = 399
    # tokens (1197 tokens; 399 divides by neither 2 nor 4, so the frame-wise split pads and the formulas must too)
    "default": dict(model=dict(num_layers=2, num_heads=8, head_dim=64, ffn_dim=1024, text_dim=64, text_heads=4,
                               text_ff=128),
                    video=dict(num_frames=9, height=304, width=336), steps=4, warmup=1),
    # 2 layers of width 128 (4 heads x 32); 9 frames of 112x144 -> 3 latent frames of 7 x 9 = 63 tokens
    "quick": dict(model=dict(num_layers=2, num_heads=4, head_dim=32, ffn_dim=256, text_dim=32, text_heads=2,
                             text_ff=64),
                  video=dict(num_frames=9, height=112, width=144), steps=3, warmup=1),
}
LAYOUTS = {  # name -> degrees; "one-process" is the reference every ratio is taken against
    "one-process": dict(),
    "ulysses2": dict(ulysses=2),
    "ring2": dict(ring=2),
    "tp2": dict(tp=2),
    "cfg2": dict(cfg=2),
    "ulysses4": dict(ulysses=4),
    "ring4": dict(ring=4),
    "tp4": dict(tp=4),
    "usp2x2": dict(ulysses=2, ring=2),
    "tp2-ulysses2": dict(tp=2, ulysses=2),
    "cfg2-ulysses2": dict(cfg=2, ulysses=2),
}
QUICK_LAYOUTS = ["one-process", "ulysses2", "ring2", "tp2", "cfg2"]
KINDS = ("all_to_all", "p2p", "all_reduce", "all_gather", "other")
PROMPT, NEGATIVE, SEED, GUIDANCE = "a red circle moving left", "blurry", 0, 5.0


# -- the analytic model ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Degrees:
    """One layout's degrees (their product is the number of ranks)."""

    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    cfg: int = 1

    @property
    def world(self) -> int:
        return self.ulysses * self.ring * self.tp * self.cfg

    def runtime(self) -> dict:
        """VideoGenerator.from_pretrained keywords."""
        return dict(ulysses_degree=self.ulysses, ring_degree=self.ring, tp_size=self.tp, cfg_parallel=self.cfg > 1)


@dataclass(frozen=True)
class Workload:
    """What the formulas need: the transformer's sizes and one request's token grid."""

    layers: int
    heads: int
    hidden: int  # heads x head_dim
    ffn: int
    out_per_token: int  # out_channels x patch volume (what proj_out gives a token)
    frames: int  # latent frames
    tokens_per_frame: int
    latent_elements: int  # C x F x h x w of one prediction
    branches: int  # guidance branches (2 with CFG)
    elem_bytes: int  # bytes per element of the activations (2: bf16, 4: fp32)

    @property
    def tokens(self) -> int:
        return self.frames * self.tokens_per_frame


def unsupported(d: Degrees, w: Workload) -> str | None:
    """Why the model cannot run this layout (None: it can)."""
    if w.heads % d.tp or w.ffn % d.tp:
        return f"tp {d.tp} does not divide the {w.heads} heads and the ffn's {w.ffn}"
    if (w.heads // d.tp) % d.ulysses:
        return f"ulysses {d.ulysses} does not divide the {w.heads // d.tp} heads per TP rank"
    if d.cfg > 1 and w.branches < 2:
        return "CFG parallel needs guidance"
    return None


def expected_bytes(d: Degrees, w: Workload) -> dict[str, dict[str, float]]:
    """Bytes one rank sends per denoising step: {"layer": per transformer layer, "outside": once a step}, by kind.

    b = rows per transformer call (both guidance branches in one batch, one under CFG parallel), sp = U x R,
    part = ceil(tokens_per_frame / sp), n = frames x part (tokens a rank holds), D_t = hidden / tp, e = bytes.
      Ulysses  all-to-all: q, k, v in and the output back:  4 b n D_t e (U-1)/U
      ring     p2p: K and V of n U tokens x D_t / U features, R-1 times:  2 (R-1) b n D_t e
      TP       all-reduce: attn1.to_out, attn2.to_out, ffn.fc_out ([b, n, D]) and the q/k RMSNorm sums of squares
               (3 x [b, n] fp32):  2 (T-1)/T (3 b n D e + 3 b n 4)
      outside  all-gather of proj_out's output over sp:  (sp-1) b n out_per_token e;
               CFG parallel: all-gather of one branch's prediction:  latent_elements e
    """
    u, r, t = d.ulysses, d.ring, d.tp
    b = w.branches // d.cfg
    sp = u * r
    part = -(-w.tokens_per_frame // sp)
    n = w.frames * part
    dt = w.hidden // t
    e = w.elem_bytes
    layer = dict.fromkeys(KINDS, 0.0)
    outside = dict.fromkeys(KINDS, 0.0)
    if u > 1:
        layer["all_to_all"] = 4 * b * n * dt * e * (u - 1) / u
    if r > 1:
        layer["p2p"] = 2 * (r - 1) * b * n * dt * e
    if t > 1:
        layer["all_reduce"] = 2 * (t - 1) / t * (3 * b * n * w.hidden * e + 3 * b * n * 4)
    if sp > 1:
        outside["all_gather"] += (sp - 1) * b * n * w.out_per_token * e
    if d.cfg > 1:
        outside["all_gather"] += w.latent_elements * e
    return {"layer": layer, "outside": outside}


WAN14B_720P = Workload(layers=40, heads=40, hidden=5120, ffn=13824, out_per_token=16 * 4, frames=21,
                       tokens_per_frame=45 * 80, latent_elements=16 * 21 * 90 * 160, branches=2, elem_bytes=2)
WAN14B_LAYOUTS = {
    "ulysses8": Degrees(ulysses=8),
    "ring8": Degrees(ring=8),
    "usp u2 x r4": Degrees(ulysses=2, ring=4),
    "usp u4 x r2": Degrees(ulysses=4, ring=2),
    "tp8": Degrees(tp=8),
    "tp2 x ulysses4": Degrees(tp=2, ulysses=4),
    "cfg2 x ulysses4": Degrees(cfg=2, ulysses=4),
    "cfg2 x ring4": Degrees(cfg=2, ring=4),
}


def print_analytic(w: Workload, layouts: dict[str, Degrees]) -> None:
    mb = 1e6
    print(f"Wan2.1-14B at 720p, 81 frames: {w.frames} latent frames x {w.tokens_per_frame} tokens = {w.tokens} "
          f"tokens, hidden {w.hidden}, {w.layers} layers, {w.elem_bytes * 8}-bit activations, CFG "
          f"(b = 2 rows a call, 1 under CFG parallel). MB (1e6 bytes) sent per GPU:")
    print(f"{'layout':<17} {'a2a/layer':>10} {'p2p/layer':>10} {'allred/layer':>13} {'layer total':>12} "
          f"{'outside/step':>13} {'per step':>10}")
    for name, d in layouts.items():
        why = unsupported(d, w)
        if why:
            print(f"{name:<17} skipped: {why}")
            continue
        x = expected_bytes(d, w)
        layer = sum(x["layer"].values())
        outside = sum(x["outside"].values())
        print(f"{name:<17} {x['layer']['all_to_all'] / mb:>10.1f} {x['layer']['p2p'] / mb:>10.1f} "
              f"{x['layer']['all_reduce'] / mb:>13.1f} {layer / mb:>12.1f} {outside / mb:>13.1f} "
              f"{(layer * w.layers + outside) / mb:>10.0f}")


# -- counting bytes in a rank -------------------------------------------------------------------------------------
class CollectiveCounter:
    """Wraps torch.distributed's collectives in this process and adds up the bytes this rank sends while
    `active`, by scope ("layer" inside a transformer block, "outside" elsewhere) and kind."""

    def __init__(self):
        self.active = False
        self.scope = "outside"
        self.sent: dict[str, dict[str, float]] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self._depth = 0  # a collective implemented through another one is counted once
        self.reset()

    def reset(self) -> None:
        self.sent = {s: dict.fromkeys(KINDS, 0.0) for s in ("layer", "outside")}
        self.calls = {s: dict.fromkeys(KINDS, 0) for s in ("layer", "outside")}

    def _add(self, kind: str, nbytes: float) -> None:
        if self.active:
            self.sent[self.scope][kind] += nbytes
            self.calls[self.scope][kind] += 1

    def install(self) -> None:
        import torch.distributed as dist

        def size(group) -> int:
            return dist.get_world_size(group)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            p, me = size(group), dist.get_rank(group)
            rows = input.shape[0] if input.dim() else 1
            row_bytes = input.numel() * input.element_size() / max(rows, 1)
            splits = input_split_sizes or [rows // p] * p
            return sum(s for i, s in enumerate(splits) if i != me) * row_bytes

        def all_gather(output, input, group=None, **kw):
            return input.numel() * input.element_size() * (size(group) - 1)

        def all_reduce(tensor, op=None, group=None, **kw):
            p = size(group)
            return tensor.numel() * tensor.element_size() * 2 * (p - 1) / p

        def batch_isend_irecv(ops):
            return sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend)

        def nbytes(tensor) -> int:
            return tensor.numel() * tensor.element_size()

        # calls composer does not make inside a step: counted as "other", which the formulas expect to be 0
        others = {"broadcast": lambda tensor, *a, group=None, **kw: nbytes(tensor),
                  "send": lambda tensor, *a, **kw: nbytes(tensor),
                  "all_gather": lambda tensors, tensor, group=None, **kw: nbytes(tensor) * (size(group) - 1),
                  "reduce_scatter_tensor": lambda output, input, *a, group=None, **kw:
                      nbytes(input) * (size(group) - 1) / size(group)}
        measures = {"all_to_all_single": ("all_to_all", all_to_all_single),
                    "all_gather_into_tensor": ("all_gather", all_gather),
                    "all_gather_single": ("all_gather", all_gather),
                    "all_reduce": ("all_reduce", all_reduce),
                    "batch_isend_irecv": ("p2p", batch_isend_irecv),
                    **{name: ("other", measure) for name, measure in others.items()}}
        for name, (kind, measure) in measures.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, measure))

    def _wrap(self, original, kind, measure):
        def wrapped(*args, **kwargs):
            if self._depth == 0:
                self._add(kind, measure(*args, **kwargs))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapped.__wrapped__ = original
        return wrapped


def run_rank(args: argparse.Namespace) -> None:
    """One rank of one layout (or the one process): load, one video, per-step times and bytes; rank 0 writes the
    result file."""
    import torch

    counter = CollectiveCounter()
    counter.install()  # before composer runs any collective
    import torch.distributed as dist

    from composer import VideoGenerator
    from composer.engine.engine import EngineHook

    torch.set_num_threads(args.threads)
    degrees = Degrees(**LAYOUTS[args.rank_run])
    preset = PRESETS[args.preset]
    cuda = args.device.startswith("cuda")
    start = time.perf_counter()
    gen = VideoGenerator.from_pretrained(args.model, device=args.device, dtype=args.dtype, progress=False,
                                         **(degrees.runtime() if degrees.world > 1 else {}))
    load_s = time.perf_counter() - start
    transformer = gen.pipeline.modules["transformer"]
    steps: list[dict] = []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class StepProbe(EngineHook):
        def before_step(self, info):
            sync()
            counter.reset()
            counter.active = True
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def after_step(self, info):
            sync()
            seconds, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
            counter.active = False
            steps.append({"seconds": seconds, "cpu_seconds": cpu, "sent": counter.sent, "calls": counter.calls})

    for engine in gen.pipeline.engines:
        engine.add_hook(StepProbe())
    for block in transformer.blocks:
        block.register_forward_pre_hook(lambda *_: setattr(counter, "scope", "layer"))
        block.register_forward_hook(lambda *_: setattr(counter, "scope", "outside"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = gen.generate_video(PROMPT, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE, seed=SEED,
                                num_inference_steps=args.steps, **preset["video"])
    params = transformer.parameters()
    mine = {
        "load_s": load_s,
        "step_s": [s["seconds"] for s in steps[args.warmup:]],
        "step_cpu_s": [s["cpu_seconds"] for s in steps[args.warmup:]],
        "steps": steps,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        # the activations' dtype (a block's weight: never one of the modules kept in fp32)
        "elem_bytes": transformer.blocks[0].attn1.to_q.weight.element_size(),
        "device": str(next(transformer.parameters()).device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result.latents, args.latents)
        Path(args.result).write_text(json.dumps({"layout": args.rank_run, "threads": args.threads,
                                                 "ranks": ranks}) + "\n")


# -- the parent ---------------------------------------------------------------------------------------------------
def launch(name: str, args: argparse.Namespace, model: Path, tmp: Path, threads: int, retried: bool = False) -> dict:
    """Run layout `name` on its ranks; its result (rank 0's file) or {"error": ...}."""
    from composer.testing.distributed import free_port

    world = Degrees(**LAYOUTS[name]).world
    result, latents = tmp / f"{name}.json", tmp / f"{name}.pt"
    rank_args = [__file__, "--rank-run", name, "--model", str(model), "--preset", args.preset, "--device",
                 args.device, "--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--threads", str(threads), "--result", str(result), "--latents", str(latents)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads)}
    if world > 1 and args.launcher == "torchrun":
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                     *rank_args]]
        envs = [env]
    else:
        port = free_port()
        commands = [[sys.executable, *rank_args]] * world
        envs = [env if world == 1 else {**env, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(port)} for r in range(world)]
    logs = [tmp / f"{name}.{i}.log" for i in range(len(commands))]
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.DEVNULL, stderr=log.open("w"))
             for c, e, log in zip(commands, envs, logs)]
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):  # one failed: the others get a short grace period
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.2)
    for p in procs:  # a failed or stuck rank ends its layout's other ranks
        if p.poll() is None:
            p.kill()
            p.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode]
    tails = {i: logs[i].read_text()[-1500:] for i in bad}
    if not result.exists():
        if any("EADDRINUSE" in t for t in tails.values()) and not retried:  # port taken before rank 0 listened
            return launch(name, args, model, tmp, threads, retried=True)
        return {"error": "; ".join(f"rank {i} exited {procs[i].returncode}: {tails[i]}" for i in bad)
                or "no result written"}
    out = json.loads(result.read_text())
    if bad:  # every rank measured and rank 0 wrote the result; some rank failed on the way out
        out["exit_errors"] = {str(i): f"exited {procs[i].returncode}: {tails[i][-300:]}" for i in bad}
        print(f"  {name}: measured, but {out['exit_errors']}", file=sys.stderr, flush=True)
    out["latents_path"] = str(latents)
    return out


def workload(model: Path, preset: dict, elem_bytes: int) -> Workload:
    """The benchmark model's sizes and the request's token grid (the tiny VAE: 4x in time, 8x in space)."""
    config = json.loads((model / "transformer" / "config.json").read_text())
    video = preset["video"]
    pt, ph, pw = config["patch_size"]
    frames = ((video["num_frames"] - 1) // 4 + 1)
    h, w = video["height"] // 8, video["width"] // 8
    channels = config["out_channels"]
    return Workload(layers=config["num_layers"], heads=config["num_attention_heads"],
                    hidden=config["num_attention_heads"] * config["attention_head_dim"], ffn=config["ffn_dim"],
                    out_per_token=channels * pt * ph * pw, frames=frames // pt, tokens_per_frame=(h // ph) * (w // pw),
                    latent_elements=channels * frames * h * w, branches=2, elem_bytes=elem_bytes)


def summarise(name: str, raw: dict, w: Workload, reference: dict | None) -> dict:
    """One table row from a layout's per-rank results."""
    import torch

    d = Degrees(**LAYOUTS[name])
    ranks = raw["ranks"]
    step_s = max(statistics.median(r["step_s"]) for r in ranks)  # the slowest rank sets the pace
    last = [r["steps"][-1] for r in ranks]
    measured = {scope: {k: max(s["sent"][scope][k] for s in last) for k in KINDS} for scope in ("layer", "outside")}
    calls = {scope: {k: max(s["calls"][scope][k] for s in last) for k in KINDS} for scope in ("layer", "outside")}
    measured["layer"] = {k: v / w.layers for k, v in measured["layer"].items()}
    calls["layer"] = {k: v / w.layers for k, v in calls["layer"].items()}
    steady = all(r["steps"][i]["sent"] == r["steps"][-1]["sent"] for r in ranks
                 for i in range(raw.get("warmup", 0), len(r["steps"])))
    expected = expected_bytes(d, w)
    cpu_s = sum(statistics.median(r["step_cpu_s"]) for r in ranks)  # the work of a step, over every rank
    row = {"layout": name, "ranks": d.world, "threads_per_rank": raw["threads"], "step_s": step_s, "cpu_s": cpu_s,
           "step_s_per_rank": [statistics.median(r["step_s"]) for r in ranks],
           "bytes_measured": measured, "bytes_expected": expected, "calls_per_step": calls,
           "bytes_equal_every_step": steady,
           "formula_matches": all(math.isclose(measured[s][k], expected[s][k], rel_tol=1e-9, abs_tol=0.5)
                                  for s in measured for k in KINDS),
           "peak_rss_mib": [r["peak_rss_mib"] for r in ranks], "cuda_peak_mib": [r["cuda_peak_mib"] for r in ranks],
           "param_bytes_per_rank": ranks[0]["param_bytes"], "load_s": max(r["load_s"] for r in ranks),
           "device": ranks[0]["device"], "backend": ranks[0]["backend"]}
    if reference is not None:
        row["vs_one_process"] = step_s / reference["step_s"]
        row["cpu_vs_one_process"] = cpu_s / reference["cpu_s"]
        row["param_fraction"] = row["param_bytes_per_rank"] / reference["param_bytes_per_rank"]
        got, want = torch.load(raw["latents_path"]), torch.load(reference["latents_path"])
        row["max_abs_diff"] = (got - want).abs().max().item()
    row["latents_path"] = raw["latents_path"]
    if raw.get("exit_errors"):
        row["exit_errors"] = raw["exit_errors"]
    return row


def print_table(rows: dict, skipped: dict, failed: dict, w: Workload, args: argparse.Namespace) -> None:
    kib = 1024
    print(f"\nmodel: {w.layers} layers, {w.heads} heads x {w.hidden // w.heads} (hidden {w.hidden}), ffn {w.ffn}; "
          f"video {w.frames} latent frames x {w.tokens_per_frame} tokens = {w.tokens} tokens, CFG {GUIDANCE} "
          f"(2 rows a call, 1 under CFG parallel); {args.dtype} on {args.device}; median of {args.steps - args.warmup} "
          f"steps after {args.warmup} warmup")
    if args.device == "cpu":
        print(f"CPU gloo ranks share this machine's {os.cpu_count()} cores: the times show overhead, not GPU "
              "speedup; the bytes are what a GPU run in the same dtype moves")
    print(f"{'layout':<14} {'ranks':>5} {'thr':>3} {'step':>8} {'vs 1':>6} {'CPU s/step':>10} {'vs 1':>6} "
          f"{'RSS MiB/rank':>13} {'params/rank':>17} {'max |diff|':>10}")
    for name, r in rows.items():
        rss = f"{max(r['peak_rss_mib']):.0f}"
        params = f"{r['param_bytes_per_rank'] / 2**20:.1f} MiB" + (
            f" {r['param_fraction']:.2f}x" if r.get("param_fraction", 1) != 1 else "")
        print(f"{name:<14} {r['ranks']:>5} {r['threads_per_rank']:>3} {r['step_s'] * 1e3:>6.0f}ms "
              f"{r.get('vs_one_process', 1):>5.2f}x {r['cpu_s']:>10.2f} {r.get('cpu_vs_one_process', 1):>5.2f}x "
              f"{rss:>13} {params:>17} {r.get('max_abs_diff', 0):>10.1e}")
    print("\nKiB sent per rank per transformer layer per step (measured | formula), and outside the layers per step")
    print(f"{'layout':<14} {'all-to-all':>19} {'p2p (ring)':>19} {'all-reduce':>19} {'layer total':>19} "
          f"{'outside (gather)':>19}  match")
    for name, r in rows.items():
        m, x = r["bytes_measured"], r["bytes_expected"]

        def pair(mv: float, xv: float) -> str:
            return f"{mv / kib:>9.1f} | {xv / kib:<7.1f}"

        layer_m, layer_x = sum(m["layer"].values()), sum(x["layer"].values())
        out_m, out_x = sum(m["outside"].values()), sum(x["outside"].values())
        kinds = " ".join(pair(m["layer"][k], x["layer"][k]) for k in ("all_to_all", "p2p", "all_reduce"))
        print(f"{name:<14} {kinds} {pair(layer_m, layer_x)} {pair(out_m, out_x)}  "
              f"{'yes' if r['formula_matches'] else 'NO'}")
    for name, why in skipped.items():
        print(f"{name:<14} skipped: {why}")
    for name, why in failed.items():
        print(f"{name:<14} failed: {why}")
    print("(bytes one rank sends: all-to-all (P-1)/P of its input, all-gather (P-1) x its input, all-reduce "
          "2(P-1)/P x the tensor, p2p the tensor; 'step': the slowest rank's median wall time; 'CPU s/step': the "
          "process CPU time of a step summed over the ranks (the work, whatever the cores; its ratio is the "
          "overhead); RSS: the largest rank's peak; max |diff|: final latents vs one process)")


def parent(args: argparse.Namespace) -> None:
    from composer.testing import build_tiny_wan

    preset = PRESETS[args.preset]
    names = args.only.split(",") if args.only else (QUICK_LAYOUTS if args.quick else list(LAYOUTS))
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    names = ["one-process", *[n for n in names if n != "one-process"]]
    rows, skipped, failed = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="parallel-bench-") as tmp:
        tmp = Path(tmp)
        model = build_tiny_wan(tmp / "model", **preset["model"])
        w = None
        for name in names:
            d = Degrees(**LAYOUTS[name])
            probe = w or workload(model, preset, 4)
            why = unsupported(d, probe)
            if why:
                skipped[name] = why
                continue
            # one thread per process by default: on a shared 2-core machine a 2-thread process waits on its
            # descheduled twin (tests/conftest.py's one_thread), which made one process look slower than 2 ranks
            threads = args.threads or 1
            t0 = time.perf_counter()
            raw = launch(name, args, model, tmp, threads)
            if "error" in raw:
                failed[name] = raw["error"]
                print(f"  {name}: failed\n{raw['error']}", file=sys.stderr, flush=True)
                continue
            raw["warmup"] = args.warmup
            if w is None:
                w = workload(model, preset, raw["ranks"][0]["elem_bytes"])
            rows[name] = summarise(name, raw, w, rows.get("one-process"))
            print(f"  ran {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if w is None:
        raise SystemExit("the one-process reference failed: " + failed.get("one-process", "?"))
    print_table(rows, skipped, failed, w, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "workload": asdict(w), "rows": rows,
                                               "skipped": skipped, "failed": failed,
                                               "load": os.getloadavg()}, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small preset and the 2-rank layouts (a smoke run)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model and video (default: default)")
    p.add_argument("--only", default=None, help=f"comma-separated layouts (of {', '.join(LAYOUTS)})")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, cuda:LOCAL_RANK per rank)")
    p.add_argument("--dtype", default="auto", help="transformer precision (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps of the one video, warmup included")
    p.add_argument("--warmup", type=int, default=None, help="first steps not timed")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    p.add_argument("--launcher", choices=("spawn", "torchrun"), default="spawn",
                   help="start the ranks as processes of this script, or through torchrun --standalone")
    p.add_argument("--timeout", type=float, default=600, help="seconds one layout may take")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--analytic", choices=("wan2.1-14b",), default=None,
                   help="print the formulas' bytes for a released model on 8 GPUs and exit")
    for hidden in ("--rank-run", "--model", "--result", "--latents"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.analytic:
        print_analytic(WAN14B_720P, WAN14B_LAYOUTS)
        return
    args.preset = args.preset or ("quick" if args.quick else "default")
    preset = PRESETS[args.preset]
    args.steps = args.steps or preset["steps"]
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    if args.rank_run:
        run_rank(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
