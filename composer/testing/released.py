"""The released models' transformer configs at their real sizes, built with random weights (no download).

Speed does not depend on the weights' values: a figure measured on these is the released model's speed (quality
figures on random weights say little, and docs/ quote them as such). The configs are those of the released
diffusers folders' transformer/config.json:

    wan2.1-t2v-1.3b     Wan-AI/Wan2.1-T2V-1.3B-Diffusers (also Self-Forcing / CausVid 1.3B: the same DiT;
                        `composer_twin(model, causal=True)` is the causal model, SELF_FORCING_1_3B its settings)
    wan2.1-t2v-14b      Wan-AI/Wan2.1-T2V-14B-Diffusers
    wan2.2-ti2v-5b      Wan-AI/Wan2.2-TI2V-5B-Diffusers (48 latent channels: Wan2.2's VAE)
    hunyuanvideo        hunyuanvideo-community/HunyuanVideo (diffusers' defaults are the release's)

`released_dit(name)` builds diffusers' class from the config with a fast seeded init (`seeded_init`: values of std
0.02 from one generator, norms' weights at 1), in `dtype` on `device`; `composer_twin` gives composer's model over
the very same tensors (no second copy: the 14B fits once in memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

WAN_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
RELEASED: dict[str, tuple[str, dict[str, Any]]] = {
    "wan2.1-t2v-1.3b": ("WanTransformer3DModel", dict(WAN_COMMON, num_attention_heads=12, attention_head_dim=128,
                                                      ffn_dim=8960, num_layers=30)),
    "wan2.1-t2v-14b": ("WanTransformer3DModel", dict(WAN_COMMON, num_attention_heads=40, attention_head_dim=128,
                                                     ffn_dim=13824, num_layers=40)),
    "wan2.2-ti2v-5b": ("WanTransformer3DModel", dict(WAN_COMMON, in_channels=48, out_channels=48,
                                                     num_attention_heads=24, attention_head_dim=128, ffn_dim=14336,
                                                     num_layers=30)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
        guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
        rope_axes_dim=(16, 56, 56))),
}


def released_config(name: str) -> dict[str, Any]:
    if name not in RELEASED:
        raise KeyError(f"no released config {name!r} (known: {', '.join(RELEASED)})")
    return dict(RELEASED[name][1])


@contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's fills as no-ops while a model is built: its parameters are allocated, not initialised (its
    buffers, computed in __init__, are kept); `seeded_init` fills them after."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


POOL = 4_194_301  # values drawn once per model (a prime: a large tensor's rows do not line up with its period)


@torch.no_grad()
def seeded_init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter filled from one seeded CPU generator, fast at any size: POOL values drawn uniformly in
    +-0.035 (std 0.02), each tensor a copy of that pool started at its own drawn offset and repeated (a norm's weight
    1, biases 0). The same on every machine for a seed. Drawing every value (1.4e9 for the 1.3B) would take most of
    a minute on two cores; speed and parity do not need more randomness than this."""
    generator = torch.Generator("cpu").manual_seed(seed)
    pool = torch.empty(POOL, dtype=torch.float32).uniform_(-0.035, 0.035, generator=generator)
    for name, tensor in model.named_parameters():
        if not tensor.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            tensor.fill_(1.0)
        elif leaf == "bias":
            tensor.zero_()
        elif tensor.numel():
            start = int(torch.randint(0, POOL, (1,), generator=generator))
            _fill_from_pool(tensor, pool, start)
    return model


def _fill_from_pool(tensor: torch.Tensor, pool: torch.Tensor, start: int) -> None:
    """tensor's i-th value (flattened) = pool[(start + i) % len(pool)], copied a slice at a time (no rotated copy
    of the whole pool per tensor: for the 1.3B's 825 tensors those copies were most of its init)."""
    n, size = tensor.numel(), pool.numel()
    flat = tensor.view(-1) if tensor.is_contiguous() else torch.empty(n, dtype=tensor.dtype)
    done = min(n, size - start)
    flat[:done].copy_(pool[start:start + done])
    whole = (n - done) // size  # then the whole pool from its first value, as often as it fits, and a part of it
    flat[done:done + whole * size].view(whole, size).copy_(pool.expand(whole, size))
    done += whole * size
    flat[done:].copy_(pool[:n - done])
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def released_dit(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """diffusers' transformer of a released model (`overrides`: config values to change, e.g. fewer layers for a
    quick check, stated wherever used), seeded, in eval mode."""
    import diffusers

    class_name, config = RELEASED[name]
    cls = getattr(diffusers, class_name)
    with _no_init():
        model = cls(**{**config, **overrides})
    seeded_init(model, seed)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for pname, param in model.named_parameters():
        if not keep.intersection(pname.split(".")):
            param.data = param.data.to(dtype)
    return model.to(device).eval()


# Self-Forcing 1.3B (gdhe17/Self-Forcing, the released `self_forcing_dmd.pt`): the Wan2.1-T2V-1.3B DiT, converted to
# composer's CausalWanTransformer3DModel by `composer convert self-forcing` with these settings (its defaults).
SELF_FORCING_1_3B = dict(base="wan2.1-t2v-1.3b", num_frames_per_block=3, denoising_step_list=[1000, 750, 500, 250],
                         warp_denoising_step=True, timestep_shift=5.0, local_attn_size=-1, sink_size=0)


def composer_twin(theirs: torch.nn.Module, causal: bool = False) -> torch.nn.Module:
    """composer's Wan DiT holding the very tensors of diffusers' `theirs` (no copy); `causal`: the block-causal
    CausalWanTransformer3DModel (what a Self-Forcing / CausVid checkpoint of the same DiT converts to)."""
    from composer.loader.weights import apply_rules
    from composer.models.wan.config import WanTransformerConfig
    from composer.models.wan.mapping import DIFFUSERS_TO_COMPOSER
    from composer.models.wan.transformer import WanTransformer3DModel

    config = WanTransformerConfig.from_dict(dict(theirs.config))
    if causal:
        from composer.models.wan.causal import CausalWanTransformer3DModel as cls
    else:
        cls = WanTransformer3DModel
    with torch.device("meta"):
        ours = cls(config)
    state = {apply_rules(k, DIFFUSERS_TO_COMPOSER): v for k, v in theirs.state_dict().items()}
    names = set(ours.state_dict())
    state = {k: v for k, v in state.items() if k in names}
    ours.load_state_dict(state, assign=True, strict=True)
    return ours.eval()


def write_released_transformer(name: str, folder, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                               shard_bytes: int = 2 * 2**30) -> int:
    """Write the released `name`'s transformer as a diffusers component folder (config.json, sharded safetensors
    and their index), its values as `seeded_init`'s, one tensor in memory at a time: the 14B's 28 GB folder is
    written without ever holding the model. Returns the parameter count."""
    import json
    from pathlib import Path

    import diffusers
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    class_name, config = RELEASED[name]
    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        model = cls(**config)
    if any(True for _ in model.buffers()) and any(k not in dict(model.named_parameters()) for k in model.state_dict()):
        raise NotImplementedError(f"{class_name} has persistent buffers: write it with save_pretrained instead")
    generator = torch.Generator("cpu").manual_seed(seed)
    pool = torch.empty(POOL, dtype=torch.float32).uniform_(-0.035, 0.035, generator=generator)
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or [])
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = count = 0
    for pname, param in model.named_parameters():
        leaf = pname.rsplit(".", 1)[-1]
        if "norm" in pname and leaf == "weight":
            values = torch.ones(param.shape)
        elif leaf == "bias":
            values = torch.zeros(param.shape)
        else:
            start = int(torch.randint(0, POOL, (1,), generator=generator))
            flat = torch.cat([pool[start:], pool[:start]])
            n = param.numel()
            values = (flat.repeat(-(-n // POOL))[:n] if n > POOL else flat[:n]).view(param.shape)
        target = torch.float32 if keep.intersection(pname.split(".")) else dtype
        shard[pname] = values.to(target).contiguous()
        size += shard[pname].numel() * shard[pname].element_size()
        count += param.numel()
        if size >= shard_bytes:
            shards.append(shard)
            _write_shard(folder, shards, save_file)
            shard, size = {}, 0
    if shard:
        shards.append(shard)
        _write_shard(folder, shards, save_file)
    total = len(shards)
    weight_map, files = {}, sorted(folder.glob("part-*.safetensors"))
    for i, path in enumerate(files):
        final = folder / f"diffusion_pytorch_model-{i + 1:05d}-of-{total:05d}.safetensors"
        path.rename(final)
        from composer.memory.weights import read_header

        weight_map.update({k: final.name for k in read_header(final)})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(f.stat().st_size for f in folder.glob("*.safetensors"))},
                    "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps({"_class_name": class_name, **{
        k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}, indent=1))
    return count


def _write_shard(folder, shards: list, save_file) -> None:
    """Write the newest shard (kept in memory until then) and drop its tensors."""
    index = len(shards)
    save_file(shards[-1], str(folder / f"part-{index:05d}.safetensors"))
    shards[-1] = {}
