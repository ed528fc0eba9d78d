"""`composer models`: what this install can serve (families, pipelines, model classes, attention backends)."""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list registered model families, pipelines, model classes and attention backends")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from composer.registry import model_entry_points, pipeline_entry_points, registered_families

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
