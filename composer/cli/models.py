"""`composer models`: what this install can serve (families, pipelines, model classes, attention backends)."""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list registered model families, pipelines, model classes and attention backends")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from composer.demo.packaged import EMBEDDED_NAMES, embedded_model
    from composer.registry import model_entry_points, pipeline_entry_points, registered_families

    usable = [name for name in EMBEDDED_NAMES if embedded_model(name) is not None]
    print(f"Embedded models (in the package: no download, usable offline; --model-path NAME): "
          f"{', '.join(usable) or 'none (this install lacks them)'}")
    print("Model families (config registry):")
    for family in registered_families():
        sp = family.sampling_param_cls()
        defaults = ", ".join(
            f"{k}={getattr(sp, k)}"
            for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "flow_shift")
            if k in {f.name for f in dataclasses.fields(sp)}
        )
        print(f"  {family.name}")
        print(f"    hub ids:  {', '.join(family.hf_model_paths) or '-'}")
        print(f"    local:    {_where(family)}")
        print(f"    detector: {'yes' if family.model_detectors else 'no'}")
        print(f"    configs:  {family.pipeline_config_cls.__name__} / {family.sampling_param_cls.__name__}")
        print(f"    defaults: {defaults}")
    print("  (a model folder's own settings win over these defaults: its scheduler's flow shift, a causal folder's "
          "step list)")
    print("Pipelines (model_index.json _class_name -> class):")
    for name, entry in sorted(pipeline_entry_points().items()):
        print(f"  {name} -> {entry.module}.{entry.class_name}")
    print("Model classes (checkpoint _class_name -> class):")
    for name, entry in sorted(model_entry_points().items()):
        print(f"  {name} -> {entry.module}.{entry.class_name}")
    from composer.models.attention.backends import describe_backends

    print("Attention backends (--attention-backend; auto: the usable exact one with the highest priority; "
          "composer/models/attention/backends/ and plug-ins):")
    for name, what in describe_backends():
        print(f"  {name}: {what}")
    return 0


def _where(family) -> str:
    """Whether the family's model is here: embedded in the package, in the Hugging Face cache (both usable
    offline), or only downloadable (with the command to download it)."""
    from composer.demo.packaged import embedded_model
    from composer.loader.resolve import download_command

    for hub_id in family.hf_model_paths:
        if embedded_model(hub_id) is not None:
            return f"embedded: usable offline (--model-path {hub_id.removeprefix('composer/')})"
    cached = [hub_id for hub_id in family.hf_model_paths if _in_hub_cache(hub_id)]
    if cached:
        return f"in the Hugging Face cache: usable offline ({', '.join(cached)})"
    if family.hf_model_paths:
        return f"not downloaded (`{download_command(family.hf_model_paths[0])}` where there is network)"
    return "no hub id: give --model-path a local folder"


def _in_hub_cache(hub_id: str) -> bool:
    """A snapshot of `hub_id` in the local Hugging Face cache (a look at the disk, never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for name in ("model_index.json", "config.json"):
        try:
            if isinstance(try_to_load_from_cache(hub_id, name), str):
                return True
        except Exception:  # noqa: BLE001 - a malformed cache entry is as good as none
            return False
    return False
