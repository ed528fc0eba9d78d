"""`composer convert quantize`: quantize a model folder's transformer(s) once and write a folder that loads them.

The written folder is a copy of the model folder in which each denoiser (`transformer`, `transformer_2`) holds
its `config.json` and `quantized.pt` instead of safetensors: the module's whole state dict saved with
`torch.save` (torchao's tensor subclasses serialise that way and load with `torch.load(weights_only=True)`;
safetensors cannot hold them). Its `composer.json` gains a `quantization` entry:

    {"quantization": {"mode": "int8", "library": "torchao", "torchao_version": "0.18.0",
                      "file": "quantized.pt", "dtype": "fp32", "components": ["transformer"]}}

Loading such a folder turns the `quantize` hook on with that mode (another mode is a ConfigError) and reads
the quantized weights directly (no full-precision weights are read or held), giving the same outputs as
quantizing the original folder at load in the same dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from composer.accel.quantize import load_quantized  # noqa: F401  (moved to the hook that loads it; kept importable here)
from composer.errors import ConfigError, ModelFormatError
from composer.logging import get_logger

logger = get_logger(__name__)

FILE_NAME = "quantized.pt"
# what a denoiser's folder holds that the quantized copy replaces
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")


def quantize_folder(model_path: str | Path | None, out: str | Path, mode: str, dtype: str = "fp32",
                    overwrite: bool = False) -> Path:
    """Load `model_path` with `quantize = mode` on the CPU and write the quantized copy to `out`."""
    from composer.accel.quantize import _version
    from composer.generator import VideoGenerator
    from composer.loader.folder_settings import FILE_NAME as SETTINGS_FILE

    if mode == "none":
        raise ConfigError("composer convert quantize --quantize none would write an unquantized copy; use int8 "
                          "(or fp8 on a GPU with fp8 support)")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelFormatError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    device = "cuda" if mode == "fp8" else "cpu"  # fp8 weights are made on the GPU that can run them
    gen = VideoGenerator.from_pretrained(model_path, quantize=mode, dtype=dtype, device=device, progress=False)
    pipeline = gen.pipeline
    if pipeline.folder.resolve() == out.resolve():
        raise ConfigError(f"--out {out} is the model folder itself: write the quantized copy elsewhere")
    denoisers = pipeline.denoisers()
    if out.exists():
        shutil.rmtree(out)
    names = set(denoisers)

    def ignore(directory: str, entries: list[str]) -> list[str]:
        if Path(directory).resolve().parent == pipeline.folder.resolve() and Path(directory).name in names:
            return [e for e in entries if any(Path(e).match(p) for p in WEIGHT_PATTERNS)]
        return []

    shutil.copytree(pipeline.folder, out, ignore=ignore)
    for name, model in denoisers.items():
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / name / FILE_NAME)
    settings_path = out / SETTINGS_FILE
    raw: dict[str, Any] = json.loads(settings_path.read_text(encoding="utf-8")) if settings_path.is_file() else {}
    raw["quantization"] = {"mode": mode, "library": "torchao", "torchao_version": _version(), "file": FILE_NAME,
                           "dtype": dtype, "components": sorted(names)}
    settings_path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    logger.info("wrote %s: %s quantized %s", out, mode, ", ".join(sorted(names)))
    return out
