"""ComposedPipeline: loads a model folder's modules, applies the runtime hooks, and runs an ordered list of
stages over a ForwardBatch, as a whole video (`forward`) or as pieces streamed while they are made (`stream`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from composer.accel.hooks import apply_hooks, configure_engine, enabled_hooks
from composer.admission import AdmissionQueue, Ticket
from composer.attach import Attachments
from composer.batch import ForwardBatch
from composer.cancel import CancelToken
from composer.configs.base import PipelineConfig
from composer.engine import DenoisingEngine
from composer.engine.batcher import module_lock
from composer.engine.loop import Admit, Blocking, drive, is_wait, wait_for
from composer.engine.scheduler import RequestContext, calling_requests, current_request, running_request
from composer.errors import UnsupportedError
from composer.loader.components import ComponentLoader
from composer.loader.model_index import ModelIndex
from composer.logging import get_logger, library_progress_bars, log_once
from composer.runtime import RuntimeArgs
from composer.stages.base import Stage

logger = get_logger(__name__)

StageScope = Callable[[Stage], AbstractContextManager]


class ComposedPipeline:
    """Subclasses set `class_names` (model_index `_class_name`s served) and `required_modules`, and build
    their stages in `create_stages()` with `add_stage` (denoising stages get their engine from `make_engine`).

    Construction: check_supported -> load_modules -> hook phase (composer/accel/hooks.py) -> create_stages.
    """

    class_names: tuple[str, ...] = ()
    required_modules: tuple[str, ...] = ()
    config_class: type[PipelineConfig] = PipelineConfig  # families whose config is not one are never picked
    # Whether one request may make several videos as rows of one batch (prompt lists, num_videos_per_prompt).
    batches_videos: bool = True

    def __init__(self, index: ModelIndex, config: PipelineConfig, runtime: RuntimeArgs):
        self.index = index
        self.folder: Path = index.folder
        self.config = config.updated_from_folder(index.extra)  # a folder may set its pipeline's settings
        self.runtime = runtime
        self.device = runtime.torch_device
        self.check_supported()
        self._warn_slow_dtype()
        self.hooks = enabled_hooks(runtime)
        self.engines: list[DenoisingEngine] = []
        self.stage_scopes: list[StageScope] = []  # hooks' context managers around each stage run (in order key order)
        self.attachments = Attachments()  # every hook attached to this pipeline, each removable (attach.py)
        self._lora: dict[str, Any] = {}
        self.concurrency = self.concurrency_mode()
        # Several ranks must make the same transformer calls in the same order: with a step scheduler rank 0 plans
        # them (composer/parallel/plan.py); without one (serial mode) a second request while one runs is refused
        # (two threads could be admitted in different orders on different ranks and hang the collectives).
        parallel = any(h.name == "parallel" for h in self.hooks)
        self.gate = RequestGate(serial=self.concurrency == "serial",
                                refuse_overlap=parallel and self.concurrency == "serial")
        with library_progress_bars(runtime.progress):  # transformers' "Loading weights" and the like
            self.modules: dict[str, Any] = self.load_modules()
        self.applied_hooks = apply_hooks(self, self.hooks)
        self.stages: list[Stage] = []
        self.create_stages()

    # -- loading -------------------------------------------------------------------------------------
    @classmethod
    def for_folder(cls, index: ModelIndex) -> type[ComposedPipeline]:
        """The class that runs this folder: this one, or a variant for folders whose model_index.json names the
        same `_class_name` but needs other stages (diffusers' WanPipeline serves Wan2.1 and Wan2.2 alike)."""
        return cls

    def check_supported(self) -> None:
        """Refuse folders this pipeline class recognises but cannot run (raise UnsupportedError)."""

    def _warn_slow_dtype(self) -> None:
        if self.device.type == "cpu" and self.runtime.torch_dtype in (torch.float16, torch.bfloat16):
            log_once(logger, "half-on-cpu", f"dtype = {self.runtime.dtype} on the CPU is much slower than fp32 there "
                     "(most CPU kernels have no fast half-precision path); use --dtype fp32, the CPU default",
                     logging.WARNING)

    def module_dtype(self, name: str) -> torch.dtype | None:
        """The dtype a module loads in: the text encoder and VAE have their own runtime knobs."""
        if name == "vae":
            return self.runtime.vae_torch_dtype
        if name.startswith("text_encoder"):
            return self.runtime.text_encoder_torch_dtype
        if name.startswith("transformer"):
            return self.runtime.torch_dtype
        return None

    def load_device(self, name: str) -> torch.device:
        """Where a module loads: the runtime device, unless a hook keeps it elsewhere (offload: the host)."""
        device = self.device
        for hook in self.hooks:
            if hasattr(hook, "load_device"):
                device = hook.load_device(self, name, device)
        return device

    def load_modules(self) -> dict[str, Any]:
        modules = {}
        for name in self.required_modules:
            spec = self.index.component(name)
            folder = self.folder / name
            start = time.perf_counter()
            module = None
            for hook in self.hooks:  # a hook may load a module itself (the disk tier of offload)
                if module is None and hasattr(hook, "load_module"):
                    module = hook.load_module(self, name, folder, spec, self.module_dtype(name))
            if module is None:
                loader = ComponentLoader.for_spec(spec, folder)
                module = loader.load(folder, spec, self.load_device(name), self.module_dtype(name))
            modules[name] = module
            logger.info("loaded %s (%s) in %.1f s", name, type(modules[name]).__name__, time.perf_counter() - start)
        return modules

    def denoiser_names(self) -> list[str]:
        """The components that denoise (`transformer`, `transformer_2`, ...): what LoRA, offload and compile
        act on."""
        return [n for n in self.required_modules if n.startswith("transformer")]

    def denoisers(self) -> dict[str, torch.nn.Module]:
        return {n: self.modules[n] for n in self.denoiser_names() if isinstance(self.modules.get(n), torch.nn.Module)}

    def lora_adapters(self, name: str = "transformer"):
        """The LoRA adapters of denoiser `name` (created on first use)."""
        from composer.accel.lora import LoraAdapters

        if name not in self._lora:
            self._lora[name] = LoraAdapters(self.modules[name])
        return self._lora[name]

    def make_engine(self, transformer: torch.nn.Module) -> DenoisingEngine:
        """The denoising engine over `transformer`, with the runtime's CFG mode and every hook's settings, and a
        step scheduler unless requests must run one at a time (`concurrency_mode`)."""
        engine = DenoisingEngine(transformer, cfg_mode=self.runtime.cfg_mode)
        configure_engine(self, engine)  # each hook's engine hooks, attached with its order key and removable
        if self.concurrency != "serial":
            engine.enable_scheduler(batching=self.concurrency == "batch", max_batch_size=self.runtime.max_batch_size,
                                    max_batch_tokens=self.runtime.max_batch_tokens,
                                    bucketed=self.runtime.compile != "none",
                                    active_requests=self._in_denoising)
            for hook in self.hooks:
                if hasattr(hook, "configure_scheduler"):
                    hook.configure_scheduler(engine.scheduler, self.runtime)
        self.engines.append(engine)
        return engine

    def _in_denoising(self) -> int:
        """The requests that may queue a transformer unit soon (what a ready call waits a moment for, `settle_s`):
        the busy ones (composer/pipelines/base.py RequestGate) less those whose VAE decode is queued or running
        (they cannot join a call before their decode ends)."""
        decoding = sum(getattr(stage.batcher, "in_flight", lambda: 0)() for stage in self.stages
                       if getattr(stage, "batcher", None) is not None)
        return self.gate.busy - decoding

    def remove_hooks(self, name: str | None = None) -> list[str]:
        """Take hook `name` off (None: every hook, the last in order first): what it attached is detached and what
        it changed is undone, so the pipeline computes what it computed without it (bit for bit); engines and
        stages made later are not configured by it. Returns the names removed. Raises UnsupportedError for a hook
        that changed the weights for good (quantize, tensor parallel), leaving the pipeline as it was. Waits until no
        request runs (new ones wait meanwhile), as a LoRA switch does."""
        with self.gate.exclusive("remove_hooks"):
            removed = self.attachments.remove(name)
        self.hooks = [h for h in self.hooks if h.name not in removed]
        self.applied_hooks = [line for line in self.applied_hooks if line.split(":", 1)[0] not in removed]
        return removed

    def concurrency_mode(self) -> str:
        """How concurrent requests share this pipeline:

        - "batch": their denoising steps are scheduled together and compatible steps share one transformer call;
        - "interleave": their steps are scheduled together, one request per call (a step cache: each request's
          own plan and residuals decide whether its call runs the blocks; composer/accel/step_cache.py);
        - "serial": one request at a time, start to finish (model offload moves whole modules per stage).

        Under torch.compile calls hold power-of-two videos (few graphs); under a parallel layout rank 0 plans every
        call (composer/parallel/plan.py).
        """
        runtime = self.runtime
        if runtime.offload == "model":
            return "serial"
        if runtime.cache != "none":
            return "interleave"
        return "batch"

    # -- requests ------------------------------------------------------------------------------------
    def sampling_defaults(self) -> dict[str, Any]:
        """Sampling defaults the model folder itself states, applied over the family's SamplingParam (a None
        clears the family's value: the folder fixes that setting)."""
        return {}

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """Attach family-specific request state to the batch (typed objects) before the stages run."""
        if segments is not None:
            raise UnsupportedError(f"{type(self).__name__} does not take prompt segments (a causal model does)")

    # -- cancellation ---------------------------------------------------------------------------------
    def check_cancelled(self) -> None:
        """Raise `Cancelled` if the running request's CancelToken was cancelled (called before each stage, step
        and transformer block: composer/accel/cancel.py). Inside a scheduled transformer call that holds several
        requests' rows, only when every one of them is cancelled (the others' rows must finish); each request
        then stops at its own next step."""
        requests = calling_requests()
        if requests is not None:
            tokens = [r.cancel for r in requests]
            if tokens and all(t is not None and t.cancelled for t in tokens):
                tokens[0].check()
            return
        request = current_request()
        if request is not None and request.cancel is not None:
            request.cancel.check()

    @staticmethod
    def request_context(batch: ForwardBatch) -> RequestContext:
        """The batch's request (priority, cancel token) as the scheduler sees it; made once per batch."""
        context = batch.get(RequestContext, None)
        if context is None:
            context = RequestContext(cancel=batch.get(CancelToken, None))
            batch.attach(context)
        elif context.cancel is None:
            context.cancel = batch.get(CancelToken, None)
        return context

    @contextmanager
    def _running(self, batch: ForwardBatch) -> Iterator[None]:
        """Make `batch`'s request (its CancelToken and priority) the one this thread runs."""
        with running_request(self.request_context(batch)):
            yield

    # -- stages --------------------------------------------------------------------------------------
    def create_stages(self) -> None:
        raise NotImplementedError

    def add_stage(self, stage: Stage) -> None:
        stage.check_values = self.runtime.verify_values
        if hasattr(stage, "tile_size") and stage.tile_size is None:
            stage.tile_size = self.runtime.vae_tile_size
        if getattr(self.runtime, "preview_decoder", None) and getattr(stage, "preview_decoder", False) is None:
            stage.use_preview_decoder(self.runtime.preview_decoder, self.device)  # loaded once, here
        for hook in self.hooks:  # e.g. a parallel layout splitting tiled decodes over its ranks
            if hasattr(hook, "configure_stage"):
                hook.configure_stage(stage, self.runtime)
        self.stages.append(stage)
        if self.concurrency == "batch" and hasattr(stage, "share_decodes"):
            stage.share_decodes(lambda: self.gate.busy)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name} in {type(self).__name__} (stages: {[s.name for s in self.stages]})")

    @property
    def can_stream(self) -> bool:
        """Whether a stage produces pieces by itself (a causal denoiser; a decoder only passes them on)."""
        first = next((stage for stage in self.stages if stage.streams), None)
        return first is not None and not first.streams_from_upstream

    @contextmanager
    def _scope(self, stage: Stage) -> Iterator[None]:
        with ExitStack() as stack:
            for scope in self.stage_scopes:
                stack.enter_context(scope(stage))
            yield

    @contextmanager
    def _stage_lock(self, stage: Stage) -> Iterator[None]:
        """Concurrent requests run a stage that is not `concurrent` one module at a time: the text encoder and the
        VAE keep state between calls (diffusers' Wan VAE keeps its causal cache on the module, for encode and decode
        alike), so two requests must not be inside one at once. Denoising stages go through their engine's
        scheduler instead."""
        if stage.concurrent:
            yield
            return
        with ExitStack() as stack:
            for module in sorted(stage.modules(), key=id):  # one order everywhere: no deadlock
                stack.enter_context(module_lock(module))
            yield

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        """Run every stage over the whole video, on this thread."""
        return drive(self.forward_task(batch))

    @property
    def runs_tasks(self) -> bool:
        """Whether this pipeline's requests can run as tasks on the engine core (composer/engine/core.py), holding no
        thread between their transformer units: on one process, a pipeline whose requests share it (batch or
        interleave mode) or run one at a time (serial: model offload; the others wait for their place at the gate in
        its queue, and the one running has its steps run by the core directly). Under a parallel layout too: rank 0's
        core plans the calls, every other rank's core runs the same ones (a serial pipeline's one request at a time is
        driven on its thread there: a second one is refused, never admitted in another order on another rank)."""
        return not self.gate.refuse_overlap

    @property
    def streams_as_tasks(self) -> bool:
        """Whether this pipeline's streams can be read as tasks (`VideoStream.next_task` on the engine core): a causal
        pipeline whose requests share it."""
        return (self.can_stream and self.concurrency in ("batch", "interleave") and not self.gate.serial
                and all(e.scheduler is not None for e in self.engines))

    def forward_task(self, batch: ForwardBatch):
        """`forward` as a task: the denoising stages yield their transformer units (each step's), every other
        stage runs as one Blocking piece of work (on the engine core: a stage thread, held only while it runs; driven
        on a thread: inline). The request holds its place at the gate throughout, under its own key (a serial
        pipeline's requests and those arriving during an adapter switch wait for it in the gate's queue)."""
        context = self.request_context(batch)
        with ExitStack() as slot, running_request(context):
            yield from self.gate.enter_task(("task", id(batch)), slot)
            for stage in self.stages:
                self.check_cancelled()
                if stage.skips(batch):  # nothing to do for this request: its modules need not visit the device
                    continue
                if stage.has_task and stage.concurrent:
                    with self._scope(stage):
                        batch = yield from stage.call_task(batch)
                else:
                    batch = yield from wait_for(Blocking(lambda stage=stage, batch=batch: self._run_stage(stage, batch)))
        return batch

    def _run_stage(self, stage: Stage, batch: ForwardBatch) -> ForwardBatch:
        with self._stage_lock(stage), self._scope(stage):
            return stage(batch)

    def stream(self, batch: ForwardBatch) -> Iterator[Any]:
        """The same stages, lazily: the stages before the first streaming stage run when iteration starts,
        then each streaming stage consumes the pieces of the one before it (the causal denoiser's latent
        blocks -> the decoder's frame chunks). Yields the last stage's pieces."""
        if not self.can_stream:
            raise UnsupportedError(
                f"{type(self).__name__} makes the whole video at once and cannot stream; causal (block-autoregressive) "
                "models can"
            )
        return RequestIterator(self._stream(batch), self.request_context(batch), self.gate)

    def _stream(self, batch: ForwardBatch) -> Iterator[Any]:
        batch.started = time.perf_counter()  # the request starts when its stream is first read
        pieces: Iterator[Any] | None = None
        for stage in self.stages:
            self.check_cancelled()
            if stage.streams:
                pieces = self._stream_stage(stage, batch, pieces)
            elif pieces is None:
                if stage.skips(batch):
                    continue
                batch = yield from wait_for(Blocking(lambda stage=stage, batch=batch: self._run_stage(stage, batch)))
            else:
                raise UnsupportedError(f"{stage.name} comes after a streaming stage but cannot take its pieces")
        for piece in pieces:  # chunks, and the waits of the stages that make them (composer/engine/loop.py)
            yield piece
            if not is_wait(piece):
                self.check_cancelled()  # a cancel while the consumer held the piece stops before the next

    def _stream_stage(self, stage: Stage, batch: ForwardBatch, upstream: Iterator[Any] | None) -> Iterator[Any]:
        with self._scope(stage):
            yield from stage.iter_call(batch, upstream)

    def __repr__(self) -> str:
        stages = " -> ".join(s.name for s in self.stages)
        return f"{type(self).__name__}({self.folder}, stages: {stages})"


class RequestGate(AdmissionQueue):
    """Who may run on a pipeline: any number of requests at once (one at a time when `serial`), and, between
    requests, exclusive work that changes the model (switching LoRA adapters) once every running request is done.
    An admission queue (composer/admission.py) whose grant is a place: requests that must wait get theirs in
    arrival order; a task waits on the engine core (`Admit`), a thread in `request()`.

    A stream whose reader holds its latest piece (it sends it to a slow client, or a session waits for its next
    extend) is *parked*: it still holds its place (`running`, what exclusive work waits for), but once parked
    for `park_grace_s` it no longer counts among the requests that are `busy`, the ones the step scheduler and the
    decode batcher wait a moment for before a call (a reader that stalls must not slow every other request's
    calls; one that is back within the grace still joins them)."""

    def __init__(self, serial: bool = False, refuse_overlap: bool = False, park_grace_s: float = 0.05):
        super().__init__()
        self.serial = serial or refuse_overlap
        self.refuse_overlap = refuse_overlap
        self.park_grace_s = park_grace_s
        self._active: dict[Any, int] = {}  # a thread's id or a task's key -> places it holds
        self._parked: dict[int, float] = {}  # a parked stream (id of its iterator) -> since when (time.monotonic)
        self._exclusive = False

    def _grant(self, ticket: Ticket) -> bool | None:
        key = ticket.need
        if self._must_wait(key):
            return None
        self._active[key] = self._active.get(key, 0) + 1
        return True

    @contextmanager
    def request(self, key: Any = None) -> Iterator[None]:
        """Hold a place for a request: this thread's (or `key`'s: a task, which no thread holds); this thread
        waits for it."""
        me = threading.get_ident() if key is None else key
        if not self.try_enter(me):
            self.wait_for(me, owner=me)
        try:
            yield
        finally:
            self.leave(me)

    def enter_task(self, key: Any, slot: ExitStack):
        """As a task: a place for `key` (a request's own), held until `slot` closes. Taken at once when that needs
        no waiting; otherwise the key waits in the queue (`Admit`: on the engine core, no thread held; driven on a
        thread, that thread waits)."""
        if not self.try_enter(key):
            request = current_request()  # its cancel token ends the wait (Cancelled), its place never taken
            yield from wait_for(Admit(self, key, cancel=request.cancel if request is not None else None))
        slot.callback(self.leave, key)

    def try_enter(self, key: Any) -> bool:
        """Take a place for `key` if that needs no waiting (True; `leave(key)` gives it back), else False: a key
        that holds a place already takes another at once (unless exclusive work waits), a new one when nobody waits
        ahead of it and the gate lets it in."""
        with self._cv:
            self._refuse_overlap(key)
            if key in self._active and not self._exclusive:
                self._active[key] += 1
                return True
            return self.take_now(key) is not None

    def leave(self, key: Any) -> None:
        with self._cv:
            self._active[key] -= 1
            if not self._active[key]:
                del self._active[key]
            self._notify()

    def _must_wait(self, me: Any) -> bool:
        return self._exclusive or (self.serial and bool(self._active) and me not in self._active)

    def _refuse_overlap(self, me: Any) -> None:
        if self.refuse_overlap and self._active and me not in self._active:
            raise UnsupportedError(
                "another request is running on this pipeline, and with a parallel layout (several ranks) requests "
                "must run one at a time in the same order on every rank: call generate_video / stream_video from "
                "one thread (composer serve does)")

    @contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Wait until no request runs (new ones wait meanwhile), then run `what` alone."""
        me = threading.get_ident()
        with self._cv:
            if me in self._active:
                raise UnsupportedError(f"{what} while this thread's own request (an unfinished stream) is running: "
                                       "finish or close it first")
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
            while self._active:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._notify()

    @property
    def running(self) -> int:
        """Requests holding their place, parked streams included."""
        with self._cv:
            return sum(self._active.values())

    @property
    def busy(self) -> int:
        """Requests at work in the pipeline: `running` less the streams parked for longer than `park_grace_s`."""
        return self.counts()[1]

    def counts(self) -> tuple[int, int]:
        """(`running`, `busy`), read together."""
        now = time.monotonic()
        with self._cv:
            idle = sum(1 for since in self._parked.values() if now - since >= self.park_grace_s)
            running = sum(self._active.values())
            return running, running - idle

    def park(self, key: int) -> None:
        """The stream `key` handed a piece to its reader: parked until `unpark`."""
        with self._cv:
            self._parked[key] = time.monotonic()

    def unpark(self, key: int) -> None:
        """The stream `key` is at work again (its reader asks for the next piece), or is over."""
        with self._cv:
            self._parked.pop(key, None)


_END = object()


class RequestIterator:
    """A stream's pieces, each made with its request as this thread's (its cancel token and priority), whichever
    thread reads it; the request holds its place at the gate from the first piece until the stream ends or is
    closed."""

    def __init__(self, pieces: Iterator[Any], context: RequestContext, gate: RequestGate):
        self._pieces = pieces
        self._context = context
        self._gate = gate
        self._slot: ExitStack | None = None
        self._done = False

    def __iter__(self) -> RequestIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._slot is None:
            self._slot = ExitStack()
            self._slot.enter_context(self._gate.request())
        self._gate.unpark(id(self))
        try:
            with running_request(self._context):
                while is_wait(piece := next(self._pieces)):
                    piece.run_here(self._context)  # a pass's unit, a decode: done here, on the reader's thread
        except BaseException:
            self.close()
            raise
        self._gate.park(id(self))  # until the reader asks again: a reader that stalls holds nobody else's calls
        return piece

    @property
    def context(self) -> RequestContext:
        return self._context

    def next_task(self):
        """The next piece as a task (composer/engine/loop.py): yields what making it waits for, so the engine core
        holds no thread for it between its passes; returns the piece, or None once the stream is done."""
        if self._done:
            return None
        if self._slot is None:  # a place at the gate may wait (an adapter switch): blocking work
            self._slot = ExitStack()
            yield from self._gate.enter_task(("stream", id(self)), self._slot)
        self._gate.unpark(id(self))
        try:
            while True:
                with running_request(self._context):
                    piece = next(self._pieces, _END)
                if not is_wait(piece):
                    break
                yield piece
        except BaseException:
            self.close()
            raise
        if piece is _END:
            self.close()
            return None
        self._gate.park(id(self))
        return piece

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._gate.unpark(id(self))
        try:
            with running_request(self._context):
                self._pieces.close()
        finally:
            if self._slot is not None:
                self._slot.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a stream dropped at interpreter exit
            pass
