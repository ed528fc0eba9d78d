"""Wan2.2 WanPipeline folders: the two-expert T2V A14B model (`Wan22A14BPipeline`) and TI2V-5B
(`Wan22TI2VPipeline`), and `wan22_pipeline_for`, which picks between them by a folder's model_index.json entries.

They are defined in composer/pipelines/wan.py, beside `WanPipeline`, which hands Wan2.2 folders to them and which
they refine (a module each, they imported each other); importable from here as before.
"""

from __future__ import annotations

from composer.pipelines.wan import Wan22A14BPipeline, Wan22TI2VPipeline, wan22_pipeline_for

__all__ = ["Wan22A14BPipeline", "Wan22TI2VPipeline", "wan22_pipeline_for"]
