"""LoRA adapters (composer/accel/lora.py): frames equal diffusers' `load_lora_weights` for every naming, fused ==
unfused, unset gives the base model back bit for bit, stacking, switching, causal and bf16 models, and errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff
from safetensors.torch import save_file
from torch import nn

from composer import VideoGenerator
from composer.accel.lora import LoraAdapters, read_lora
from composer.errors import CheckpointError, InvalidInputError, ModelNotFoundError, UnsupportedError

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ALPHA = 4, 6.0  # alpha != rank: the alpha / rank scaling is exercised
REQUEST = dict(negative_prompt="blurry", guidance_scale=4.0, height=32, width=32, num_frames=5,
               num_inference_steps=3)
# the checks that need no diffusers reference run on a smaller request
SMALL = dict(negative_prompt="blurry", guidance_scale=4.0, height=16, width=16, num_frames=1, num_inference_steps=2)
PROMPT, SEED = "a red ball bouncing", 3

# composer layer (in block i) -> its name in each naming, written out here independently of composer's tables
LAYERS = {
    "attn1.to_q": ("attn1.to_q", "self_attn.q", "self_attn_q"),
    "attn1.to_k": ("attn1.to_k", "self_attn.k", "self_attn_k"),
    "attn1.to_v": ("attn1.to_v", "self_attn.v", "self_attn_v"),
    "attn1.to_out": ("attn1.to_out.0", "self_attn.o", "self_attn_o"),
    "attn2.to_q": ("attn2.to_q", "cross_attn.q", "cross_attn_q"),
    "attn2.to_k": ("attn2.to_k", "cross_attn.k", "cross_attn_k"),
    "attn2.to_v": ("attn2.to_v", "cross_attn.v", "cross_attn_v"),
    "attn2.to_out": ("attn2.to_out.0", "cross_attn.o", "cross_attn_o"),
    "ffn.fc_in": ("ffn.net.0.proj", "ffn.0", "ffn_0"),
    "ffn.fc_out": ("ffn.net.2", "ffn.2", "ffn_2"),
}
NAMINGS = ("diffusers", "original", "original-down-up", "kohya", "original-diff_b", "diffusers-patterns")
ODD_LAYER = "blocks.1.ffn.fc_in"  # "diffusers-patterns": rank 2 and alpha 1 here, via the metadata's patterns


def lora_weights(model: nn.Module, seed: int, with_bias: bool = False) -> dict[str, tuple]:
    """composer layer name -> (A [r, in], B [out, r], bias delta or None), random, large enough to show."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(len(model.blocks)):
        for layer in LAYERS:
            linear = model.get_submodule(f"blocks.{i}.{layer}")
            a = torch.randn(RANK, linear.in_features, generator=g) * 0.15
            b = torch.randn(linear.out_features, RANK, generator=g) * 0.15
            bias = torch.randn(linear.out_features, generator=g) * 0.1 if with_bias else None
            out[f"blocks.{i}.{layer}"] = (a, b, bias)
    return out


def write_lora(path, naming: str, weights: dict, alpha: float = ALPHA):
    """The same adapter in one of the published namings; returns the file's path."""
    metadata = {"r": RANK, "lora_alpha": alpha}
    if naming == "diffusers-patterns":
        a, b, _ = weights[ODD_LAYER]
        weights = {**weights, ODD_LAYER: (a[:2].clone(), b[:, :2].clone(), None)}
        metadata |= {"rank_pattern": {"blocks.1.ffn.net.0.proj": 2}, "alpha_pattern": {"blocks.1.ffn.net.0.proj": 1.0}}
        naming = "diffusers"
    from diffusers import WanPipeline

    tensors = {}
    for name, (a, b, bias) in weights.items():
        block, layer = name.split(".", 2)[1], name.split(".", 2)[2]
        diffusers_name, original_name, kohya_name = LAYERS[layer]
        if naming == "diffusers":
            tensors[f"blocks.{block}.{diffusers_name}.lora_A.weight"] = a
            tensors[f"blocks.{block}.{diffusers_name}.lora_B.weight"] = b
        elif naming == "kohya":
            stem = f"lora_unet_blocks_{block}_{kohya_name}"
            tensors |= {f"{stem}.lora_down.weight": a, f"{stem}.lora_up.weight": b, f"{stem}.alpha": torch.tensor(alpha)}
        else:
            stem = f"diffusion_model.blocks.{block}.{original_name}"
            down, up = ("lora_down", "lora_up") if naming == "original-down-up" else ("lora_A", "lora_B")
            tensors |= {f"{stem}.{down}.weight": a, f"{stem}.{up}.weight": b, f"{stem}.alpha": torch.tensor(alpha)}
            if bias is not None:
                tensors[f"{stem}.diff_b"] = bias
    if naming == "diffusers":  # written by diffusers itself: alpha in the header metadata
        targets = sorted({LAYERS[n.split(".", 2)[2]][0] for n in weights})
        WanPipeline.save_lora_weights(str(path), transformer_lora_layers=tensors, weight_name="lora.safetensors",
                                      transformer_lora_adapter_metadata={**metadata, "target_modules": targets})
        return path / "lora.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def gen(tiny_wan_dir):
    return VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def transformer(gen):
    return gen.pipeline.modules["transformer"]


@pytest.fixture
def adapters(transformer):
    adapters = LoraAdapters(transformer)
    yield adapters
    adapters.unset()


@pytest.fixture(scope="module")
def files(transformer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    weights = lora_weights(transformer, seed=1)
    written = {}
    for naming in NAMINGS:
        target = folder / naming if naming.startswith("diffusers") else folder / f"{naming}.safetensors"
        w = lora_weights(transformer, seed=1, with_bias=True) if naming == "original-diff_b" else weights
        written[naming] = write_lora(target, naming, w)
    written["second"] = write_lora(folder / "second.safetensors", "original", lora_weights(transformer, seed=2), 3.0)
    return written


@pytest.fixture(scope="module")
def ref_pipe(tiny_wan_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(tiny_wan_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def base(gen):
    return gen.generate_video(PROMPT, seed=SEED, **REQUEST)


@pytest.fixture(scope="module")
def small_base(gen):
    return gen.generate_video(PROMPT, seed=SEED, **SMALL).latents


def small(gen):
    return gen.generate_video(PROMPT, seed=SEED, **SMALL).latents


def reference_frames(pipe, paths, scales):
    names = [f"a{i}" for i in range(len(paths))]
    try:
        for name, path in zip(names, paths):
            pipe.load_lora_weights(str(path), adapter_name=name)
        pipe.set_adapters(names, scales)
        return diffusers_frames(pipe, PROMPT, SEED, **REQUEST)
    finally:
        pipe.unload_lora_weights()


def plain_state(model: nn.Module):
    """What must be the base model's again after unset: module types, parameter names and flags, no PEFT attrs."""
    return ([(n, type(m)) for n, m in model.named_modules()],
            {n: p.requires_grad for n, p in model.named_parameters()}, hasattr(model, "peft_config"))


@pytest.mark.parametrize("naming", NAMINGS)
def test_frames_match_diffusers(naming, gen, adapters, files, ref_pipe, base):
    adapters.set([files[naming]], [0.8])
    ours = gen.generate_video(PROMPT, seed=SEED, **REQUEST).frames
    assert max_uint8_diff(ours, base.frames) > 10, "the LoRA must visibly change the video"
    assert max_uint8_diff(ours, reference_frames(ref_pipe, [files[naming]], [0.8])) <= 1


def test_the_namings_read_alike(transformer, files):
    a, b = read_lora(files["diffusers"], transformer), read_lora(files["kohya"], transformer)
    assert (a.naming, b.naming) == ("diffusers", "kohya")
    assert a.modules.keys() == b.modules.keys() and len(a.modules) == 10 * len(transformer.blocks)
    for name, module in a.modules.items():
        assert module.alpha == b.modules[name].alpha == ALPHA and module.rank == RANK
        assert torch.equal(module.down, b.modules[name].down) and torch.equal(module.up, b.modules[name].up)
    patterns = read_lora(files["diffusers-patterns"], transformer).modules
    assert (patterns[ODD_LAYER].rank, patterns[ODD_LAYER].alpha) == (2, 1.0)
    assert (patterns["blocks.0.ffn.fc_in"].rank, patterns["blocks.0.ffn.fc_in"].alpha) == (RANK, ALPHA)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # diffusers' second load_lora_weights
def test_stacked_adapters_match_diffusers(gen, adapters, files, ref_pipe):
    paths, scales = [files["original"], files["second"]], [0.7, -0.5]
    adapters.set(paths, scales)
    assert "x0.7" in adapters.describe() and "x-0.5" in adapters.describe()
    ours = gen.generate_video(PROMPT, seed=SEED, **REQUEST).frames
    assert max_uint8_diff(ours, reference_frames(ref_pipe, paths, scales)) <= 1


def test_fused_equals_unfused_and_unset_restores_the_base_bit_for_bit(gen, transformer, adapters, files, small_base):
    before = plain_state(transformer)
    weights = {n: p.data_ptr() for n, p in transformer.named_parameters()}
    paths, scales = [files["kohya"], files["second"]], [0.9, 0.4]
    adapters.set(paths, scales)
    assert not isinstance(transformer.blocks[0].attn1.to_q, nn.Linear)
    unfused = small(gen)
    adapters.set(paths, scales, fuse=True)
    assert plain_state(transformer) == before, "fused: plain nn.Linear layers, nothing of PEFT left"
    assert "fused" in adapters.describe() and adapters.fused
    fused = small(gen)
    assert (fused - unfused).abs().max() <= 1e-5
    assert (fused - small_base).abs().max() > 1e-2
    adapters.unset()
    assert plain_state(transformer) == before
    assert {n: p.data_ptr() for n, p in transformer.named_parameters()} == weights, "same tensors, nothing reloaded"
    assert torch.equal(small(gen), small_base)
    adapters.set(paths, scales)
    adapters.unset()
    assert plain_state(transformer) == before
    assert torch.equal(small(gen), small_base)
    assert adapters.describe() == "LoRA: none"


def test_switching_adapters(gen, adapters, files):
    adapters.set([files["original"]])
    first = small(gen)
    adapters.set([files["second"]], [0.5])
    assert "second.safetensors" in adapters.describe() and "original.safetensors" not in adapters.describe()
    second = small(gen)
    adapters.set([files["original"]], fuse=True)
    adapters.set([files["original"]])
    assert torch.equal(small(gen), first)
    adapters.unset()
    adapters.set([files["second"]], [0.5])
    assert torch.equal(small(gen), second)


def test_a_bias_delta_alone_is_applied_at_the_adapters_scale(transformer, adapters, tmp_path):
    delta = torch.randn(transformer.proj_out.out_features)
    path = tmp_path / "bias.safetensors"
    save_file({"diffusion_model.head.head.diff_b": delta,
               "diffusion_model.blocks.0.norm3.diff": torch.zeros(transformer.config.hidden_size)}, str(path))
    x = torch.randn(3, transformer.proj_out.in_features)
    before = transformer.proj_out(x)
    adapters.set([path], [0.5])
    assert "1 zero .diff keys ignored" in adapters.describe()
    torch.testing.assert_close(transformer.proj_out(x), before + 0.5 * delta)


def test_a_peft_save_pretrained_folder_matches_peft(transformer, adapters, tmp_path):
    """PEFT's own files (composer names under base_model.model., alpha in adapter_config.json): the same outputs
    as the PeftModel that saved them."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=10, target_modules=["to_q", "fc_in"], rank_pattern={"fc_in": 2},
                        alpha_pattern={"fc_in": 3}, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(transformer), config)
    peft_model.save_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 2, 4, 4, generator=g), torch.tensor([300.0]),
              torch.randn(1, 6, transformer.config.text_dim, generator=g))
    with torch.no_grad():
        expected = peft_model(*inputs)
        adapters.set([tmp_path])
        assert "peft naming, rank 2-4, alpha 3-10" in adapters.describe()
        torch.testing.assert_close(transformer(*inputs), expected, rtol=0, atol=1e-5)


def _load(cls, folder, dtype):
    from composer.loader.weights import load_weights
    from composer.models.wan.config import WanTransformerConfig

    config = WanTransformerConfig.from_dict(json.loads((folder / "transformer" / "config.json").read_text()))
    model = cls(config)
    load_weights(model, folder / "transformer", torch.device("cpu"), dtype)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_model_with_a_lora(tiny_wan_dir, files, dtype):
    """Transformer level: forward_masked with the adapter differs, fused == unfused, unset is exact; in bf16 the
    adapters are bf16 too."""
    from composer.models.wan.causal import CausalWanTransformer3DModel

    model = _load(CausalWanTransformer3DModel, tiny_wan_dir, dtype)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 4, 4, 4, generator=g).to(dtype)
    timestep = torch.full((1, 4), 500.0)
    text = torch.randn(1, 8, model.config.text_dim, generator=g).to(dtype)

    def run():  # the cross-attention k/v come through adapted layers: recompute them after every change
        with torch.no_grad():
            return model.forward_masked(latents, timestep, model.cross_attention_kv(text), [(0, 2), (2, 4)]).float()

    base = run()
    adapters = LoraAdapters(model)
    adapters.set([files["original"], files["second"]], [1.0, 0.5])
    assert model.blocks[1].ffn.fc_out.lora_A["lora1"].weight.dtype == dtype
    unfused = run()
    adapters.set([files["original"], files["second"]], [1.0, 0.5], fuse=True)
    assert type(model.blocks[1].ffn.fc_out) is nn.Linear and model.blocks[1].ffn.fc_out.weight.dtype == dtype
    fused = run()
    assert (unfused - base).abs().max() > 1e-2
    tolerance = 1e-5 if dtype == torch.float32 else 0.1 * (unfused - base).abs().max()
    assert (fused - unfused).abs().max() <= tolerance
    adapters.unset()
    assert torch.equal(run(), base)


def _write(tmp_path, tensors, name="bad.safetensors"):
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp_path / name))
    return tmp_path / name


def test_errors(transformer, adapters, files, tmp_path):
    a, b = torch.randn(RANK, 64), torch.randn(64, RANK)
    stem = "diffusion_model.blocks.0.self_attn.q"
    cases = [
        ({"transformer.blocks.7.attn1.to_q.lora_A.weight": a, "transformer.blocks.7.attn1.to_q.lora_B.weight": b,
          "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": a},
         CheckpointError, ["2 LoRA module(s) match no layer", "blocks.7.attn1.to_q", "text_encoder.encoder"]),
        ({f"{stem}.lora_A.weight": a}, CheckpointError, [f"{stem}.lora_A.weight has no matching up"]),
        ({f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": torch.randn(64, 3)}, CheckpointError,
         ["expected [r, 64] and [64, r] with the same r"]),
        ({f"{stem}.lora_A.weight": torch.randn(RANK, 32), f"{stem}.lora_B.weight": b}, CheckpointError,
         ["is [4, 32]"]),
        ({f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b, f"{stem}.diff": torch.ones(64, 64)},
         UnsupportedError, [f"{stem}.diff", "full weight deltas"]),
        ({f"{stem}.hada_w1_a": a}, UnsupportedError, [f"{stem}.hada_w1_a", "LyCORIS"]),
        ({f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b, f"{stem}.dora_scale": torch.ones(64, 1)},
         UnsupportedError, ["DoRA"]),
        ({"diffusion_model.patch_embedding.lora_down.weight": a, "diffusion_model.patch_embedding.lora_up.weight": b},
         UnsupportedError, ["patch_embedding (Conv3d)"]),
        ({f"{stem}.diff": torch.zeros(64, 64)}, CheckpointError, ["only all-zero .diff tensors"]),
    ]
    for tensors, error, words in cases:
        with pytest.raises(error) as info:
            read_lora(_write(tmp_path, tensors), transformer)
        for word in words:
            assert word in str(info.value), (word, str(info.value))

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        adapters.set([tmp_path / "nowhere.safetensors"])
    torch.save({f"{stem}.lora_A.weight": a}, tmp_path / "lora.pt")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        adapters.set([tmp_path / "lora.pt"])
    with pytest.raises(InvalidInputError, match="give one scale per file"):
        adapters.set([files["original"]], [1.0, 2.0])
    # a file failing its checks leaves the active adapters as they were
    adapters.set([files["original"]])
    with pytest.raises(CheckpointError):
        adapters.set([files["second"], _write(tmp_path, {f"{stem}.lora_A.weight": a})])
    assert "original.safetensors" in adapters.describe()


@pytest.mark.parametrize("flags, words", [
    (["--lora-path", "missing.safetensors"], ["lora_path = 'missing.safetensors'", "no such file"]),
    (["--lora-path", "{file}", "--lora-scale", "nan"], ["lora_scale[0] = nan", "|scale| <= 100"]),
    (["--lora-path", "{file}", "--lora-scale", "1e6"], ["lora_scale[0] = 1000000.0", "|scale| <= 100"]),
    (["--lora-path", "{file}", "--lora-scale", "inf"], ["lora_scale[0] = inf", "a finite number"]),
])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_lora_options_are_refused_before_anything_loads(verb, flags, words, files, tiny_wan_dir, cli, monkeypatch,
                                                        tmp_path):
    """README: runtime options are checked before anything loads. The scale rule is the server's (finite,
    |scale| <= 100), for the CLI, composer serve and the Python API alike."""
    from composer import VideoGenerator
    from composer.errors import ConfigError
    from composer.pipelines.base import ComposedPipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for options the up-front check should have refused")

    monkeypatch.chdir(tmp_path)
    flags = [str(files["original"]) if f == "{file}" else f for f in flags]
    monkeypatch.setattr(ComposedPipeline, "__init__", refuse)
    code, _, err = cli(verb, "--model-path", tiny_wan_dir, *flags, *(["--prompt", "x"] if verb == "generate" else []))
    assert code == 1 and err.startswith("composer: error:") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    kwargs = {"lora_path": flags[1], **({"lora_scale": [float(flags[3])]} if len(flags) > 2 else {})}
    with pytest.raises(ConfigError, match=words[0].replace("[", r"\[").replace("|", r"\|")):
        VideoGenerator.from_pretrained(tiny_wan_dir, **kwargs)


def test_set_lora_and_a_request_follow_the_same_scale_rule(gen, files):
    from composer.serve.requests import LoraOption, RequestProblem, select_lora

    for scale in (1e6, float("nan"), -101):
        with pytest.raises(InvalidInputError, match=r"\|scale\| <= 100"):
            gen.set_lora([files["original"]], [scale])
        with pytest.raises(RequestProblem, match=r"\|scale\| <= 100"):
            select_lora({"lora_scale": scale}, [LoraOption("original", str(files["original"]))])
    assert select_lora({"lora_scale": -100}, [LoraOption("original", str(files["original"]))]) == [["original", -100.0]]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_lora_weights_are_refused_when_the_adapter_loads(transformer, adapters, files, tmp_path, fuse, bad):
    """Unfused, a NaN lora_B once gave an all-black video silently (only fusing checked); now both modes refuse
    the file as it is read, naming it and the tensor, and the active adapters stay as they were."""
    stem = "diffusion_model.blocks.0.self_attn.q"
    b = torch.randn(64, RANK)
    b[3, 1] = bad
    path = _write(tmp_path, {f"{stem}.lora_A.weight": torch.randn(RANK, 64), f"{stem}.lora_B.weight": b})
    adapters.set([files["original"]])
    with pytest.raises(CheckpointError, match=f"{path}: {stem}.lora_B.weight holds {'NaN' if bad != bad else 'inf'} "
                                              r"\(1 of 256 values\)"):
        adapters.set([path], fuse=fuse)
    assert "original.safetensors" in adapters.describe()


def test_cli_refuses_a_nan_lora_in_one_line(cli, tiny_wan_dir, transformer, tmp_path):
    stem = "diffusion_model.blocks.0.self_attn.q"
    path = _write(tmp_path, {f"{stem}.lora_A.weight": torch.randn(RANK, 64),
                             f"{stem}.lora_B.weight": torch.full((64, RANK), float("nan"))}, "nan.safetensors")
    code, _, err = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--height", "32", "--width", "32",
                       "--num-frames", "5", "--steps", "1", "--no-progress", "--lora-path", path,
                       "--output", tmp_path / "out.mp4")
    assert code == 1 and "Traceback" not in err
    assert f"nan.safetensors: {stem}.lora_B.weight holds NaN" in err
    assert not (tmp_path / "out.mp4").exists()
