"""`composer serve`: load a model (or a video model and a text model) and serve its API over HTTP
(docs/serving.md)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import signal
import socket
import threading
from pathlib import Path

from composer.cli.flags import add_flags, collect, dataclass_flags
from composer.errors import ConfigError
from composer.runtime import RuntimeArgs

FOLLOWER_STOP_S = 60.0  # how long a rank other than 0, signalled, waits for rank 0 to stop it before it exits


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", allow_abbrev=False, help="serve a model over HTTP (jobs API)",
        description="Serve a model over HTTP: POST /v1/videos queues a job, GET polls it, /docs shows the API. "
        "Without --model-path, serves the embedded default model.",
    )
    p.add_argument("--model-path", default=None, help="diffusers model folder, hub id or short name (default: "
                   "embedded model)")
    p.add_argument("--text-model-path", default=None, metavar="TEXT_MODEL", help="also serve this diffusion "
                   "language model (folder, hub id or short name, e.g. tiny-dllm) beside the video model of "
                   "--model-path, in one server: /v1/videos, /v1/streams and /v1/sessions go to the video model, "
                   "/v1/completions and /v1/chat/completions to this one; the runtime flags are the video model's, "
                   "the text model takes device, dtype and threads from them (docs/serving.md, \"One server, two "
                   "models\")")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port, 1 to 65535 (default: 8000)")
    p.add_argument("--output-dir", default="outputs/serve", help="where videos and job records are kept and "
                   "reloaded from on restart (default: outputs/serve)")
    p.add_argument("--max-queue", type=int, default=16, help="jobs (a text model: requests) that may wait; more get "
                   "429 (default: 16)")
    p.add_argument("--max-upload-mb", type=float, default=64.0, help="most megabytes (MiB) of one uploaded image or "
                   "video (default: 64); bodies may be a third larger, for base64")
    p.add_argument("--max-upload-frames", type=int, default=241, help="most frames of an uploaded video "
                   "(default: 241)")
    p.add_argument("--max-frames", type=int, default=81, help="most frames a request may ask for (default: 81)")
    p.add_argument("--max-size", type=int, default=1280, help="most pixels of height or width (default: 1280)")
    p.add_argument("--max-steps", type=int, default=100, help="most denoising steps a request may ask for "
                   "(default: 100)")
    p.add_argument("--max-concurrent", type=int, default=None, help="jobs (and live streams) that run at once, "
                   "their denoising steps batched (default: 4, or 1 when the model's requests run serially: a step "
                   "cache, parallel layouts, model offload; always 1 on several ranks); a text model: requests that "
                   "run at once, their forwards shared (default: 4), the others wait by priority")
    p.add_argument("--max-sessions", type=int, default=16, help="causal models: sessions (/v1/sessions) open at "
                   "once")
    p.add_argument("--session-ttl", type=float, default=600.0, help="causal models: seconds an idle session stays "
                   "open (snapshot it to keep it longer)")
    p.add_argument("--replica", default=None, help="this replica's name behind a proxy (1 to 16 lowercase letters "
                   "or digits): job and session ids begin with it, so the proxy sends each job's requests to the "
                   "replica that holds it (docs/deploy.md)")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a job (or a text request) may "
                   "run before it is cancelled and failed; 0: no limit (default: 1800)")
    p.add_argument("--rtmp-allow", action="append", default=None, metavar="PREFIX", help="causal models: a live "
                   "stream may push to an RTMP URL under this prefix (its `rtmp_url` field), e.g. "
                   "rtmp://127.0.0.1:1935/live (repeatable; compared by scheme, host, port and path). Without it, "
                   "streams push nowhere")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY", help="require this key as "
                   "`Authorization: Bearer KEY` on every request but /health (repeatable; named key1, key2, ... in "
                   "logs and metrics; COMPOSER_API_KEY adds one more, named env, out of `ps`'s sight)")
    p.add_argument("--api-keys", default=None, metavar="FILE", help="a file of API keys, one per line: KEY NAME "
                   "[queued=N] [streams=N] [sessions=N] [rpm=N] (docs/serving.md, \"API keys\")")
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
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"composer serve needs the serve extra ({exc.name} is not installed): "
                          "pip install 'composer[serve]'") from None
    from composer.generator import VideoGenerator, check_model_configs, resolve_model

    for name in ("max_queue", "max_frames", "max_size", "max_steps", "max_concurrent", "max_sessions"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected a port number in [1, 65535]")
    if not math.isfinite(args.max_upload_mb) or not 0 < args.max_upload_mb <= 4096:
        raise ConfigError(f"--max-upload-mb {args.max_upload_mb}: expected a number of MiB in (0, 4096]")
    if args.max_upload_frames < 1:
        raise ConfigError(f"--max-upload-frames {args.max_upload_frames}: expected an integer >= 1")
    if args.replica is not None:
        from composer.serve.jobs import check_replica

        try:
            check_replica(args.replica)
        except ConfigError as exc:
            raise ConfigError(f"--replica: {exc}") from None
    if args.rtmp_allow:
        from composer.rtmp import check_rtmp_prefix

        for prefix in args.rtmp_allow:
            check_rtmp_prefix(prefix)
    if not math.isfinite(args.session_ttl) or args.session_ttl <= 0:
        raise ConfigError(f"--session-ttl {args.session_ttl}: expected a number of seconds > 0")
    if not math.isfinite(args.request_timeout) or args.request_timeout < 0:  # NaN passed `< 0` and became the timeout
        raise ConfigError(f"--request-timeout {args.request_timeout}: expected a finite number of seconds >= 0 "
                          "(0: no limit)")
    from composer.serve.keys import key_ring

    # a bad key or key file: one error before anything binds or loads (the message never shows a key)
    args._api_keys = key_ring(args.api_key or (), args.api_keys, os.environ.get("COMPOSER_API_KEY"))
    runtime = collect(args, args._runtime_names)
    runtime_args = RuntimeArgs.from_kwargs(**runtime)  # bad runtime flags: one error before anything loads
    from composer.parallel import state as parallel_state

    under_torchrun = parallel_state.under_launcher()
    if (runtime_args.num_gpus or 1) > 1 and not under_torchrun:
        n = runtime_args.num_gpus
        raise ConfigError(f"--num-gpus {n}: composer serve runs its ranks under torchrun: `torchrun "
                          f"--nproc-per-node {n} -m composer serve ... --ulysses-degree {n}` (the parallel degrees as "
                          "flags, without --num-gpus; docs/serving.md)")
    load = functools.partial(VideoGenerator.from_pretrained, args.model_path, **runtime)
    if under_torchrun and int(os.environ.get("RANK", "0")) != 0:
        check_model_configs(resolve_model(args.model_path, runtime_args.model_family))
        return _follow(load, runtime_args.dist_timeout, _call_slots(args))
    # Rank 0 takes the port first: a port in use is an error before anything else is read or loaded, and no other
    # process can take it while the model loads (uvicorn is handed this socket).
    listening = bind_port(args.host, args.port)
    try:
        # an unknown model, or a config value of the wrong type: an error now, not in /health
        resolved = resolve_model(args.model_path, runtime_args.model_family)
        check_model_configs(resolved)
        if args.text_model_path is not None:
            return _serve_two(args, load, resolved, runtime, runtime_args, listening, under_torchrun)
        if getattr(resolved.pipeline_cls, "modality", "video") == "text":
            if under_torchrun:
                raise ConfigError("serving a diffusion language model on several ranks is not supported yet: "
                                  "launch `composer serve` without torchrun")
            from composer.text import TextGenerator

            load = functools.partial(TextGenerator.from_pretrained, args.model_path, **runtime)
            return _serve(args, load, runtime_args, listening, False, modality="text")
        return _serve(args, load, runtime_args, listening, under_torchrun)
    finally:
        listening.close()


TEXT_RUNTIME = ("device", "dtype", "threads", "progress", "trust_remote_code", "verify_values")  # beside a video model


def _serve_two(args: argparse.Namespace, load, resolved, runtime: dict, runtime_args: RuntimeArgs,
               listening: socket.socket, under_torchrun: bool) -> int:
    """--text-model-path: the video model of --model-path and a text model in one server, each model checked
    before anything loads (a text model named as the video one, or the other way round, is a ConfigError)."""
    from composer.generator import check_model_configs, resolve_model

    if under_torchrun:
        raise ConfigError("--text-model-path: serving a diffusion language model on several ranks is not supported "
                          "yet: launch `composer serve` without torchrun")
    if getattr(resolved.pipeline_cls, "modality", "video") == "text":
        raise ConfigError(f"--model-path {args.model_path}: a text model; with --text-model-path, --model-path names "
                          "the video model (or leave it out: the embedded one)")
    text_runtime = {k: v for k, v in runtime.items() if k in TEXT_RUNTIME}
    text_resolved = resolve_model(args.text_model_path, None)
    if getattr(text_resolved.pipeline_cls, "modality", "video") != "text":
        raise ConfigError(f"--text-model-path {args.text_model_path}: a video model "
                          f"({text_resolved.index.class_name}); it names a diffusion language model (e.g. tiny-dllm)")
    check_model_configs(text_resolved)
    from composer.text import TextGenerator

    text_load = functools.partial(TextGenerator.from_pretrained, args.text_model_path, **text_runtime)
    return _serve(args, load, runtime_args, listening, False, text_load=text_load)


def _serve(args: argparse.Namespace, load, runtime_args: RuntimeArgs, listening: socket.socket,
           under_torchrun: bool, modality: str = "video", text_load=None) -> int:
    """One app (composer/serve/app.py) with the routes of the model's modality: video jobs (and streams and
    sessions of a causal model), or a text model's completions and chat completions (composer/serve/text.py)."""
    import uvicorn

    from composer.serve.app import ServeConfig, create_app
    from composer.serve.requests import ServerLimits
    from composer.serve.uploads import UploadLimits

    config = ServeConfig(
        output_dir=Path(args.output_dir), max_queue=args.max_queue,
        limits=ServerLimits(args.max_frames, args.max_size, args.max_steps),
        request_timeout=args.request_timeout or None,
        loras=lora_options(runtime_args.lora_path or [], runtime_args.lora_scale) if modality == "video" else [],
        max_concurrent=args.max_concurrent, max_sessions=args.max_sessions, session_ttl=args.session_ttl,
        replica=args.replica, keys=args._api_keys,
        rtmp_allow=list(args.rtmp_allow or []),
        uploads=UploadLimits(max_bytes=int(args.max_upload_mb * 2**20), max_video_frames=args.max_upload_frames),
        max_body_bytes=int(args.max_upload_mb * 2**20 * 4 / 3) + 2**20,  # base64 in JSON, and the other fields
    )
    leader = _Leader(load, runtime_args.dist_timeout, _call_slots(args)) if under_torchrun else None
    app = create_app(leader.load if leader else load, config, modality, text_load=text_load)
    if leader is not None:
        leader.stop_after(app)
        # uvicorn raises a caught SIGINT/SIGTERM again once it has shut down; rank 0 has stopped every rank by
        # then and leaves with 0, as they do
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    ranks = f" on {os.environ['WORLD_SIZE']} ranks" if leader else ""
    if text_load is not None:
        _check_websockets()
        print(f"composer serve: http://{args.host}:{args.port} (a video model: the web page at /, /v1/videos; a text "
              f"model: /v1/completions, /v1/chat/completions; API docs at /docs; jobs in {config.output_dir})")
    elif modality == "text":
        print(f"composer serve: http://{args.host}:{args.port} (a text model: /v1/completions, /v1/chat/completions; "
              "API docs at /docs)")
    else:
        _check_websockets()
        print(f"composer serve: http://{args.host}:{args.port}{ranks} (the web page at /, API docs at /docs; jobs in "
              f"{config.output_dir})")
    _say_who_may_use_it(args)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")).run(sockets=[listening])
    return 0


def _say_who_may_use_it(args: argparse.Namespace) -> None:
    """One line at start: the API keys' names, or that anyone who can reach the address may use the server (a
    warning when that is more than this machine)."""
    from composer.logging import get_logger
    from composer.serve.keys import access_note

    line, warn = access_note(args._api_keys, args.host, args.port)
    if warn:
        get_logger(__name__).warning(line)
    else:
        print(f"composer serve: {line}")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or a ConfigError naming the flag at fault."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address this machine can listen on ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {host}:{port} is already in use by another process; stop it or "
                              "choose another --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def _check_websockets() -> None:
    """uvicorn refuses WebSocket upgrades without websockets (or wsproto): say so once, instead of a bare 404."""
    import importlib.util

    if not any(importlib.util.find_spec(name) for name in ("websockets", "wsproto")):
        from composer.logging import get_logger

        get_logger(__name__).warning("live streams (/v1/streams) need the websockets package, which the serve extra "
                                     "installs: pip install 'composer[serve]' (or pip install websockets)")


def _call_slots(args: argparse.Namespace) -> int:
    """The calls that may run at once on the ranks (every rank makes a control group for each): --max-concurrent,
    or the worker's default."""
    from composer.serve.worker import CONCURRENT_DEFAULT

    return max(1, args.max_concurrent or CONCURRENT_DEFAULT)


class _Leader:
    """Rank 0 under torchrun: loads with the other ranks (in the server's loading thread) and, when the server
    stops, tells them to stop."""

    def __init__(self, load, timeout_s: float, slots: int):
        self._load, self._timeout_s, self._slots = load, timeout_s, slots
        self._loaded = threading.Event()
        self.generator = None

    def load(self):
        from composer.parallel.ranks import RankLeader, load_on_every_rank

        try:
            generator, channel = load_on_every_rank(self._load, self._timeout_s, self._slots)
            self.generator = RankLeader(generator, channel)
            return self.generator
        finally:
            self._loaded.set()

    def stop_after(self, app) -> None:
        """Wrap the app's lifespan: after the server's own stop (the running job cancelled on every rank), stop
        the other ranks."""
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a):
            async with inner(a):
                yield
            self._loaded.wait(self._timeout_s)  # the ranks still loading finish first: they wait for the stop
            if self.generator is not None:
                self.generator.stop()

        app.router.lifespan_context = lifespan


def _follow(load, timeout_s: float, slots: int) -> int:
    """A rank other than 0 under torchrun: load with the others, then run what rank 0 sends until it stops."""
    from composer.parallel.ranks import follow, load_on_every_rank

    def signalled(sig, frame) -> None:
        # torchrun passes a stop on to every rank; rank 0 stops the others in step (the running job cancelled
        # on all), so this rank waits for it: bounded, for a rank 0 that never says so
        if not watchdog.is_alive():
            watchdog.start()

    watchdog = threading.Timer(FOLLOWER_STOP_S, os._exit, args=(1,))
    watchdog.daemon = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signalled)
    generator, channel = load_on_every_rank(load, timeout_s, slots)
    return follow(generator, channel)
