"""`composer generate`: one video from a prompt, or one per line of a --prompt-file (one batch, numbered files).

Sampling precedence: family defaults < what the model folder states (its scheduler's flow shift, a causal
folder's step list) < --config preset < flags.

Causal (block-autoregressive) models can also stream (`--stream`: the file grows block by block), switch
prompts (`--segment "PROMPT::BLOCKS"`, repeated) and take the next prompt from stdin (`--interactive`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from composer.cancel import CancelToken
from composer.cli.flags import Flag, add_flags, collect, dataclass_flags
from composer.cli.help import HelpAction
from composer.cli.interrupt import cancel_on_sigint
from composer.errors import ConfigError
from composer.logging import silence_library_progress_bars
from composer.request_check import check_cli_request, text_length_problem
from composer.runtime import RuntimeArgs

DEFAULT_BLOCKS_PER_PROMPT = 3


def _sampling_flags() -> list[Flag]:
    from composer.registry.configs import sampling_param_classes

    return dataclass_flags(*sampling_param_classes())


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        allow_abbrev=False,
        add_help=False,  # cli/help.py's: the common flags, with the model's own defaults
        help="generate a video",
        description="Generate a video. Without --model-path, uses the embedded default model.",
    )
    p.add_argument("-h", "--help", action=HelpAction, help="show the common flags and exit")
    p.add_argument("--help-all", action=HelpAction, help="show every flag and exit")
    p.add_argument("--model-path", default=None, metavar="PATH",
                   help="diffusers model folder, hub id or embedded model name (default: shapes-t2v, embedded)")
    p.add_argument("--config", default=None, help="YAML preset with model_path / runtime / sampling sections")
    p.add_argument(
        "--prompt-file", default=None, metavar="PATH",
        help="one prompt per line (blank lines and '#' comments skipped): one video each, made as one batch, "
        "written to numbered files (clip.mp4 -> clip-0.mp4, clip-1.mp4, ...); not with --prompt",
    )
    causal = p.add_argument_group("causal models (streaming, prompt switching)")
    causal.add_argument("--stream", action="store_true", help="write the video block by block as it is made")
    causal.add_argument(
        "--segment", action="append", metavar="PROMPT::BLOCKS",
        help="a prompt for BLOCKS blocks; repeat to switch prompts (the video's length follows)",
    )
    causal.add_argument(
        "--interactive", action="store_true",
        help="after the first prompt, read each next prompt from stdin ('prompt' or 'prompt::blocks'; an empty "
        "line or end of input finishes); implies --stream",
    )
    causal.add_argument(
        "--rtmp-url", default=None, metavar="URL",
        help="also push the video live to this rtmp:// or rtmps:// URL as each block is made (H.264 in FLV through "
        "ffmpeg; messages never show the stream key); implies --stream",
    )
    causal.add_argument(
        "--blocks-per-prompt", type=int, default=DEFAULT_BLOCKS_PER_PROMPT,
        help=f"blocks for an interactive prompt given without ::BLOCKS (default {DEFAULT_BLOCKS_PER_PROMPT})",
    )
    sampling_flags, runtime_flags = _sampling_flags(), dataclass_flags(RuntimeArgs)
    p.set_defaults(
        run=run,
        _sampling_names=add_flags(p.add_argument_group("sampling (SamplingParam fields)"), sampling_flags),
        _runtime_names=add_flags(p.add_argument_group("runtime (RuntimeArgs fields)"), runtime_flags),
    )


def default_output_path(prompt: str, seed: int) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:48] or "video"
    return Path("outputs") / f"{slug}-{seed}.mp4"


def parse_segment(text: str, default_blocks: int, what: str = "--segment") -> tuple[str, int]:
    """'a red circle::4' -> ('a red circle', 4); without '::' the default block count. `what` names the
    input in errors (the flag, or a prompt typed on stdin)."""
    prompt, sep, blocks = text.rpartition("::")
    if not sep:
        return text.strip(), default_blocks
    try:
        count = int(blocks)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: expected PROMPT::BLOCKS with an integer BLOCKS") from None
    if count < 1 or not prompt.strip():  # a segment makes at least one block (as generate_video requires)
        raise ConfigError(f"{what} {text!r}: expected a non-empty PROMPT and BLOCKS >= 1")
    return prompt.strip(), count


def stdin_segments(default_blocks: int) -> Iterator[tuple[str, int]]:
    """Prompts typed on stdin, read only when the previous segment is done."""
    while True:
        print("next prompt ('prompt' or 'prompt::blocks'; empty line to finish)> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return
        try:
            yield parse_segment(line.strip(), default_blocks, what="prompt")
        except ConfigError as exc:
            print(f"composer: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from composer.generator import VideoGenerator, resolve_model
    from composer.presets import Preset, load_preset

    if args.blocks_per_prompt < 1:  # named as given, before it becomes a segment's block count
        raise ConfigError(f"--blocks-per-prompt {args.blocks_per_prompt}: expected an integer >= 1 (the blocks a "
                          "prompt given without ::BLOCKS runs for)")
    preset = load_preset(args.config) if args.config else Preset()
    runtime = {**preset.runtime, **collect(args, args._runtime_names)}
    sampling_overrides = {**preset.sampling, **collect(args, args._sampling_names)}
    runtime_args = RuntimeArgs.from_kwargs(**runtime)  # report bad runtime flags before loading anything
    if not runtime_args.progress:
        silence_library_progress_bars()  # --no-progress: downloads and loading too, not only composer's bars
    model_path = args.model_path or preset.model_path
    resolved = resolve_model(model_path, runtime_args.model_family)  # once: the checks and the loading use it
    if getattr(resolved.pipeline_cls, "modality", "video") == "text":  # a diffusion language model
        return _run_text(args, model_path, runtime, sampling_overrides)
    if args.rtmp_url is not None:
        _check_rtmp(args, resolved)
        args.stream = True  # a live push is a stream
    segments = [parse_segment(s, args.blocks_per_prompt) for s in args.segment] if args.segment else None
    prompts = _prompt_file_prompts(args, sampling_overrides)  # before loading anything
    # and the whole request (types, values, output path) against what the folder's configs state
    # (the one check of the request: the run after loading takes it as checked, composer.request_check)
    checked = check_cli_request(model_path, runtime_args.model_family, sampling_overrides, segments,
                                stream=args.stream or args.interactive,
                                interactive_blocks=args.blocks_per_prompt if args.interactive else None,
                                flags=getattr(args, "typed_flags", None), resolved=resolved, prompts=prompts)

    from composer.parallel import state as parallel_state

    if args.interactive and (parallel_state.under_launcher() or (runtime_args.num_gpus or 1) > 1):
        raise ConfigError("--interactive reads prompts from one terminal and does not run on several ranks; use "
                          "--segment (every rank reads the same flags), or one process")
    generator = VideoGenerator.from_pretrained(resolved, **runtime)
    sp = generator.sampling_param(**sampling_overrides)  # the family's own fields and defaults
    if sp.seed is None:
        sp = sp.updated(seed=parallel_state.random_seed())  # under torchrun: rank 0's seed on every rank
    first_prompt = segments[0][0] if segments else sp.prompt
    if prompts is not None or (sp.num_videos_per_prompt > 1 and sp.prompt
                               and not (segments or args.stream or args.interactive)):
        name = Path(args.prompt_file).stem if prompts is not None else sp.prompt
        with cancel_on_sigint(CancelToken()) as cancel:  # Ctrl-C: Cancelled within one block; main() exits 130
            return _generate_prompt_list(generator, sp, prompts or [sp.prompt], name, cancel, checked)
    if sp.output_path is None and first_prompt:
        sp = sp.updated(output_path=str(default_output_path(first_prompt, sp.seed)))

    if (args.stream or args.interactive) and not first_prompt:
        raise ConfigError("streaming needs a first prompt: give --prompt or --segment (then --interactive reads more)")
    start = time.perf_counter()
    with cancel_on_sigint(CancelToken()) as cancel:  # Ctrl-C: Cancelled within one block; main() exits 130
        if args.stream or args.interactive:
            if args.interactive:
                first = segments or ([(sp.prompt, args.blocks_per_prompt)] if sp.prompt else [])
                source = itertools.chain(first, stdin_segments(args.blocks_per_prompt))
            else:
                source = _as_checked(checked, sp, segments)  # as checked before loading, when it was
            frames, path, stats = _stream(generator, sp, source, cancel, args.rtmp_url)
        else:
            result = generator.generate_video(_as_checked(checked, sp, segments), cancel=cancel)
            frames, path, stats = result.frames.shape[0], result.output_path, result.stats
    elapsed = time.perf_counter() - start
    _say(
        f"wrote {path} ({frames} frames, {sp.width}x{sp.height}, {sp.fps} fps, seed {sp.seed}) "
        f"in {elapsed:.1f} s with {generator.family}"
    )
    if stats is not None:
        _say(f"profile: {stats.summary()}")
    return 0


def _as_checked(checked, sp, segments):
    """The request checked before loading (`checked`), as the loaded model runs it (`sp`: a drawn seed, a default
    output path; CheckedRequest.updated checks those alone, and anything else the loaded model states whole), or
    `sp` itself where the check covered another request (interactive segments)."""
    from composer.request_check import CheckedRequest

    if not isinstance(checked, CheckedRequest) or checked.segments != segments:
        return sp
    changes = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)
               if not _same(getattr(sp, f.name), getattr(checked.sampling, f.name))}
    return checked.updated(**changes) if changes else checked


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except (TypeError, ValueError):  # arrays: never a CLI value, but never taken as equal either
        return False


def _check_rtmp(args: argparse.Namespace, resolved) -> None:
    """--rtmp-url, before loading: a URL composer can push to, a model that streams, no --prompt-file."""
    from composer.request_check import ModelLimits
    from composer.rtmp import check_rtmp_url

    check_rtmp_url(args.rtmp_url, "--rtmp-url")
    if args.prompt_file is not None:
        raise ConfigError("--rtmp-url pushes one live stream; it does not go with --prompt-file")
    config = resolved.configs.pipeline_config().updated_from_folder(resolved.index.extra)
    if ModelLimits.from_folder(resolved.index.folder, config).frames_per_block is None:
        raise ConfigError(f"--rtmp-url: {resolved.configs.family.name} makes the whole video at once and cannot "
                          "stream it live; RTMP out needs a causal (block-autoregressive) model "
                          "(docs/causal-streaming.md)")


VIDEO_ONLY = ("negative_prompt", "height", "width", "num_frames", "guidance_scale", "output_path", "fps")


def _run_text(args: argparse.Namespace, model_path: str, runtime: dict, overrides: dict) -> int:
    """A text model: the generated text on stdout as its blocks commit (--stream: piece by piece; else at the end),
    what it took on stderr. --prompt-file: one text per line's prompt, as one batch."""
    from composer.text import TextGenerator, TextSamplingParam

    text_fields = {f for f in TextSamplingParam.__dataclass_fields__}
    ignored = sorted(k for k in overrides if k not in text_fields and k in VIDEO_ONLY)
    unknown = sorted(k for k in overrides if k not in text_fields and k not in VIDEO_ONLY)
    if unknown:
        raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in unknown)}: not a setting of text "
                          "generation (text models take --max-new-tokens, --block-length, --steps, --temperature, "
                          "--threshold, --decoding, ...)")
    if ignored:
        from composer.logging import get_logger

        get_logger(__name__).warning("ignoring video settings for a text model: %s", ", ".join(
            "--" + k.replace("_", "-") for k in ignored))
    if args.segment or args.interactive or args.rtmp_url:
        raise ConfigError("--segment, --interactive and --rtmp-url are for causal video models; a text model takes "
                          "--prompt or --prompt-file")
    settings = {k: v for k, v in overrides.items() if k in text_fields}
    prompts = _prompt_file_prompts(args, settings)
    if prompts is not None:
        settings["prompt"] = prompts
    from composer.text.limits import check_before_loading

    check_before_loading(model_path, settings, runtime.get("model_family"))  # every bad value, before loading
    generator = TextGenerator.from_pretrained(model_path, **runtime)
    start = time.perf_counter()
    with cancel_on_sigint(CancelToken()) as cancel:
        if args.stream and prompts is None:
            for piece in generator.stream_text(cancel=cancel, **settings):
                _say(piece.text, end="" if not piece.done else "\n", flush=True)
                stats = piece.stats
        else:
            results = generator.generate_text(cancel=cancel, **settings)
            results = results if isinstance(results, list) else [results]
            for result in results:
                _say(result.text)
            stats = results[0].stats
    if stats is not None:
        print(f"composer: {stats.tokens} tokens in {stats.forwards} forwards ({stats.tokens_per_forward:.2f} a "
              f"forward, {stats.tokens_per_second:.1f} tokens/s) in {time.perf_counter() - start:.1f} s with "
              f"{generator.family}", file=sys.stderr)
    return 0


def _say(*args, **kwargs) -> None:
    """print, on rank 0 only: under torchrun every rank runs this command and rank 0 reports."""
    from composer.parallel import state as parallel_state

    if parallel_state.is_main_process():
        print(*args, **kwargs)


def _prompt_file_prompts(args: argparse.Namespace, sampling: dict) -> list[str] | None:
    """The prompts of --prompt-file (None without it), refusing the flags it cannot go with."""
    if args.prompt_file is None:
        return None
    from composer.prompt_lists import read_prompt_file

    if sampling.get("prompt") is not None:
        raise ConfigError("give --prompt or --prompt-file, not both (a preset's sampling.prompt counts as --prompt)")
    if args.segment or args.stream or args.interactive:
        raise ConfigError("--prompt-file makes whole videos in one batch; it does not go with --segment, --stream "
                          "or --interactive")
    prompts = read_prompt_file(args.prompt_file)
    for number, prompt in enumerate(prompts, 1):  # every line, before loading (the request check sees the first)
        if problem := text_length_problem(f"{args.prompt_file} prompt {number}", prompt):
            raise ConfigError(problem)
    return prompts


def _generate_prompt_list(generator, sp, prompts: list[str], name: str, cancel=None, checked=None) -> int:
    """One batch, one video per prompt (and copy), each written to its numbered file (by default
    outputs/<name>-<seed>-<i>.mp4, `name` being the prompt file's stem or the one prompt). `checked`: the request
    as checked before loading (its rows these prompts), run as it is."""
    if sp.output_path is None:
        sp = sp.updated(output_path=str(default_output_path(name, sp.seed)))
    start = time.perf_counter()
    request = _as_checked(checked, sp, None)
    if isinstance(request, type(sp)) or request.videos is None or request.videos.prompts != [
            p for p in prompts for _ in range(sp.num_videos_per_prompt)]:
        request = None  # checked as another request: the generator checks this one
    results = generator.generate_video(request, cancel=cancel) if request is not None else \
        generator.generate_video(prompts, sampling_param=sp, cancel=cancel)
    elapsed = time.perf_counter() - start
    for result in results:
        _say(f"wrote {result.output_path} ({result.num_frames} frames, seed {result.seed}): {result.sampling.prompt}")
    _say(
        f"{len(results)} videos ({sp.width}x{sp.height}, {sp.fps} fps) in {elapsed:.1f} s as one batch "
        f"with {generator.family}"
    )
    return 0


def _stream(generator, sp, segments, cancel=None, rtmp_url=None):
    """Write chunks as they arrive (and push them to `rtmp_url`); print one line per block. `segments`: the
    prompts, or the whole request as checked before loading (a CheckedRequest: `sp` is its sampling)."""
    from composer.request_check import CheckedRequest
    from composer.video import VideoWriter

    if isinstance(segments, CheckedRequest):
        stream = generator.stream_video(segments, keep_video=False, cancel=cancel, rtmp_url=rtmp_url)
    else:
        stream = generator.stream_video(
            segments if segments is not None else sp.prompt, sampling_param=sp, keep_video=False,  # frames to disk
            cancel=cancel, rtmp_url=rtmp_url,
        )
    if rtmp_url is not None:
        from composer.rtmp import redact_url

        _say(f"pushing to {redact_url(rtmp_url)} as each block is made", flush=True)
    from composer.parallel import state as parallel_state

    if not parallel_state.is_main_process():  # every rank makes the chunks together; rank 0 writes them
        frames = sum(len(chunk.frames) for chunk in stream)
        return frames, sp.output_path, stream.stats
    from composer.rtmp import RtmpError

    with VideoWriter(sp.output_path, fps=sp.fps) as writer:  # renamed into place when done, deleted on failure
        try:
            for chunk in stream:
                writer.append(chunk.frames)
                what = "start frames" if chunk.block_index is None else f"block {chunk.block_index}"
                _say(
                    f"{what} (segment {chunk.segment}): {len(chunk.frames)} frames, denoise "
                    f"{chunk.block_seconds * 1000:.0f} ms, decode {chunk.decode_seconds * 1000:.0f} ms, at "
                    f"{chunk.since_start:.2f} s",
                    flush=True,
                )
        except RtmpError as exc:
            if not writer.count:
                raise
            path = writer.close()  # a network fault does not cost the local copy: the frames made so far are kept
            raise RtmpError(f"{exc}; the local copy {path} was kept ({writer.count} frames)") from None
    return writer.count, writer.path, stream.stats
