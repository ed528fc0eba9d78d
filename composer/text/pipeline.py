"""Text pipelines: a diffusion language model folder as stages over one TextBatch.

    tokenize (chat template) -> block refinement (the model's forwards) -> detokenize

`TextPipeline` is a ComposedPipeline (the folder's modules loaded by the same loaders, the same registries), whose
stages pass a `TextBatch` instead of a video ForwardBatch. composer/pipelines/llada2.py serves diffusers'
LLaDA2Pipeline folders with it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.cancel import CancelToken
from composer.engine.loop import Blocking, drive, is_wait, wait_for
from composer.engine.scheduler import RequestContext, request_key
from composer.logging import get_logger
from composer.pipelines.base import ComposedPipeline, RequestIterator
from composer.stages.base import Stage, drives_task, tokenizer_lock
from composer.stages.validators import VerificationResult
from composer.text import refinement, strategies
from composer.text.batching import ForwardBatcher
from composer.text.limits import TextLimits, check_text_request
from composer.text.sampling import TextSamplingParam

logger = get_logger(__name__)


@dataclass
class TextStats:
    """What a request's generation took: model forwards, tokens generated (up to and with each row's EOS), seconds."""

    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"forwards": self.forwards, "tokens": self.tokens, "seconds": round(self.seconds, 6),
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "tokens_per_second": round(self.tokens_per_second, 3)}


@dataclass
class TextBatch:
    """One text request as it passes through the stages (rows: its prompts)."""

    prompts: list[str]
    sampling: TextSamplingParam
    messages: list[list[dict[str, str]]] | None = None  # chat conversations, one a row (instead of prompts)
    generator: torch.Generator | None = None
    cancel: CancelToken | None = None
    priority: int = 0  # higher first: its forwards go before lower ones' (ForwardBatcher)
    input_ids: torch.Tensor | None = None  # [rows, prompt tokens]
    prompt_mask: torch.Tensor | None = None  # the tokenizer's attention mask for them
    sequences: torch.Tensor | None = None  # [rows, gen_length]: the generated ids (mask ids where none came)
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None  # each row's ids up to and with its first EOS
    stats: TextStats = field(default_factory=TextStats)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    plan_key: str | None = None  # under tensor parallel: the request's name on every rank (its forwards' plans)
    planned_forwards: int = 0

    @property
    def rows(self) -> int:
        return len(self.prompts)


class PromptTokenizationStage(Stage):
    """Prompts -> token ids: each in the tokenizer's chat template when it has one and the request asks for it
    (`use_chat_template`, `add_generation_prompt`), else as plain text; several prompts padded as the tokenizer
    pads (as diffusers' pipeline tokenizes a list)."""

    def __init__(self, tokenizer: Any, limits: TextLimits | None = None):
        self.tokenizer = tokenizer
        self.limits = limits

    def forward(self, batch: TextBatch) -> TextBatch:
        with tokenizer_lock(self.tokenizer):  # (its padding settings are the object's: one call at a time)
            batch = self._encode(batch)
            prompt_tokens_checked(batch, self.limits)
            warn_unknown_tokens(self.tokenizer, batch)
        return batch

    def _encode(self, batch: TextBatch) -> TextBatch:
        sp, tok = batch.sampling, self.tokenizer
        if batch.messages is not None:  # conversations: always in the chat template (diffusers' `messages`)
            if not getattr(tok, "chat_template", None):
                from composer.errors import InvalidInputError

                raise InvalidInputError("messages need a tokenizer with a chat template; this model's has none: "
                                        "send a prompt")
            if batch.rows == 1:
                encoded = tok.apply_chat_template(batch.messages[0], add_generation_prompt=sp.add_generation_prompt,
                                                  tokenize=True, return_tensors="pt", return_dict=True)
            else:
                texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=sp.add_generation_prompt)
                         for m in batch.messages]
                encoded = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        elif sp.use_chat_template and getattr(tok, "chat_template", None):
            if batch.rows == 1:
                encoded = tok.apply_chat_template([{"role": "user", "content": batch.prompts[0]}],
                                                  add_generation_prompt=sp.add_generation_prompt, tokenize=True,
                                                  return_tensors="pt", return_dict=True)
            else:  # each prompt in its template, then padded together
                texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=sp.add_generation_prompt)
                         for p in batch.prompts]
                encoded = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        else:
            prompt = batch.prompts[0] if batch.rows == 1 else batch.prompts
            encoded = tok(prompt, return_tensors="pt", padding=batch.rows > 1)
        ids = encoded["input_ids"]
        mask = encoded.get("attention_mask")
        batch.input_ids = ids.long()
        batch.prompt_mask = (torch.ones_like(ids) if mask is None else mask).long()
        return batch

    def verify_output(self, batch: TextBatch, result: VerificationResult) -> None:
        ids = batch.input_ids
        if ids is None or ids.ndim != 2 or ids.shape[0] != batch.rows:
            result.add_failure("input_ids", None if ids is None else list(ids.shape), f"[{batch.rows}, tokens]")


def prompt_tokens_checked(batch: TextBatch, limits: TextLimits | None) -> None:
    """The tokenized prompts against the model's context (InvalidInputError before any forward)."""
    if limits is not None:
        check_text_request(batch.sampling, limits, prompt_tokens=batch.prompt_mask.sum(dim=1).tolist(),
                           check_prompt=False)


def warn_unknown_tokens(tokenizer: Any, batch: TextBatch) -> None:
    """A WARNING naming each part of a prompt the tokenizer does not know (read as its unknown token, which the model
    cannot answer sensibly): a prompt in another form than the model's."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not bool((batch.input_ids == unk).any()):
        return
    texts = ([m[-1]["content"] for m in batch.messages] if batch.messages is not None else batch.prompts)
    for row, text in enumerate(texts):
        unknown = []
        try:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            unknown = [text[a:b] for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]) if i == unk]
        except (NotImplementedError, ValueError, TypeError, KeyError):  # a slow tokenizer: no offsets to name them
            pass
        count = int((batch.input_ids[row][batch.prompt_mask[row].bool()] == unk).sum())
        if count:
            where = f"prompt[{row}]" if batch.rows > 1 else "the prompt"
            named = (", ".join(repr(u) for u in dict.fromkeys(unknown))
                     or f"{count} token(s) (not of the prompt's own text: of the chat template around it)")
            logger.warning("%s has text the model's tokenizer does not know: %s (read as %s, which the model cannot "
                           "answer); write the prompt in the form the model was trained on", where, named,
                           getattr(tokenizer, "unk_token", "the unknown token"))


class BlockRefinementStage(Stage):
    """The block refinement loop (composer/text/refinement.py) over the model. `steps` is the loop as a task
    (composer/engine/loop.py) that also yields the count of final tokens after every block (the pipeline's stream
    reads them); `forward_task` runs it whole. Requests run it at once, each a task of the engine core; their plain
    forwards meet in the batcher (composer/text/batching.py)."""

    concurrent = True

    def __init__(self, model: torch.nn.Module, block_length: int, mask_id: int, eos_id: int | None,
                 device: torch.device, batcher: ForwardBatcher | None = None,
                 scheduler_editing_threshold: float | None = None):
        self.model = model
        self.batcher = batcher
        self.block_length = block_length
        # what a step edits above when a request's editing_threshold is None (the scheduler config's, as
        # BlockRefinementScheduler.step falls back to it, while the pipeline takes no editing steps after a block)
        self.scheduler_editing_threshold = scheduler_editing_threshold
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.device = device

    @drives_task
    def forward(self, batch: TextBatch) -> TextBatch:
        return drive(self.forward_task(batch))

    def forward_task(self, batch: TextBatch):
        for item in self.steps(batch):
            if is_wait(item):
                yield item
        return batch

    def steps(self, batch: TextBatch):
        """Refine block after block, as a task: yields what it waits for (each plain forward, `Queued` on the
        batcher) and, after each block, the number of generated tokens that are final (the batch's `sequences` hold
        them)."""
        sp = batch.sampling
        block = sp.block_length or self.block_length
        gen_length = sp.gen_length
        steps = min(sp.num_inference_steps, gen_length // sp.minimal_topk)
        schedule = refinement.transfer_schedule(block, steps)
        ids = batch.input_ids.to(self.device)
        rows, prompt_length = ids.shape
        num_blocks = -(-(prompt_length + gen_length) // block)
        total = num_blocks * block
        attention = torch.zeros((rows, total), dtype=torch.long, device=self.device)
        attention[:, :prompt_length] = batch.prompt_mask.to(self.device)
        attention[:, prompt_length:prompt_length + gen_length] = 1
        positions = torch.arange(total, device=self.device).unsqueeze(0).expand(rows, -1)
        x = torch.full((rows, total), self.mask_id, dtype=torch.long, device=self.device)
        x[:, :prompt_length] = ids
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        editing = sp.editing_threshold is not None and sp.editing_threshold > 0.0  # steps after a block is full
        step_editing = sp.editing_threshold if sp.editing_threshold is not None else self.scheduler_editing_threshold
        multinomial = sp.sampling_method == "multinomial" or (sp.sampling_method == "auto" and sp.temperature != 0)
        early_stop = sp.eos_early_stop and self.eos_id is not None
        decoder = strategies.decoder_for(sp.decoding, sp, self.mask_id)
        if not decoder.exact:
            decoder.check_model(self.model)
        self._name_forwards(batch)
        start = time.perf_counter()
        batch.sequences = x[:, prompt_length:prompt_length + gen_length]
        for index in range(prompt_length // block, num_blocks):
            end = (index + 1) * block
            window, window_attention, window_positions = x[:, :end], attention[:, :end], positions[:, :end]
            first = index * block
            prompt_positions = torch.zeros(block, dtype=torch.bool, device=self.device)
            if first < prompt_length:
                prompt_positions[:min(prompt_length - first, block)] = True
            step = post_steps = 0
            if not decoder.exact:
                finished = yield from self._fast_block(batch, decoder, window, window_attention, window_positions,
                                                       block, finished, prompt_length, multinomial, early_stop)
            while decoder.exact:
                if batch.cancel is not None:
                    batch.cancel.check()
                current = window[:, -block:]
                had_masks = bool((current == self.mask_id).any())
                if not had_masks:
                    post_steps += 1
                logits = yield from self._logits(window, window_attention, window_positions, block, batch)
                batch.stats.forwards += 1
                tokens, probs = refinement.sample(
                    logits, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, multinomial=multinomial,
                    generator=batch.generator)
                outcome = refinement.commit(current, tokens, probs, mask_id=self.mask_id,
                                            count=schedule[min(step, len(schedule) - 1)], threshold=sp.threshold,
                                            editing_threshold=step_editing,
                                            prompt_positions=prompt_positions)
                changed = outcome.changed
                if early_stop and bool(finished.any()):
                    changed = changed & ~finished[:, None]
                if bool(changed.any()):
                    window[:, -block:] = torch.where(changed, outcome.block, current)
                if early_stop:
                    finished = refinement.finished_rows(window, tokens, changed, finished, eos_id=self.eos_id,
                                                        mask_id=self.mask_id, prompt_length=prompt_length)
                if had_masks:
                    step += 1
                if not refinement.block_goes_on(step=step, steps=steps, had_masks=had_masks, editing=editing,
                                                edited=bool(outcome.edited.any()), post_steps=post_steps,
                                                max_post_steps=sp.max_post_steps, finished=finished):
                    break
            batch.stats.seconds = time.perf_counter() - start
            yield min(end - prompt_length, gen_length)
            if early_stop and bool(finished.all()):
                break
        batch.stats.seconds = time.perf_counter() - start

    def _fast_block(self, batch: TextBatch, decoder: strategies.Decoder, window: torch.Tensor,
                    attention: torch.Tensor, positions: torch.Tensor, block: int, finished: torch.Tensor,
                    prompt_length: int, multinomial: bool, early_stop: bool):
        """A block under a strategy other than exact: steps until the block has no mask (each commits at least one
        token per row that has one), or every row is finished; no editing. Returns the finished rows."""
        sp = batch.sampling
        decoder.new_block()
        for _ in range(block + 1):
            current = window[:, -block:]
            if not bool((current == self.mask_id).any()) or (early_stop and bool(finished.all())):
                break
            if batch.cancel is not None:
                batch.cancel.check()
            if decoder.plain_forward:  # a plain forward: shared with other requests'
                logits = yield from self._logits(window, attention, positions, block, batch)
            elif self._planned:  # its own forward, planned by rank 0 with the others (it holds collectives)
                logits = yield from wait_for(self.batcher.call(
                    lambda: self._own_logits(decoder, window, attention, positions, block), window.shape[0],
                    batch.priority, self._forward_name(batch)))
            else:
                logits = self._own_logits(decoder, window, attention, positions, block)
            batch.stats.forwards += 1
            tokens, probs = refinement.sample(logits, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                              multinomial=multinomial, generator=batch.generator)
            outcome = decoder.commit(current, logits, tokens, probs)
            changed = outcome.changed & ~finished[:, None] if early_stop else outcome.changed
            window[:, -block:] = torch.where(changed, outcome.block, current)
            if early_stop:
                finished = refinement.finished_rows(window, tokens, changed, finished, eos_id=self.eos_id,
                                                    mask_id=self.mask_id, prompt_length=prompt_length)
        return finished

    def _own_logits(self, decoder: strategies.Decoder, window: torch.Tensor, attention: torch.Tensor,
                    positions: torch.Tensor, block: int) -> torch.Tensor:
        with torch.inference_mode():
            return decoder.logits(self.model, window, attention, positions, block)

    @property
    def _planned(self) -> bool:
        """Whether rank 0 plans this model's calls (tensor parallel: composer/text/batching.py)."""
        return self.batcher is not None and self.batcher.planner is not None

    def _name_forwards(self, batch: TextBatch) -> None:
        """Under tensor parallel: the request's key (a digest of the request, equal on every rank) by which rank 0's
        plans name its forwards, each with its number (`_forward_name`)."""
        if self._planned:
            batch.plan_key = request_key(batch.prompts, batch.messages, batch.sampling, batch.priority)
            batch.planned_forwards = 0

    def _forward_name(self, batch: TextBatch) -> Any:
        if batch.plan_key is None:
            return None
        batch.planned_forwards += 1
        return (batch.plan_key, batch.planned_forwards)

    def _logits(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, block: int,
                batch: TextBatch):
        """(In a task) the last `block` positions' logits of one plain forward (shared with other requests' by the
        batcher, higher priority first)."""
        if self.batcher is not None:
            return (yield from wait_for(self.batcher.forward(ids, attention, positions, block, batch.priority,
                                                             self._forward_name(batch))))
        with torch.inference_mode():
            return self.model(ids, attention_mask=attention, position_ids=positions).logits[:, -block:, :]


class DetokenizeStage(Stage):
    """Each row's ids up to and with its first EOS -> text (special tokens skipped, as diffusers decodes)."""

    def __init__(self, tokenizer: Any, eos_id: int | None):
        self.tokenizer = tokenizer
        self.eos_id = eos_id

    def forward(self, batch: TextBatch) -> TextBatch:
        rows = [until_eos(row, self.eos_id) for row in batch.sequences.cpu()]
        batch.token_ids = [r.tolist() for r in rows]
        batch.texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        batch.stats.tokens = sum(len(r) for r in batch.token_ids)
        return batch


def _library_has(class_name: str) -> bool:
    import transformers

    return getattr(transformers, class_name, None) is not None


def until_eos(row: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    if eos_id is None:
        return row
    where = (row == eos_id).nonzero()
    return row[: int(where[0, 0]) + 1] if where.numel() else row


class TextPipeline(ComposedPipeline):
    """A diffusion language model: `required_modules` ("model", "tokenizer", "scheduler") loaded as the folder's
    model_index.json names them; stages over a TextBatch. Subclasses set `class_names` and `config_class`."""

    modality = "text"
    required_modules = ("model", "tokenizer", "scheduler")
    batches_videos = False
    strategies: tuple[str, ...] | None = None  # the decoding values it takes (None: every strategy)

    def module_dtype(self, name: str) -> torch.dtype | None:
        if name == "model":
            return self.runtime.torch_dtype
        return super().module_dtype(name)

    def load_modules(self) -> dict[str, Any]:
        """As any pipeline's, except a model whose class is the folder's own code (config.json's `auto_map`, not a
        transformers class: the released LLaDA2 models), loaded as diffusers loads it, with transformers'
        AutoModelForCausalLM, once the runtime trusts that code (`trust_remote_code`)."""
        spec = self.index.components.get("model")
        if spec is None or spec.library != "transformers" or _library_has(spec.class_name):
            return super().load_modules()
        from composer.registry.models import has_model_class

        if has_model_class(spec.class_name):
            return super().load_modules()
        names = self.required_modules
        self.required_modules = tuple(n for n in names if n != "model")
        try:
            modules = super().load_modules()
        finally:
            self.required_modules = names
        modules["model"] = self._remote_model(spec)
        return {name: modules[name] for name in names}

    def _remote_model(self, spec: Any) -> torch.nn.Module:
        import json

        from composer.errors import ModelFormatError, UnsupportedError

        folder = self.folder / "model"
        config = folder / "config.json"
        auto_map = json.loads(config.read_text()).get("auto_map") if config.is_file() else None
        if not auto_map:
            raise ModelFormatError(f"{folder}: model_index.json names {spec.class_name}, which transformers does not "
                                   "have, and its config.json has no auto_map naming the code that defines it")
        if not self.runtime.trust_remote_code:
            raise UnsupportedError(f"{folder} defines its model ({spec.class_name}) in its own Python files "
                                   "(config.json auto_map): pass trust_remote_code=True (--trust-remote-code) to run "
                                   "that code, only for a folder you trust")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                                     dtype=self.module_dtype("model"))
        return model.to(self.load_device("model")).eval().requires_grad_(False)

    def denoiser_names(self) -> list[str]:
        """The denoiser is the language model: what LoRA adapters (lora_path, set_lora) act on."""
        return ["model"]

    @property
    def tokenizer(self) -> Any:
        return self.modules["tokenizer"]

    def special_ids(self) -> tuple[int, int | None]:
        """(mask id, EOS id): the pipeline config's, else the tokenizer's (diffusers reads the tokenizer's)."""
        mask = getattr(self.config, "mask_token_id", None)
        if mask is None:
            mask = getattr(self.tokenizer, "mask_token_id", None)
        if mask is None:
            from composer.errors import ConfigError

            raise ConfigError(f"{self.folder}: the tokenizer has no mask token and model_index.json states no "
                              "mask_token_id: a masked-diffusion model needs one")
        eos = getattr(self.config, "eos_token_id", None)
        return int(mask), (eos if eos is not None else getattr(self.tokenizer, "eos_token_id", None))

    def scheduler_setting(self, name: str) -> Any:
        """A value of the folder's scheduler config (None where it states none)."""
        config = getattr(self.modules["scheduler"], "config", {})
        return config.get(name) if hasattr(config, "get") else getattr(config, name, None)

    def scheduler_block_length(self) -> int:
        return int(self.scheduler_setting("block_length") or 32)

    def check_supported(self) -> None:
        self.check_runtime(self.index, self.runtime)

    @staticmethod
    def check_runtime(index: Any, runtime: Any) -> None:
        """The runtime hooks that act on a video model's transformer and not on a text model yet are refused rather
        than run without (before anything loads or joins a process group)."""
        from composer.errors import UnsupportedError

        r = runtime
        unsupported = [name for name, on in (
            ("quantize", r.quantize != "none"), ("offload", r.offload != "none"),
            ("cache", r.cache != "none"),
            ("sequence / CFG parallel", r.ulysses_degree * r.ring_degree > 1 or r.cfg_parallel)) if on]
        if unsupported:
            raise UnsupportedError(f"{', '.join(unsupported)} for a diffusion language model is not supported yet "
                                   "(docs/text-diffusion.md); load it without")
        if r.tp_size > 1:
            from composer.registry.models import has_model_class

            spec = index.components.get("model")
            if spec is None or not has_model_class(spec.class_name):
                raise UnsupportedError(f"tp_size = {r.tp_size}: tensor parallel needs composer's own model code "
                                       f"(LLaDAModelLM); {spec.class_name if spec else 'this model'} runs through "
                                       "its library's class")

    @property
    def limits(self) -> TextLimits:
        """What the model can take (its folder's configs): TextGenerator and the server check requests against it."""
        return TextLimits.from_folder(self.folder, type(self))

    def create_stages(self) -> None:
        mask, eos = self.special_ids()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.batcher = ForwardBatcher(self.modules["model"], pad if pad is not None else (eos or 0),
                                      self.runtime.max_batch_size, self.runtime.max_batch_tokens)
        if any(h.name == "parallel" for h in self.hooks):
            # every rank must make the same forwards in the same order: rank 0 plans the batcher's calls, the other
            # ranks run the ones it names (concurrent requests share them as on one process)
            from composer.parallel.plan import plan_channel

            plan_channel(self.runtime.dist_timeout).register(self.batcher)
        self.add_stage(PromptTokenizationStage(self.tokenizer, self.limits))
        self.add_stage(BlockRefinementStage(self.modules["model"], self.scheduler_block_length(), mask, eos,
                                            self.device, self.batcher, self.scheduler_setting("editing_threshold")))
        self.add_stage(DetokenizeStage(self.tokenizer, eos))

    def run_task(self, batch: TextBatch):
        """The request as a task (composer/engine/loop.py): every stage over `batch`, the refinement's forwards
        shared with other requests'; returns the batch. The engine core runs it (`TextGenerator`; under tensor parallel
        too, rank 0 planning every forward)."""
        pieces = self.stream(batch)
        while (yield from pieces.next_task()) is not None:
            pass
        return batch

    def stream(self, batch: TextBatch) -> RequestIterator:
        """The request's pieces: after each block the count of generated tokens that are final (in
        `batch.sequences`); `batch.texts` is set at the end. Read on a thread (`next`, each wait done there) or as
        tasks of the engine core (`next_task`). The request holds its place at the gate (set_lora waits for it)
        from its first piece to its end."""
        context = RequestContext(priority=batch.priority, cancel=batch.cancel)
        return RequestIterator(self._pieces(batch), context, self.gate)

    def _pieces(self, batch: TextBatch):
        tokenize, refine, detokenize = self.stages
        yield from wait_for(Blocking(lambda: self._run_stage(tokenize, batch)))
        refine.check(batch, "input")
        start = time.perf_counter()
        yield from refine.steps(batch)
        batch.timings[refine.name] += time.perf_counter() - start
        refine.check(batch, "output")
        yield from wait_for(Blocking(lambda: self._run_stage(detokenize, batch)))
