"""Writing trained demo models as model folders: the text-to-video one in exact diffusers layout (written by
diffusers' own WanPipeline.save_pretrained), the causal one through `composer convert self-forcing`.

Where the shipped folders live and what they are called is the engine's (`composer.demo.packaged`), since the
model resolver needs it at run time; this module only writes folders."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch

from composer.convert.self_forcing import CausalSettings, convert_self_forcing

__all__ = ["save_causal_folder", "save_t2v_folder", "strip_local_paths", "write_folder_settings"]


def save_t2v_folder(path: Path, tokenizer, text_encoder, vae, transformer, text_max_length: int,
                    flow_shift: float, dtype: torch.dtype = torch.float16) -> Path:
    """A WanPipeline folder; weights stored in `dtype` (fp16 keeps the package small)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift
    )
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=copy.deepcopy(text_encoder).to(dtype), vae=copy.deepcopy(vae).to(dtype),
        transformer=copy.deepcopy(transformer).to(dtype), scheduler=scheduler,
    )
    pipe.save_pretrained(str(path), safe_serialization=True)
    index_path = path / "model_index.json"
    index = json.loads(index_path.read_text())
    index["text_encoder_max_length"] = text_max_length  # composer's pipeline setting, read from the folder
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    strip_local_paths(path)
    return path


def save_causal_folder(path: Path, causal_model, base: Path, settings: CausalSettings,
                       dtype: torch.dtype = torch.float16) -> Path:
    """The causal DiT as a Self-Forcing-format checkpoint, converted against the text-to-video folder."""
    state = {f"model.{k}": v.to(dtype) for k, v in causal_model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "generator.pt"
        torch.save({"generator": state}, checkpoint)
        convert_self_forcing(checkpoint, base, path, settings=settings, overwrite=True)
    strip_local_paths(path)
    return path


def write_folder_settings(folder: Path, family: str, sampling_cls: type) -> Path:
    """composer.json: the family's name and the sampling defaults its SamplingParam class declares, so a renamed
    copy of the folder still samples as trained (docs/adding-a-model-family.md)."""
    defaults = sampling_cls()
    sampling = {name: getattr(defaults, name) for name in sampling_cls.__annotations__}
    path = folder / "composer.json"
    path.write_text(json.dumps({"family": family, "sampling": sampling}, indent=2) + "\n")
    return path


def strip_local_paths(folder: Path) -> None:
    """Drop the training machine's paths from a folder meant to ship: diffusers' `_name_or_path` in the
    component configs, and the converter's record of the base folder becomes the base's name."""
    for config in folder.glob("*/config.json"):
        data = json.loads(config.read_text())
        if data.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    source = index.get("_composer_source")
    if isinstance(source, dict) and source.get("base"):
        source["base"] = Path(source["base"]).name
        index_path.write_text(json.dumps(index, indent=2) + "\n")
