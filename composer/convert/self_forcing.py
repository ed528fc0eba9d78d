"""Self-Forcing / CausVid checkpoint + Wan2.1 diffusers base folder -> a CausalWanPipeline folder.

A Self-Forcing checkpoint is `torch.save({"generator": sd, "critic": ..., ["generator_ema": sd]})` with keys
`model.<original Wan name>` (FSDP-wrapped runs add `_fsdp_wrapped_module.`) and no config inside: the
architecture is the base model's. The output folder holds the converted transformer (diffusers naming,
`_class_name` CausalWanTransformer3DModel), the base's text encoder, tokenizer and VAE (hard-linked when
possible, else copied), and a model_index.json carrying the causal sampling settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from composer.configs.causal_wan import CausalWanConfig
from composer.errors import CheckpointError, ModelFormatError
from composer.loader.components import read_config_file
from composer.loader.model_index import read_model_index
from composer.loader.resolve import resolve_model_path
from composer.loader.weights import apply_rules, match_names
from composer.logging import get_logger
from composer.models.wan.causal import CausalWanTransformer3DModel
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.mapping import COMPOSER_TO_DIFFUSERS, ORIGINAL_TO_COMPOSER
from composer.stages.validators import V

logger = get_logger(__name__)

_WRAPPER_PREFIXES = re.compile(r"(^|\.)(_fsdp_wrapped_module|_orig_mod|_checkpoint_wrapped_module|module)\.")
COPIED_COMPONENTS = ("text_encoder", "tokenizer", "vae")
# pipeline settings a base folder may state (e.g. its text length); they still hold for the causal model
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(CausalWanConfig))
SHARD_BYTES = 5 * 2**30


@dataclass
class CausalSettings:
    """The sampling settings written into the folder (Self-Forcing's defaults)."""

    num_frames_per_block: int = 3
    denoising_step_list: list[float] = field(default_factory=lambda: [1000, 750, 500, 250])
    warp_denoising_step: bool = True
    timestep_shift: float = 5.0
    context_noise: float = 0.0
    local_attn_size: int = -1
    sink_size: int = 0

    def check(self) -> None:
        # CausalWanConfig is the one place these are interpreted; make sure they parse.
        CausalWanConfig().updated_from_folder(asdict(self))
        for name, rule in (("timestep_shift", V.positive_number), ("context_noise", V.non_negative_number)):
            if not rule(getattr(self, name)):
                raise ModelFormatError(f"{name} = {getattr(self, name)}: expected {rule.rule}")
        if not all(V.positive_number(t) for t in self.denoising_step_list):
            raise ModelFormatError(f"denoising_step_list = {self.denoising_step_list}: expected finite timesteps > 0")
        if self.num_frames_per_block < 1:
            raise ModelFormatError(f"num_frames_per_block must be >= 1, got {self.num_frames_per_block}")
        if self.sink_size and self.local_attn_size == -1:
            raise ModelFormatError("sink_size needs a rolling window: set local_attn_size too")
        if self.local_attn_size != -1 and self.local_attn_size - self.sink_size < self.num_frames_per_block:
            raise ModelFormatError(
                f"local_attn_size - sink_size ({self.local_attn_size} - {self.sink_size}) must be >= "
                f"num_frames_per_block ({self.num_frames_per_block})"
            )


def strip_wrappers(name: str) -> str:
    """`model._fsdp_wrapped_module.blocks.0...` -> `blocks.0...`."""
    name = _WRAPPER_PREFIXES.sub(r"\1", name)
    return name[len("model."):] if name.startswith("model.") else name


def load_generator_state(checkpoint: Path, use_ema: bool) -> dict[str, torch.Tensor]:
    """The generator's (or its EMA's) weights, wrapper prefixes stripped."""
    if not checkpoint.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist")
    try:
        raw = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
        try:
            raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001
            raise CheckpointError(f"{checkpoint} is not a readable torch checkpoint: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{checkpoint} holds a {type(raw).__name__}, expected a dict with a 'generator' entry")
    key = "generator_ema" if use_ema else "generator"
    if key not in raw:
        raise CheckpointError(
            f"{checkpoint} has no '{key}' entry (it has: {', '.join(map(str, raw)) or 'nothing'})"
            + ("; drop --use-ema to take 'generator'" if use_ema else "")
        )
    state = raw[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{checkpoint}['{key}'] is not a state dict of tensors")
    return {strip_wrappers(k): v for k, v in state.items()}


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    src = src.resolve()  # Hugging Face cache files are symlinks to blobs
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _save_state(state: dict[str, torch.Tensor], folder: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(
        state, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=SHARD_BYTES
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, folder / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_self_forcing(
    checkpoint: str | Path,
    base: str | Path,
    out: str | Path,
    use_ema: bool = False,
    settings: CausalSettings | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a CausalWanPipeline folder at `out`; returns it. Everything is checked before `out` is written."""
    settings = settings or CausalSettings()
    settings.check()
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_file():  # before the base is resolved (maybe downloaded) or anything is built
        what = "is a folder" if checkpoint.is_dir() else "does not exist"
        raise CheckpointError(f"checkpoint {checkpoint} {what}: expected the generator's .pt file (--checkpoint)")
    base_folder = resolve_model_path(base)
    index = read_model_index(base_folder)
    for name in (*COPIED_COMPONENTS, "transformer"):
        index.component(name)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelFormatError(f"{out} exists and is not empty (pass --overwrite to replace it)")

    base_config = read_config_file(base_folder / "transformer" / "config.json")  # a broken one: one line naming it
    with torch.device("meta"):
        model = CausalWanTransformer3DModel(WanTransformerConfig.from_dict(base_config))
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}

    state = load_generator_state(checkpoint, use_ema)
    match = match_names(state, set(expected), {"original": ORIGINAL_TO_COMPOSER}, model.ignored_checkpoint_keys)
    problems = []
    if match.missing:
        problems.append(f"missing {len(match.missing)} tensors (e.g. {', '.join(match.missing[:5])})")
    if match.unexpected:
        problems.append(f"{len(match.unexpected)} unknown tensors (e.g. {', '.join(match.unexpected[:5])})")
    wrong = [f"{k} {list(state[k].shape)} vs {list(expected[v])}" for k, v in match.mapped.items()
             if tuple(state[k].shape) != expected[v]]
    if wrong:
        problems.append(f"{len(wrong)} tensors whose shape differs from the base model (e.g. {'; '.join(wrong[:3])})")
    if problems:
        raise CheckpointError(
            f"{checkpoint} does not fit the Wan transformer of {base_folder}: " + "; ".join(problems)
        )

    converted = {}
    for name, ours in match.mapped.items():
        tensor = state[name]
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        converted[apply_rules(ours, COMPOSER_TO_DIFFUSERS)] = tensor

    if out.exists() and overwrite:
        shutil.rmtree(out)
    (out / "transformer").mkdir(parents=True)
    _save_state(converted, out / "transformer")
    config = {**base_config, "_class_name": "CausalWanTransformer3DModel"}
    (out / "transformer" / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED_COMPONENTS:
        for src in sorted((base_folder / name).rglob("*")):
            if src.is_file():
                _link_or_copy(src, out / name / src.relative_to(base_folder / name))
    model_index = {
        "_class_name": "CausalWanPipeline",
        "_composer_source": {"checkpoint": checkpoint.name, "weights": "generator_ema" if use_ema else "generator",
                             "base": str(base)},
        **{name: [index.components[name].library, index.components[name].class_name] for name in COPIED_COMPONENTS},
        "transformer": ["composer", "CausalWanTransformer3DModel"],
        **{k: v for k, v in index.extra.items() if k in _CONFIG_FIELDS},
        **asdict(settings),
    }
    (out / "model_index.json").write_text(json.dumps(model_index, indent=2))
    logger.info("wrote %s (%d tensors, %s naming in the checkpoint)", out, len(converted), match.scheme)
    return out
