"""TextGenerator: a diffusion language model folder (diffusers' LLaDA2Pipeline layout) loaded once, text from
one call.

    gen = TextGenerator.from_pretrained("path/to/llada2-folder", dtype="bf16")
    result = gen.generate_text("Why is the sky blue?", gen_length=256, seed=0)
    print(result.text, result.stats.tokens_per_forward)
    for piece in gen.stream_text("Tell me a story", gen_length=512):  # text as blocks commit
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from composer.cancel import CancelToken
from composer.engine.scheduler import RequestContext
from composer.errors import UnsupportedError
from composer.logging import get_logger
from composer.parallel import state as parallel_state
from composer.runtime import RuntimeArgs, apply_threads
from composer.text.limits import check_text_request
from composer.text.pipeline import TextBatch, TextPipeline, TextStats, until_eos
from composer.text.sampling import TextSamplingParam

logger = get_logger(__name__)


@dataclass
class TextResult:
    """One prompt's generation: its text, the generated ids (prompt excluded, up to and with the first EOS), the
    seed drawn with, and the request's stats (a list of prompts runs as one batch: their stats are shared)."""

    prompt: str
    text: str
    token_ids: list[int]
    seed: int
    stats: TextStats
    prompt_tokens: int = 0  # the prompt's tokens (in its chat template), padding excluded
    finished: bool = False  # whether it ended with EOS (else it ran to gen_length)


@dataclass
class TextPiece:
    """What `stream_text` yields after each block: the text that became final for prompt `row` since the last
    piece (`text`), and everything final so far (`so_far`)."""

    row: int
    text: str
    so_far: str
    token_ids: list[int]
    done: bool = False  # the row's last piece (its text is final: EOS, or the last block)
    stats: TextStats | None = None  # the request's, on the last pieces (complete once the stream ends)


class TextGenerator:
    """A loaded text pipeline and its sampling defaults (family < model folder < each call's values)."""

    def __init__(self, pipeline: TextPipeline, default_sampling: TextSamplingParam, model_path: str, family: str):
        self.pipeline = pipeline
        self.default_sampling = default_sampling
        self.model_path = model_path
        self.family = family
        self.limits = pipeline.limits  # what check_text_request holds each request to (the folder's configs)
        from composer.engine.core import EngineCore, unit_queues

        # the executor of the model's forwards: every request's refinement steps share its calls
        self.core = EngineCore(lambda: unit_queues(pipeline), name="composer-text-core")

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike | None = None, **runtime_kwargs: Any) -> TextGenerator:
        """Load a diffusion language model folder or hub id (None: the embedded tiny-dllm). `runtime_kwargs` are
        RuntimeArgs fields (device, dtype, lora_path, max_batch_size, ...), every bad one reported in one
        ConfigError before anything loads."""
        from composer.demo.packaged import TEXT_NAME
        from composer.generator import check_model_configs, resolve_model

        model_path = TEXT_NAME if model_path is None else model_path
        runtime = RuntimeArgs.from_kwargs(**runtime_kwargs)
        resolved = resolve_model(model_path, runtime.model_family)
        if getattr(resolved.pipeline_cls, "modality", "video") != "text":
            raise UnsupportedError(f"{model_path} is a video model ({resolved.index.class_name}): load it with "
                                   "composer.VideoGenerator")
        check_model_configs(resolved)
        resolved.pipeline_cls.check_runtime(resolved.index, runtime)
        if runtime.num_gpus and runtime.num_gpus > 1 and not parallel_state.under_launcher():
            raise UnsupportedError(f"num_gpus = {runtime.num_gpus} for a text model: launch with `torchrun "
                                   f"--nproc-per-node {runtime.num_gpus}` and tp_size = {runtime.num_gpus} instead")
        state = parallel_state.init_parallel(runtime)  # under torchrun: joins the process group
        if state is not None:
            runtime = dataclasses.replace(runtime, device=str(state.device), progress=runtime.progress and state.is_main)
        apply_threads(runtime, int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if state is not None else 1)
        configs = resolved.configs
        logger.info("loading %s as family %s (matched by %s) with %s", resolved.model_path, configs.family.name,
                    configs.matched_by, resolved.pipeline_cls.__name__)
        start = time.perf_counter()
        pipeline = resolved.pipeline_cls(resolved.index, configs.pipeline_config(), runtime)
        logger.info("model ready in %.1f s on %s", time.perf_counter() - start, runtime.torch_device)
        defaults = resolved.stated
        return cls(pipeline, defaults, resolved.model_path, configs.family.name)

    def set_lora(self, paths: str | os.PathLike | list, scales: float | list[float] | None = None) -> str:
        """Replace the model's LoRA adapters with `paths` (.safetensors files in PEFT's naming, or a PEFT adapter
        folder; scale 1.0 each unless `scales` gives one per file). Waits for the running requests; takes effect
        from the next one. Returns the adapters' description."""
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        scales = [scales] if isinstance(scales, (int, float)) else scales
        with self.pipeline.gate.exclusive("set_lora"):
            adapters = self.pipeline.lora_adapters("model")
            adapters.set(paths, scales, fuse=False)
            return adapters.describe()

    def unset_lora(self) -> None:
        """Remove every LoRA adapter: the next request is the base model's, bit for bit."""
        with self.pipeline.gate.exclusive("unset_lora"):
            self.pipeline.lora_adapters("model").unset()

    def sampling_param(self, **overrides: Any) -> TextSamplingParam:
        """The defaults (family < model folder) with `overrides` applied (ConfigError for unknown keys)."""
        return self.default_sampling.updated(**overrides)

    def _batch(self, prompt: Any, sampling_param: TextSamplingParam | None, cancel: CancelToken | None,
               overrides: dict[str, Any], messages: Any = None, priority: Any = 0) -> TextBatch:
        from composer.request_check import _checked_priority

        priority = _checked_priority(priority)  # (an int; refused before anything runs)
        sp = (sampling_param or self.default_sampling).updated(**overrides)
        conversations = None
        if messages is not None:
            conversations = _conversations(messages)
            if prompt is not None:
                from composer.errors import InvalidInputError

                raise InvalidInputError("give a prompt or messages, not both")
            prompt = [c[-1]["content"] for c in conversations]  # what the results name as their prompt
            if not isinstance(messages[0], list):
                prompt = prompt[0]
        if prompt is not None:
            sp = dataclasses.replace(sp, prompt=prompt)
        if sp.seed is None:  # under tensor parallel rank 0's draw on every rank (the same tokens, the same plans)
            sp = dataclasses.replace(sp, seed=parallel_state.random_seed())
        check_text_request(sp, self.limits)  # the prompt's own tokens: once tokenized, before any forward
        prompts = [sp.prompt] if isinstance(sp.prompt, str) else list(sp.prompt)
        generator = torch.Generator("cpu").manual_seed(sp.seed)  # what a seed means to diffusers' pipeline
        return TextBatch(prompts=prompts, sampling=sp, generator=generator, cancel=cancel, messages=conversations,
                         priority=priority)

    def generate_text(self, prompt: str | list[str] | None = None, *, messages: Any = None,
                      sampling_param: TextSamplingParam | None = None, cancel: CancelToken | None = None,
                      priority: int = 0, **overrides: Any) -> TextResult | list[TextResult]:
        """Text for `prompt` (a list: one result each, run as one batch with one generator, as diffusers runs a
        list), or for a chat conversation `messages` ([{"role": ..., "content": ...}, ...], or a list of them), in
        the tokenizer's chat template. `overrides` are TextSamplingParam fields (gen_length, block_length,
        num_inference_steps, temperature, top_p, top_k, threshold, editing_threshold, eos_early_stop, decoding,
        seed, ...). `cancel`: a CancelToken; once cancelled the call raises Cancelled before the next forward.
        `priority` (an int, higher first): where this request's forwards go among the waiting ones of requests
        running at once (their outputs do not change)."""
        return self._finished(self._run(self._batch(prompt, sampling_param, cancel, overrides, messages, priority)))

    def stream_text(self, prompt: str | list[str] | None = None, *, messages: Any = None,
                    sampling_param: TextSamplingParam | None = None, cancel: CancelToken | None = None,
                    priority: int = 0, **overrides: Any) -> Iterator[TextPiece]:
        """As generate_text, yielding each prompt's newly final text after every block (a TextPiece per prompt
        that gained text), the last one per prompt with `done=True` (it has text, unless the prompt's last block
        added none). The ids are those generate_text gives. A bad request raises here, before the first piece is asked for."""
        batch = self._batch(prompt, sampling_param, cancel, overrides, messages, priority)
        return self._stream(batch)

    def _stream(self, batch: TextBatch) -> Iterator[TextPiece]:
        made = _PieceMaker(self, batch)
        for final in self._pieces(batch):
            yield from made.after_block(final)
        yield from made.at_end()

    def astream_text(self, prompt: str | list[str] | None = None, *, messages: Any = None,
                     sampling_param: TextSamplingParam | None = None, cancel: CancelToken | None = None,
                     priority: int = 0, **overrides: Any) -> AsyncIterator[TextPiece]:
        """As stream_text, for asyncio code (`async for piece in gen.astream_text(...)`): each block is a task of the
        engine core, awaited, so no thread waits for the stream. A bad request raises here, before the first piece
        is asked for."""
        batch = self._batch(prompt, sampling_param, cancel, overrides, messages, priority)
        return self._astream(batch)

    async def _astream(self, batch: TextBatch) -> AsyncIterator[TextPiece]:
        made = _PieceMaker(self, batch)
        pieces = self.pipeline.stream(batch)
        running: Future | None = None  # the block under way on the core
        try:
            while True:
                running = self.core.submit(pieces.next_task(), pieces.context)
                final = await asyncio.wrap_future(running)
                running = None
                if final is None:
                    break
                for piece in made.after_block(final):
                    yield piece
            for piece in made.at_end():
                yield piece
        finally:
            if running is not None and not running.done():  # (a reader gone mid-block) the stream's generator is
                running.add_done_callback(lambda _: pieces.close())  # running on the core: closed once it stops
            else:
                pieces.close()

    def submit_text(self, prompt: str | list[str] | None = None, *, messages: Any = None,
                    sampling_param: TextSamplingParam | None = None, cancel: CancelToken | None = None,
                    priority: int = 0, **overrides: Any) -> Future:
        """As generate_text, without waiting: a Future of its result (or results), the request a task of the model's
        engine core (no thread waits for it). A bad request raises here, before anything runs."""
        batch = self._batch(prompt, sampling_param, cancel, overrides, messages, priority)
        pieces = self.pipeline.stream(batch)
        outcome: Future = Future()
        outcome.set_running_or_notify_cancel()  # it stops through `cancel`, never by dropping its future

        def ended(done: Future) -> None:
            if done.exception() is not None:
                outcome.set_exception(done.exception())
            else:
                outcome.set_result(self._finished(batch))

        self.core.submit(self.pipeline.run_task(batch), pieces.context).add_done_callback(ended)
        return outcome

    def _run(self, batch: TextBatch) -> TextBatch:
        """The request to its end: a task of the engine core (this thread waits; under tensor parallel too, rank 0
        planning its forwards)."""
        return self.core.run(self.pipeline.run_task(batch), RequestContext(priority=batch.priority,
                                                                            cancel=batch.cancel))

    def _pieces(self, batch: TextBatch) -> Iterator[int]:
        """The count of final tokens after each block: each block a task of the engine core (this thread waits for
        it)."""
        pieces = self.pipeline.stream(batch)
        try:
            while (final := self.core.run(pieces.next_task(), pieces.context)) is not None:
                yield final
        finally:
            pieces.close()

    def _finished(self, batch: TextBatch) -> TextResult | list[TextResult]:
        results = self._results(batch)
        return results if isinstance(batch.sampling.prompt, list) else results[0]

    def _results(self, batch: TextBatch) -> list[TextResult]:
        eos = self.pipeline.stages[-1].eos_id
        lengths = batch.prompt_mask.sum(dim=1).tolist()
        return [TextResult(prompt, text, ids, batch.sampling.seed, batch.stats, int(length),
                           bool(ids) and eos is not None and ids[-1] == eos)
                for prompt, text, ids, length in zip(batch.prompts, batch.texts, batch.token_ids, lengths)]


class _PieceMaker:
    """A stream's TextPieces from the count of final tokens after each block. A row's piece is its last (`done`)
    once its text cannot change: it holds EOS, or the last block is made; a row whose last block added no text gets
    an empty last piece at the end (the only empty one)."""

    def __init__(self, generator: TextGenerator, batch: TextBatch):
        self.batch = batch
        self.tokenizer = generator.pipeline.tokenizer
        self.eos = generator.pipeline.stages[-1].eos_id
        self.shown = [""] * batch.rows
        self.done = [False] * batch.rows

    def after_block(self, final: int) -> list[TextPiece]:
        batch, eos, out = self.batch, self.eos, []
        for row in range(batch.rows):
            if self.done[row]:
                continue
            ids = until_eos(batch.sequences[row, :final].cpu(), eos)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            last = final >= batch.sampling.gen_length or (eos is not None and bool(ids.numel()) and int(ids[-1]) == eos)
            shown = self.shown[row]
            if text != shown and text.startswith(shown):
                self.done[row] = last
                out.append(TextPiece(row, text[len(shown):], text, ids.tolist(), last, batch.stats if last else None))
                self.shown[row] = text
        return out

    def at_end(self) -> list[TextPiece]:
        batch, out = self.batch, []
        for row, (text, ids) in enumerate(zip(batch.texts, batch.token_ids)):
            if not self.done[row]:
                shown = self.shown[row]
                out.append(TextPiece(row, text[len(shown):] if text.startswith(shown) else text, text, ids, True,
                                     batch.stats))
        return out


def _conversations(messages: Any) -> list[list[dict[str, str]]]:
    """One conversation ([{"role", "content"}, ...]) or a list of them, checked."""
    from composer.errors import InvalidInputError

    many = isinstance(messages, list) and messages and isinstance(messages[0], list)
    conversations = messages if many else [messages]
    for conversation in conversations:
        if not isinstance(conversation, list) or not conversation or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conversation):
            raise InvalidInputError("messages: a non-empty list of {'role': str, 'content': str} (or a list of such "
                                    "lists)")
    return conversations
