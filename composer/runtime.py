"""RuntimeArgs: how a model runs (device, precision, attention backend...), fixed at load time.

Every field has the same name as a `VideoGenerator.from_pretrained` keyword, a `composer generate` flag
(`attention_backend` -> `--attention-backend`) and a key under `runtime:` in a YAML preset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from composer._fields import base_type, coerce, field_types, raise_if_errors, unknown_key_errors
from composer.loader.folder_settings import QUANTIZE_MODES  # one list: the folders' and the knob's
from composer.logging import get_logger, log_once

logger = get_logger(__name__)

# Precision names -> torch dtype attribute names (torch is imported only when a dtype is needed, so the
# CLI's --help and argument checks stay fast).
DTYPES: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
OFFLOAD_MODES = ("none", "model", "layerwise", "disk", "auto")
COMPILE_MODES = ("none", "regional", "full")
CFG_MODES = ("batched", "sequential")
CACHE_MODES = ("none", "teacache", "dbcache")
# the step-cache sub-options (docs/step-caching.md); each applies to teacache and dbcache, or to dbcache only
CACHE_OPTIONS = ("cache_threshold", "cache_warmup_steps", "cache_fn_blocks", "cache_bn_blocks", "cache_max_cached_steps",
                 "cache_max_consecutive", "cache_taylorseer")
COMPILE_TORCH_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


MAX_LORA_SCALE = 100.0  # beyond this a LoRA swamps the base weights (fused, it overflows half precision)


# Which denoiser(s) of a two-expert model a LoRA file goes to (RuntimeArgs.lora_expert; set_lora's `experts`).
LORA_EXPERTS = ("both", "transformer", "transformer_2")


def lora_scale_problem(scale: Any) -> str | None:
    """The one rule for a LoRA scale, wherever it is given (lora_scale, set_lora, a server request): None when
    `scale` is a finite number with |scale| <= MAX_LORA_SCALE, else what is expected."""
    import math

    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or abs(scale) > MAX_LORA_SCALE:
        return f"a finite number with |scale| <= {MAX_LORA_SCALE:g}"
    return None


def attention_backend_choices() -> tuple[str, ...]:
    """`auto` and every backend of the registry (composer/models/attention/backends/, one module each)."""
    from composer.models.attention.backends import backend_choices

    return backend_choices()


def field_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """Field name -> the values it accepts, for fields whose metadata lists them (a tuple or a function)."""
    out = {}
    for f in fields(cls):
        choices = f.metadata.get("choices")
        if choices is not None:
            out[f.name] = tuple(choices() if callable(choices) else choices)
    return out


def usable_cpus() -> int:
    """The CPU cores this process may use: its affinity mask (taskset, a cpuset), lowered by a cgroup v2 CPU quota
    (`docker --cpus 2`: cpu.max "200000 100000"), at least 1."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def default_threads(concurrent_runs: int = 1) -> int:
    """The documented rule for `threads` on the CPU: the usable cores divided by the runs sharing them, at least 1."""
    return max(1, usable_cpus() // max(1, concurrent_runs))


def apply_threads(runtime: RuntimeArgs, concurrent_runs: int = 1) -> int | None:
    """Set torch's intra-op threads for `runtime`: its `threads`, or on the CPU `default_threads(concurrent_runs)`
    (torch's own default, a thread per physical core for each process, oversubscribes a shared machine: two runs
    at once on 2 cores each took 16x as long). An OMP_NUM_THREADS in the environment is a choice too, and is left
    as torch read it. Returns the count set (None: left to torch)."""
    import os

    import torch

    count = runtime.threads
    if count is None:
        if runtime.torch_device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
            return None
        count = default_threads(concurrent_runs)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
        logger.info("torch uses %d CPU thread(s) per operation (%s)", count, "threads" if runtime.threads else
                    f"{usable_cpus()} usable core(s) / {max(1, concurrent_runs)} run(s); set threads / --threads to "
                    "choose")
    return count


def to_torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


@dataclass
class RuntimeArgs:
    """Load-time settings. Build with `RuntimeArgs.from_kwargs(...)` to get every bad knob in one error."""

    device: str = field(default="auto", metadata={"help": "'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1'..."})
    dtype: str = field(
        default="auto", metadata={"help": "transformer precision: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16"}
    )
    text_encoder_dtype: str | None = field(
        default=None, metadata={"help": "text encoder precision (default: same as --dtype)"}
    )
    vae_dtype: str = field(default="fp32", metadata={"help": "VAE precision (fp32 keeps decode quality)"})
    vae_tile_size: int | None = field(
        default=None,
        metadata={"help": "decode whole videos (and encode conditioning images / videos) in spatial tiles of this many "
                          "latent pixels a side: less memory, the same frames (the Wan and HunyuanVideo VAEs: exact "
                          "tiles with a halo, docs/memory.md; other VAEs: diffusers' own tiling, approximate); "
                          "default: whole frames "
                          "(offload = auto may choose 32)"},
    )
    preview_decoder: str | None = field(
        default=None,
        metadata={"help": "causal streams: decode each block's frames with this tiny TAEHV decoder weights file "
                          "(.pth or .safetensors from github.com/madebyollin/taehv: taew2_1 for Wan2.1 latents) "
                          "instead of the VAE: cheaper previews of lower quality; whole videos still use the VAE "
                          "(docs/memory.md)"},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "attention backend; auto: the fastest one usable here (flash-attn when installed, else SDPA)",
                  "choices": attention_backend_choices},
    )
    attention_window: list[int] | None = field(
        default=None,
        metadata={"help": "attention_backend = sliding_window: the window each token attends within, as latent "
                          "tokens FRAMES ROWS COLS (clipped to the video's grid; default: every frame x half of "
                          "each side); see docs/sparse-attention.md"},
    )
    progress: bool = field(default=True, metadata={"help": "show progress bars for long steps"})
    kv_cache_offload: bool = field(
        default=False,
        metadata={"help": "causal models: keep the KV cache in CPU memory, one layer at a time on the GPU"},
    )
    kv_cache_memory: float | None = field(
        default=None,
        metadata={"help": "causal models: the KV page pool's budget for all streams together, in bytes (e.g. "
                          "8e9), or a fraction (0, 1] of the device's free memory when the model loads; a stream "
                          "starts only when its pages fit and waits in line otherwise (default: no limit)"},
    )
    model_family: str | None = field(
        default=None,
        metadata={"help": "the model family (`composer models` lists them) when the folder's name or hub id does not "
                          "say, e.g. a renamed copy: its configs and sampling defaults (default: found from the name)"},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "run the Python code a model folder ships for its model class (transformers' auto_map; the "
                          "released LLaDA2 models need it): only for folders you trust"},
    )
    verify_values: bool = field(
        default=False, metadata={"help": "let stage checks read tensor values (NaN/inf; synchronises the device)"}
    )
    max_batch_size: int | None = field(
        default=None,
        metadata={"help": "most videos in one transformer batch: a longer prompt list runs as consecutive batches "
                          "(same seeds, same videos; less memory); default: all of a call's videos at once"},
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata={"help": "most transformer tokens in one call when concurrent requests' steps share it (rows x "
                          "tokens per row after patchify; a CFG pair is two rows); a step larger than this alone "
                          "still runs, alone; default: no limit"},
    )
    threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads torch uses for one operation (torch.set_num_threads; one setting for the "
                          "process); default on the CPU: the CPU cores this process may use divided by the runs that "
                          "share them (composer serve: --max-concurrent; torchrun: the ranks on this machine), at "
                          "least 1, unless OMP_NUM_THREADS is set; on a GPU, torch's own (README, "
                          "\"CPU threads\")"},
    )
    stage_threads: int = field(
        default=4,
        metadata={"help": "threads that run the stages other than denoising (text encoding, VAE decode, writing the "
                          "file) of requests made with submit_video / agenerate_video (composer serve's jobs): a "
                          "request holds one only while such a stage runs, none between its denoising steps"},
    )
    cfg_mode: str = field(
        default="batched",
        metadata={"help": "classifier-free guidance: 'batched' (prompt and negative prompt as one batch-2 model call) "
                          "or 'sequential' (two calls: less activation memory)", "choices": CFG_MODES},
    )
    lora_path: list[str] | None = field(
        default=None,
        metadata={"help": "LoRA file(s) (.safetensors) for the transformer, in diffusers/PEFT, original Wan or "
                          "kohya/musubi naming; several stack"},
    )
    lora_scale: list[float] | None = field(
        default=None, metadata={"help": "one strength per LoRA file (default 1.0 each)"}
    )
    lora_expert: list[str] | None = field(
        default=None,
        metadata={"help": "one per LoRA file, for two-expert models (Wan2.2 A14B): 'both' (default), 'transformer' "
                          "(the high-noise expert) or 'transformer_2' (the low-noise expert)"},
    )
    lora_fuse: bool = field(
        default=False,
        metadata={"help": "merge the LoRA into the weights (a little faster per step; unfused adapters switch "
                          "cheaply between videos)"},
    )
    quantize: str = field(
        default="none",
        metadata={"help": "weight-only quantization of the transformer blocks' linear layers (torchao): none; int8 "
                          "(about 1/4 of the fp32 weight memory; on CPU often slower than fp32); fp8 (GPUs with "
                          "compute capability 8.9+). See docs/quantization.md", "choices": QUANTIZE_MODES},
    )
    offload: str = field(
        default="none",
        metadata={"help": "none; model (each component on the device only while its stage runs); layerwise "
                          "(transformer blocks in host memory, streamed to the device one block ahead); disk "
                          "(layerwise, blocks read from the memory-mapped safetensors files); auto (the cheapest of "
                          "these whose predicted peak fits memory_budget; docs/memory.md)", "choices": OFFLOAD_MODES},
    )
    memory_budget: float | None = field(
        default=None,
        metadata={"help": "device memory composer may use, in bytes (e.g. 20e9) or as a fraction (0, 1] of the free "
                          "device memory at load: offload = auto plans within it, and every request is checked "
                          "against it before it runs (refused with the numbers when its predicted peak does not fit); "
                          "default with offload = auto: 0.9"},
    )
    compile: str = field(
        default="none",
        metadata={"help": "torch.compile the transformer: none; regional (each block, compiled once and reused); "
                          "full (the whole model)", "choices": COMPILE_MODES},
    )
    compile_mode: str | None = field(
        default=None,
        metadata={"help": "torch.compile mode", "choices": COMPILE_TORCH_MODES},
    )

    cache: str = field(
        default="none",
        metadata={"help": "step caching: none; teacache (skip the transformer's blocks on steps whose timestep "
                          "embedding barely changed, reusing the last residual); dbcache (skip the middle blocks on "
                          "steps whose first blocks' residual barely changed). Approximate: see docs/step-caching.md",
                  "choices": CACHE_MODES},
    )
    cache_threshold: float | None = field(
        default=None,
        metadata={"help": "teacache: accumulated rescaled change under which a step reuses the residual; dbcache: "
                          "relative L1 change of the first blocks' residual under which the middle blocks are skipped "
                          "(0: never; larger: more steps skipped, lower quality; default: the model family's "
                          "measured recommendation)"},
    )
    cache_warmup_steps: int | None = field(
        default=None,
        metadata={"help": "teacache, dbcache: first steps that always run (default: a tenth of the steps, at "
                          "least 1)"},
    )
    cache_fn_blocks: int = field(
        default=1,
        metadata={"help": "dbcache: first blocks that always run; their residual's change decides the step"},
    )
    cache_bn_blocks: int = field(
        default=0,
        metadata={"help": "dbcache: last blocks that always run (after the middle ones, run or cached)"},
    )
    cache_max_cached_steps: int | None = field(
        default=None,
        metadata={"help": "dbcache: at most this many cached steps per denoising loop (default: no limit)"},
    )
    cache_max_consecutive: int | None = field(
        default=None,
        metadata={"help": "dbcache: at most this many cached steps in a row (default: no limit)"},
    )
    cache_taylorseer: bool = field(
        default=False,
        metadata={"help": "dbcache: extrapolate the cached middle residual to the step (first-order TaylorSeer "
                          "from the last two computed steps) instead of reusing the last one as is"},
    )
    ulysses_degree: int = field(
        default=1,
        metadata={"help": "sequence parallel: split attention heads over this many ranks (all-to-all around "
                          "attention); the heads must divide by it"},
    )
    ring_degree: int = field(
        default=1,
        metadata={"help": "sequence parallel: pass keys/values round a ring of this many ranks (any head count); "
                          "with ulysses_degree too: USP, Ulysses inside groups of neighbouring ranks, the ring "
                          "across them"},
    )
    tp_size: int = field(
        default=1,
        metadata={"help": "tensor parallel: split the transformer's weights (heads and FFN) over this many ranks; "
                          "each rank reads only its slices of the checkpoint"},
    )
    cfg_parallel: bool = field(
        default=False,
        metadata={"help": "run the prompt and the negative prompt on two halves of the ranks (doubles the ranks)"},
    )
    num_gpus: int | None = field(
        default=None,
        metadata={"help": "start this many worker processes (one per GPU) and run every request on all of them; "
                          "the degrees must multiply to it (default layout: ulysses_degree = num_gpus). Not for "
                          "torchrun launches, which start the processes themselves"},
    )
    dist_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds a rank waits in a collective for its peers before failing with an error "
                          "(a failed peer never hangs the others)"},
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RuntimeArgs:
        """Build and validate; raises one ConfigError listing every unknown or invalid knob."""
        errors = unknown_key_errors(cls, kwargs, "runtime option")
        hints = field_types(cls)
        values = {}
        for key, value in kwargs.items():
            if key in hints:
                if type(value).__name__ == "dtype" and str(value).startswith("torch."):  # a torch.dtype
                    value = str(value).removeprefix("torch.")
                values[key] = coerce(value, hints[key], key, errors)
        args = cls(**values) if not errors else None
        if args is not None and args.num_gpus and "ulysses_degree" not in kwargs and args.num_gpus > 1 and (
                args.ring_degree, args.tp_size, args.cfg_parallel) == (1, 1, False):
            args.ulysses_degree = args.num_gpus  # num_gpus alone: Ulysses over all of them
        if args is not None:
            errors += args.validation_errors()
        raise_if_errors(errors, "runtime options")
        for name, message in args.ignored_settings():
            log_once(logger, f"ignored-{name}-{args.cache}", message, logging.WARNING)
        return args  # type: ignore[return-value]

    def ignored_settings(self) -> list[tuple[str, str]]:
        """(knob, message) for each step-cache setting the chosen `cache` mode does not use: the README's rule for
        an ignored setting is a WARNING, for every cache sub-option alike."""
        defaults = {f.name: f.default for f in fields(self)}
        users = {"cache_threshold": ("teacache", "dbcache"), "cache_warmup_steps": ("teacache", "dbcache")}
        out = []
        for name in CACHE_OPTIONS:
            value = getattr(self, name)
            used_by = users.get(name, ("dbcache",))
            if value != defaults[name] and self.cache not in used_by:
                out.append((name, f"{name} = {value} is ignored: it applies to cache = {' or '.join(used_by)}, and "
                                  f"cache = {self.cache!r}; set cache to use it, or leave {name} out"))
        return out

    def validation_errors(self) -> list[str]:
        errors = []
        for name in ("dtype", "text_encoder_dtype", "vae_dtype"):
            value = getattr(self, name)
            if value is None or (name == "dtype" and value == "auto"):
                continue
            if value not in DTYPES:
                errors.append(f"{name} = {value!r}: expected one of fp32, bf16, fp16")
        for name, allowed in field_choices(type(self)).items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                errors.append(f"{name} = {value!r}: expected one of {', '.join(allowed)}")
        if self.attention_window is not None:
            if self.attention_backend != "sliding_window":
                errors.append(f"attention_window = {self.attention_window} is set but attention_backend = "
                              f"{self.attention_backend!r}: the window applies to attention_backend = sliding_window")
            if len(self.attention_window) != 3 or any(w < 1 for w in self.attention_window):
                errors.append(f"attention_window = {self.attention_window}: expected three positive integers, "
                              "frames rows cols (in latent tokens)")
        if self.kv_cache_memory is not None:
            from composer.cache.kv_pool import budget_problem

            if (problem := budget_problem(self.kv_cache_memory)) is not None:
                errors.append(f"kv_cache_memory = {self.kv_cache_memory!r}: expected {problem}")
        if self.memory_budget is not None:
            from composer.cache.kv_pool import budget_problem

            if (problem := budget_problem(self.memory_budget)) is not None:
                errors.append(f"memory_budget = {self.memory_budget!r}: expected {problem.replace('free device', 'free')}")
        if self.vae_tile_size is not None and self.vae_tile_size < 1:
            errors.append(f"vae_tile_size = {self.vae_tile_size}: expected a positive number of latent pixels (or "
                          "unset: whole frames)")
        if self.preview_decoder is not None and not Path(self.preview_decoder).expanduser().is_file():
            what = "a folder" if Path(self.preview_decoder).expanduser().is_dir() else "no such file"
            errors.append(f"preview_decoder = {self.preview_decoder!r}: expected an existing TAEHV weights file (.pth "
                          f"or .safetensors); {what}")
        if self.threads is not None and self.threads < 1:
            errors.append(f"threads = {self.threads}: expected a positive integer (or unset: the CPU cores divided by "
                          "the runs sharing them)")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            errors.append(f"max_batch_size = {self.max_batch_size}: expected a positive integer (or unset: no limit)")
        if not isinstance(self.stage_threads, int) or self.stage_threads < 1:
            errors.append(f"stage_threads = {self.stage_threads!r}: expected a positive integer")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            errors.append(f"max_batch_tokens = {self.max_batch_tokens}: expected a positive integer (or unset: no "
                          "limit)")
        for path in self.lora_path or []:
            if not Path(path).expanduser().is_file():
                what = "a folder" if Path(path).expanduser().is_dir() else "no such file"
                errors.append(f"lora_path = {path!r}: expected an existing LoRA file (.safetensors); {what}")
        for i, scale in enumerate(self.lora_scale or []):
            if (rule := lora_scale_problem(scale)) is not None:
                errors.append(f"lora_scale[{i}] = {scale!r}: expected {rule}")
        for i, expert in enumerate(self.lora_expert or []):
            if expert not in LORA_EXPERTS:
                errors.append(f"lora_expert[{i}] = {expert!r}: expected one of {', '.join(LORA_EXPERTS)}")
        if self.lora_expert is not None:
            if not self.lora_path:
                errors.append("lora_expert is set but lora_path is not: give the LoRA file(s) too")
            elif len(self.lora_expert) != len(self.lora_path):
                errors.append(f"lora_expert has {len(self.lora_expert)} value(s) for {len(self.lora_path)} lora_path "
                              "file(s): give one per file")
        if self.lora_scale is not None:
            if not self.lora_path:
                errors.append("lora_scale is set but lora_path is not: give the LoRA file(s) too")
            elif len(self.lora_scale) != len(self.lora_path):
                errors.append(f"lora_scale has {len(self.lora_scale)} value(s) for {len(self.lora_path)} lora_path "
                              "file(s): give one scale per file")
        from composer.parallel.state import layout_errors

        errors += layout_errors(self)
        errors += self._number_errors()
        if self.cache_warmup_steps is not None and self.cache_warmup_steps < 1:
            errors.append(f"cache_warmup_steps = {self.cache_warmup_steps}: expected a positive integer (or unset)")
        if self.cache_fn_blocks < 1:
            errors.append(f"cache_fn_blocks = {self.cache_fn_blocks}: expected a positive integer (dbcache decides "
                          "from the first blocks' residual, so at least one block always runs)")
        if self.cache_bn_blocks < 0:
            errors.append(f"cache_bn_blocks = {self.cache_bn_blocks}: expected an integer >= 0")
        if self.cache_max_cached_steps is not None and self.cache_max_cached_steps < 0:
            errors.append(f"cache_max_cached_steps = {self.cache_max_cached_steps}: expected an integer >= 0 "
                          "(or unset: no limit)")
        if self.cache_max_consecutive is not None and self.cache_max_consecutive < 1:
            errors.append(f"cache_max_consecutive = {self.cache_max_consecutive}: expected a positive integer "
                          "(or unset: no limit)")
        try:
            device = self.torch_device
            from composer.platform import platform_for

            if device.type != "cpu" and not platform_for(device).is_available():
                kind = "CUDA" if device.type == "cuda" else device.type
                errors.append(f"device = {self.device!r}: {kind} is not available on this machine (use 'cpu' or 'auto')")
        except RuntimeError as exc:
            errors.append(f"device = {self.device!r}: {exc}")
        return errors

    def _number_errors(self) -> list[str]:
        """The one rule for every float knob: a finite number (NaN passes every `<` test, so it is named), in the
        knob's range where it has one. lora_scale (a list) is checked with lora_path."""
        from composer.stages.validators import V

        ranges = {"cache_threshold": V.non_negative_number, "dist_timeout": V.positive_number}
        own_check = {"kv_cache_memory", "memory_budget"}  # validation_errors names its rule (NaN and inf included) once
        errors = []
        for name, hint in field_types(type(self)).items():
            value = getattr(self, name)
            if base_type(hint) is not float or value is None or name in own_check:
                continue
            rule = ranges.get(name, V.finite_number)
            if not rule(value):
                errors.append(f"{name} = {value}: expected {rule.rule}")
        return errors

    @property
    def torch_device(self):
        import torch

        if self.device == "auto":
            from composer.platform import accelerator_device

            return accelerator_device()
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        """The transformer's dtype ("auto": bf16 on an accelerator, fp32 on the CPU)."""
        if self.dtype == "auto":
            return to_torch_dtype("bf16" if self.torch_device.type != "cpu" else "fp32")
        return to_torch_dtype(self.dtype)

    @property
    def text_encoder_torch_dtype(self):
        return to_torch_dtype(self.text_encoder_dtype) if self.text_encoder_dtype else self.torch_dtype

    @property
    def vae_torch_dtype(self):
        return to_torch_dtype(self.vae_dtype)
