"""`composer serve`: load one model and serve the jobs API over HTTP (docs/serving.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from composer.cli.flags import add_flags, collect, dataclass_flags
from composer.errors import ConfigError
from composer.runtime import RuntimeArgs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", allow_abbrev=False, help="serve a model over HTTP (jobs API)",
        description="Serve a model over HTTP: POST /v1/videos queues a job, GET polls it, /docs shows the API. "
        "Without --model-path, serves the embedded default model.",
    )
    p.add_argument("--model-path", default=None, help="diffusers model folder, hub id or short name (default: "
                   "embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--output-dir", default="outputs/serve", help="where videos and job records are kept and "
                   "reloaded from on restart (default: outputs/serve)")
    p.add_argument("--max-queue", type=int, default=16, help="jobs that may wait; more get 429 (default: 16)")
    p.add_argument("--max-frames", type=int, default=81, help="most frames a request may ask for (default: 81)")
    p.add_argument("--max-size", type=int, default=1280, help="most pixels of height or width (default: 1280)")
    p.add_argument("--max-steps", type=int, default=100, help="most denoising steps a request may ask for "
                   "(default: 100)")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a job may run before it is "
                   "cancelled and failed; 0: no limit (default: 1800)")
    p.set_defaults(run=run, _runtime_names=add_flags(p.add_argument_group("runtime (RuntimeArgs fields)"),
                                                      dataclass_flags(RuntimeArgs)))


def lora_options(paths: list[str], scales: list[float] | None) -> list:
    """The --lora-path adapters as the names requests pick them by (file stems, which must differ)."""
    from composer.serve.requests import LoraOption

    options = [LoraOption(Path(p).stem, str(p), float(s)) for p, s in zip(paths, scales or [1.0] * len(paths))]
    names = [o.name for o in options]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--lora-path: requests pick adapters by file name (without .safetensors), and {twice[0]!r} "
                          "names two files; rename one")
    return options


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"composer serve needs the serve extra ({exc.name} is not installed): "
                          "pip install 'composer[serve]'") from None
    from composer.generator import VideoGenerator, resolve_model
    from composer.serve.app import ServeConfig, create_app
    from composer.serve.requests import ServerLimits

    for name in ("max_queue", "max_frames", "max_size", "max_steps", "port"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    if args.request_timeout < 0:
        raise ConfigError(f"--request-timeout {args.request_timeout}: expected seconds >= 0 (0: no limit)")
    runtime = collect(args, args._runtime_names)
    runtime_args = RuntimeArgs.from_kwargs(**runtime)  # bad runtime flags: one error before anything loads
    from composer.parallel import state as parallel_state

    if (runtime_args.num_gpus or 1) > 1 or parallel_state.under_launcher():
        raise ConfigError("composer serve runs on one rank for now: leave out --num-gpus (and torchrun); serving "
                          "on several ranks is a later part of issue 26")
    resolve_model(args.model_path, runtime_args.model_family)  # an unknown model: an error now, not in /health
    config = ServeConfig(
        output_dir=Path(args.output_dir), max_queue=args.max_queue,
        limits=ServerLimits(args.max_frames, args.max_size, args.max_steps),
        request_timeout=args.request_timeout or None,
        loras=lora_options(runtime_args.lora_path or [], runtime_args.lora_scale),
    )
    app = create_app(lambda: VideoGenerator.from_pretrained(args.model_path, **runtime), config)
    print(f"composer serve: http://{args.host}:{args.port} (API docs at /docs; jobs in {config.output_dir})")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
