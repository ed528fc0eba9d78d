"""Whole pipelines under every parallel layout equal one process: the same latents (<= 1e-5, fp32) and the same
uint8 frames (<= 1) for one request (seed, non-square size whose tokens per frame divide by no degree, CFG),
text-to-video and causal, with LoRA and compile, on 2 and 4 gloo ranks through
`VideoGenerator.from_pretrained(..., <degrees>)`. Every rank returns the whole video; only rank 0 writes the file.

Each layout runs once (one set of processes) for all of its jobs; the tests below check one job each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from composer.testing import build_tiny_wan
from composer.testing.distributed import spawn

# 48 x 80 pixels -> 6 x 10 latents -> 3 x 5 = 15 tokens a frame: divides by neither 2 nor 4
REQUEST = dict(prompt="a red ball moves left", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=3, guidance_scale=5.0, seed=1234)
CAUSAL_REQUEST = dict(prompt="a red ball moves left", height=48, width=80, num_frames=13, seed=99,
                      guidance_scale=3.0, negative_prompt="blurry")

# layout -> (runtime degrees, jobs). Jobs: "t2v", "causal" (with guidance: under CFG parallel each half keeps
# its own branch's KV cache), "lora" (T2V with an unfused LoRA), "compile" (T2V, regional compile).
LAYOUTS = {
    "ulysses2": (dict(ulysses_degree=2), ("t2v", "causal", "lora")),
    "ring2": (dict(ring_degree=2), ("t2v", "causal", "lora")),
    "cfg2": (dict(cfg_parallel=True), ("t2v", "causal")),
    "tp2": (dict(tp_size=2), ("t2v", "causal", "lora")),
    "usp2x2": (dict(ulysses_degree=2, ring_degree=2), ("t2v", "causal", "v2v")),
    "tp2-ulysses2": (dict(tp_size=2, ulysses_degree=2), ("t2v", "causal")),
    "cfg2-ring2": (dict(cfg_parallel=True, ring_degree=2), ("t2v",)),
    "ulysses2-compile": (dict(ulysses_degree=2), ("compile",)),
}
SLOW = {"cfg2-ring2", "usp2x2", "tp2-ulysses2", "ulysses2-compile",  # 4 ranks, or compiling
        "ring2", "tp2", "ulysses2"}  # the quick tier keeps cfg2 (<= 5 minutes on 2 cores); every family's
# own test file keeps a ulysses2 case in the full tier


def _world(runtime: dict) -> int:
    return (runtime.get("ulysses_degree", 1) * runtime.get("ring_degree", 1) * runtime.get("tp_size", 1)
            * (2 if runtime.get("cfg_parallel") else 1))


def _cases(job: str):
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
            for name, (_, jobs) in LAYOUTS.items() if job in jobs]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 4-head tiny Wan (Ulysses 4, or TP 2 x Ulysses 2; an FFN that splits 4 ways), its causal conversion, and
    a LoRA for it."""
    from helpers import write_self_forcing_checkpoint
    from test_lora import lora_weights, write_lora

    from composer import VideoGenerator
    from composer.convert.self_forcing import CausalSettings, convert_self_forcing

    wan = build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-4h", num_heads=4, head_dim=16, seed=3)
    root = tmp_path_factory.mktemp("tiny-causal-4h")
    write_self_forcing_checkpoint(wan, root / "sf.pt")
    causal = convert_self_forcing(root / "sf.pt", wan, root / "causal",
                                  settings=CausalSettings(num_frames_per_block=2, local_attn_size=5, sink_size=1))
    model = VideoGenerator.from_pretrained(wan, dtype="fp32", progress=False).pipeline.modules["transformer"]
    lora = write_lora(tmp_path_factory.mktemp("lora") / "style.safetensors", "diffusers", lora_weights(model, 5))
    return {"wan": str(wan), "causal": str(causal), "lora": str(lora)}


def _job(folders: dict, job: str) -> tuple[str, dict, dict]:
    """(folder, request, runtime extras) of a job."""
    if job == "causal":
        return folders["causal"], CAUSAL_REQUEST, {}
    if job == "v2v":  # video-to-video: the request's video encoded and noised to strength's first step
        from test_wan_v2v import frames

        return folders["wan"], {**REQUEST, "video": frames(), "strength": 0.6}, {}
    extra = {"lora": {"lora_path": [folders["lora"]]}, "compile": {"compile": "regional"}}.get(job, {})
    return folders["wan"], REQUEST, extra


def _generate(folder, request: dict, out: str | None = None, **runtime):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
    return gen.generate_video(**request, **({"output_path": out} if out else {}))


def _worker(rank, world, folders, runtime, jobs, out_dir):
    for job in jobs:
        folder, request, extra = _job(folders, job)
        result = _generate(folder, request, f"{out_dir}/{job}.mp4", **runtime, **extra)
        torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames),
                    "path": str(result.output_path) if result.output_path else None}, f"{out_dir}/{job}-rank{rank}.pt")


_REFERENCE: dict[str, object] = {}
_RUNS: dict[str, dict[str, list[dict]]] = {}  # layout -> job -> every rank's output


def _reference(folders: dict, job: str):
    """One process's video for a job (the same LoRA; compile's reference is eager)."""
    key = "t2v" if job == "compile" else job
    if key not in _REFERENCE:
        folder, request, extra = _job(folders, key)
        _REFERENCE[key] = _generate(folder, request, **extra)
    return _REFERENCE[key]


def _run_layout(name: str, folders: dict, tmp_path_factory) -> dict[str, list[dict]]:
    """Every job of layout `name`, on its ranks, once per test session."""
    if name not in _RUNS:
        runtime, jobs = LAYOUTS[name]
        out = tmp_path_factory.mktemp(name)
        spawn(_worker, _world(runtime), folders, runtime, jobs, str(out), timeout_s=300)
        _RUNS[name] = {job: [torch.load(out / f"{job}-rank{r}.pt") for r in range(_world(runtime))] for job in jobs}
        for job in jobs:
            assert (out / f"{job}.mp4").is_file()
    return _RUNS[name]


def _check(name: str, job: str, folders: dict, tmp_path_factory) -> None:
    expected = _reference(folders, job)
    ranks = _run_layout(name, folders, tmp_path_factory)[job]
    for rank, got in enumerate(ranks):  # every rank holds the whole video
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        diff = np.abs(got["frames"].numpy().astype(int) - expected.frames.astype(int)).max()
        assert diff <= 1, f"rank {rank}: frames differ by {diff}"
    assert ranks[0]["path"] is not None and all(r["path"] is None for r in ranks[1:]), "rank 0 alone writes"


@pytest.mark.parametrize("name", _cases("t2v"))
def test_text_to_video_layout_equals_one_process(name, folders, tmp_path_factory, one_thread):
    _check(name, "t2v", folders, tmp_path_factory)


@pytest.mark.parametrize("name", _cases("causal"))
def test_causal_layout_equals_one_process(name, folders, tmp_path_factory, one_thread):
    _check(name, "causal", folders, tmp_path_factory)


@pytest.mark.parametrize("name", _cases("lora"))
def test_unfused_lora_under_a_layout_equals_one_process(name, folders, tmp_path_factory, one_thread):
    _check(name, "lora", folders, tmp_path_factory)


@pytest.mark.parametrize("name", _cases("v2v"))
def test_video_to_video_under_a_layout_equals_one_process(name, folders, tmp_path_factory, one_thread):
    _check(name, "v2v", folders, tmp_path_factory)


@pytest.mark.parametrize("name", _cases("compile"))
def test_regional_compile_under_sequence_parallel_equals_eager_one_process(name, folders, tmp_path_factory,
                                                                           one_thread):
    _check(name, "compile", folders, tmp_path_factory)


@pytest.mark.slow
def test_every_layout_gives_the_same_video(folders, tmp_path_factory, one_thread):
    """One request under every layout that runs text-to-video (reusing the runs above, running the rest),
    compared pairwise and with one process."""
    one = _reference(folders, "t2v")
    videos = {"one process": {"latents": one.latents, "frames": torch.from_numpy(one.frames)}}
    for name, (_, jobs) in LAYOUTS.items():
        if "t2v" in jobs:
            videos[name] = _run_layout(name, folders, tmp_path_factory)["t2v"][0]
    names = list(videos)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            torch.testing.assert_close(videos[a]["latents"], videos[b]["latents"], atol=2e-5, rtol=0,
                                       msg=lambda m, a=a, b=b: f"{a} vs {b}: {m}")
            diff = (videos[a]["frames"].int() - videos[b]["frames"].int()).abs().max().item()
            assert diff <= 1, f"{a} vs {b}: frames differ by {diff}"
    assert len(names) == 1 + sum("t2v" in jobs for _, jobs in LAYOUTS.values())


# -- tiled VAE decodes split over the sequence-parallel ranks --------------------------------------------------
TILE = 4  # latent pixels: the 6 x 10 latent frame is 6 tiles, shared by the ranks


def _tiled_worker(rank, world, folder, out_dir):
    """Two requests at once on every rank (threads), each decoded in exact tiles split over the two ranks: rank 0
    plans every decode, so the ranks' all-reduces meet whatever order their threads run in."""
    import threading

    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, ulysses_degree=2, vae_tile_size=TILE)
    results, errors = {}, []

    def run(seed):
        try:
            results[seed] = gen.generate_video(**{**REQUEST, "seed": seed})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    split = gen.pipeline.stage("DecodingStage").split_group is not None
    torch.save({"split": split, **{seed: torch.from_numpy(r.frames) for seed, r in results.items()}},
               f"{out_dir}/tiled-rank{rank}.pt")


@pytest.mark.slow
def test_tiled_decodes_split_over_the_ranks_equal_one_process(folders, tmp_path_factory, one_thread):
    """ulysses 2 with vae_tile_size: each rank decodes its share of the tiles (one all-reduce); two concurrent
    requests' videos equal one process's tiled decode of each, on both ranks."""
    from composer import VideoGenerator

    out = tmp_path_factory.mktemp("tiled")
    spawn(_tiled_worker, 2, folders["wan"], str(out), timeout_s=300)
    one = VideoGenerator.from_pretrained(folders["wan"], dtype="fp32", progress=False, vae_tile_size=TILE)
    for rank in range(2):
        got = torch.load(out / f"tiled-rank{rank}.pt")
        assert got["split"], f"rank {rank} did not split its decodes"
        for seed in (1, 2):
            expected = one.generate_video(**{**REQUEST, "seed": seed}).frames
            diff = np.abs(got[seed].numpy().astype(int) - expected.astype(int)).max()
            assert diff <= 1, f"rank {rank}, seed {seed}: frames differ by {diff}"
