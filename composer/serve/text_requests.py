"""What the text server (composer/serve/text.py) takes from an OpenAI completions or chat completions body, checked
before anything runs.

    parse(body, chat, generator) -> TextRequest   the fields' types and ranges, roles, the model's name (cheap: on
                                                 the event loop); composer's own settings checked by the library's
                                                 TextSamplingParam
    fit(generator, request)                      the library's checks (composer/text/limits.py), the prompts'
                                                 tokens against the model's context among them (tokenizing costs:
                                                 on a worker thread, never under a lock)

A refused request is a `RequestProblem`: 400 naming the field and the rule, 404 (`model_not_found`, as OpenAI
answers) for another model's name. Prompts may be text or token ids (OpenAI's `[8, 12, 10]` or `[[8, 12, 10], ...]`,
what lm-evaluation-harness sends once given a tokenizer); ids run as the text they decode to, so ids the tokenizer
would not make of that text are refused rather than run as other ids.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.errors import ComposerError
from composer.serve.requests import RequestProblem as _Problem
from composer.serve.requests import _priority  # `priority`: the rule a video job's follows

MAX_CHOICES = 16  # n
MAX_ROWS = 64  # prompts x n of one request: the rows of one batch (each row's forwards are shared with the others')
MAX_STOP = 16  # stop strings (OpenAI: 4; evaluation harnesses send a task's `until` plus the EOS)
MIN_BODY_BYTES = 2**20  # the body limit is this, or 8 bytes per token of MAX_ROWS prompts filling the context
BODY_BYTES_PER_TOKEN = 8  # a token id in JSON ("151643, "); text runs about 4 bytes a token
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
SEEDS = (-2**63, 2**64)  # what torch.Generator.manual_seed takes

# OpenAI fields composer cannot honour: refused unless they hold their no-op value
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
               "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,)}
# bookkeeping fields: accepted and ignored
IGNORED = {"user", "metadata", "store", "stream_options", "parallel_tool_calls", "service_tier",
           "reasoning_effort", "prompt_cache_key", "safety_identifier"}
ALIASES = {"steps": "num_inference_steps"}
OWN = {False: {"model", "prompt", "stream", "n", "stop", "max_tokens", "temperature", "top_p", "seed", "priority"},
       True: {"model", "messages", "stream", "n", "stop", "max_tokens", "max_completion_tokens", "temperature",
              "top_p", "seed", "priority"}}


def RequestProblem(message: str, field: str | None = None, status: int = 400) -> _Problem:  # noqa: N802
    """A refused request: 400 unless said, as OpenAI's API answers invalid requests."""
    return _Problem(message, field=field, status=status)


@dataclass
class TextRequest:
    """One checked request: generate_text's inputs and settings, the choices per prompt, the stop strings."""

    chat: bool
    settings: dict[str, Any]
    n: int
    stop: list[str]
    stream: bool
    prompts: list[str] = field(default_factory=list)  # completions: each prompt once (as text)
    prompt_ids: list[list[int]] | None = None  # completions sent as token ids: the ids, one list a prompt
    single: bool = False  # one string prompt (or one list of ids): generate_text's one result, not a list
    messages: list[dict[str, str]] | None = None  # chat: the conversation
    max_tokens_given: bool = False
    priority: int = 0  # the server's queue: higher first, then by arrival (as a video job's)

    @property
    def input_field(self) -> str:
        """The field the prompts came in: where a refusal of their text points."""
        return "messages" if self.chat else "prompt"

    @property
    def rows(self) -> int:
        return (1 if self.chat else len(self.prompts)) * self.n

    def inputs(self) -> dict[str, Any]:
        """generate_text's / stream_text's `prompt=` or `messages=`: each prompt n times, in order (OpenAI's choice
        indices: prompt i's choices are i*n .. i*n + n-1)."""
        if self.chat:
            return {"messages": self.messages if self.n == 1 else [self.messages] * self.n}
        if self.single and self.n == 1:
            return {"prompt": self.prompts[0]}
        return {"prompt": [p for p in self.prompts for _ in range(self.n)]}


def served_names(generator: Any) -> set[str]:
    """The `model` values that name the served model: its family, its path as loaded, its folder's name."""
    path = str(generator.model_path)
    return {generator.family, path, Path(path).name}


def body_limit(generator: Any, configured: int) -> int:
    """The most bytes a request body may hold: room for MAX_ROWS token-id prompts that fill the context, at least
    MIN_BODY_BYTES, at most the server's own limit."""
    context = generator.limits.context or 0
    return min(configured, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * MAX_ROWS * context))


def parse(body: Any, chat: bool, generator: Any) -> TextRequest:
    """The request a body asks for, every field's type and range checked (RequestProblem otherwise). Cheap: no
    tokenizing (that is `fit`)."""
    if not isinstance(body, dict):
        raise RequestProblem("the body must be a JSON object")
    check_model(body.get("model"), generator)
    settings = _settings(body, chat)
    n = _integer(body, "n", 1, MAX_CHOICES, default=1)
    limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if chat and None not in (body.get("max_tokens"), body.get("max_completion_tokens")) and \
            body["max_tokens"] != body["max_completion_tokens"]:
        raise RequestProblem(f"max_tokens = {body['max_tokens']!r} and max_completion_tokens = "
                             f"{body['max_completion_tokens']!r}: give one of them", "max_completion_tokens")
    limit = _integer(body, limit_key, 1, None)
    if limit is not None:
        settings["gen_length"] = limit
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        settings["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0, open_low=True)
    if top_p is not None:
        settings["top_p"] = top_p
    seed = _integer(body, "seed", SEEDS[0], SEEDS[1] - 1)
    if seed is not None:
        settings["seed"] = seed
    request = TextRequest(chat, settings, n, _stop(body.get("stop")), _flag(body, "stream"),
                          max_tokens_given=limit is not None, priority=_priority_of(body))
    if chat:
        request.messages = _messages(body.get("messages"))
    else:
        _prompts(request, body.get("prompt"), generator)
    if request.rows > MAX_ROWS:
        raise RequestProblem(f"{request.rows} choices ({request.rows // n} prompts x n = {n}): this server runs at "
                             f"most {MAX_ROWS} in one request; send fewer prompts or a smaller n",
                             "n" if n > 1 else request.input_field)
    return request


def fit(generator: Any, request: TextRequest) -> None:
    """Check the request as generate_text will (the library's checks: settings, decoding, and the prompts' tokens,
    in their chat template, against the model's context), tokenizing it with the pipeline's own stage; token-id
    prompts must be exactly what the tokenizer makes of their text. Without max_tokens, a default gen_length that
    would run past the context is lowered to the room the longest prompt leaves (OpenAI's default is what the
    context leaves). Blocking: run it on a worker thread. Raises RequestProblem, or the library's ComposerError."""
    from composer.text.limits import check_text_request
    from composer.text.pipeline import TextBatch

    limits = generator.limits
    sp = generator.sampling_param(**request.settings)
    prompt: list[str] = [request.messages[-1]["content"]] if request.chat else request.prompts
    sp = dataclasses.replace(sp, prompt=prompt if len(prompt) > 1 else prompt[0],
                             seed=0 if sp.seed is None else sp.seed)
    # without max_tokens the count is made with one new token, the least a request asks, and the default fitted after
    asked = sp if request.max_tokens_given else dataclasses.replace(sp, gen_length=1)
    check_text_request(asked, limits)  # the settings, before anything is tokenized
    batch = TextBatch(prompts=list(prompt), sampling=asked, messages=[request.messages] if request.chat else None)
    try:
        batch = generator.pipeline.stages[0](batch)  # the request's own tokenization (and length check), run ahead
    except ComposerError as exc:
        raise RequestProblem(str(exc), request.input_field) from None
    except (ValueError, KeyError, TypeError) as exc:  # a template that refuses the conversation: the request's
        where = request.input_field
        raise RequestProblem(f"{where}: the model's tokenizer refused it ({exc})", where) from None
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):  # a chat template's raise_exception (roles out of order)
            raise RequestProblem(f"{request.input_field}: the model's chat template refused it ({exc})",
                                 request.input_field) from None
        raise
    if request.prompt_ids is not None:
        made = [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids, batch.prompt_mask)]
        _check_round_trip(request.prompt_ids, made)
    if not request.max_tokens_given and limits.context is not None:
        room = _room(limits, sp, batch.input_ids.shape[1])  # rows are padded to the longest: its positions
        if sp.gen_length > room:
            request.settings["gen_length"] = room


def _room(limits: Any, sp: Any, prompt_tokens: int) -> int:
    """The most new tokens after `prompt_tokens` whose positions (whole blocks or canvases) fit the context."""
    low, high = 0, limits.context
    while low < high:  # positions grow with gen_length
        middle = (low + high + 1) // 2
        if limits.positions(prompt_tokens, dataclasses.replace(sp, gen_length=middle)) <= limits.context:
            low = middle
        else:
            high = middle - 1
    return low


def _check_round_trip(sent: list[list[int]], made: list[list[int]]) -> None:
    """Token-id prompts run as their text: the tokenizer must make the same ids of it, else the model would see
    other ids than the ones sent."""
    for index, (ids, again) in enumerate(zip(sent, made)):
        if ids == again:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
        got = again[at] if at < len(again) else "the end"
        gave = ids[at] if at < len(ids) else "the end"
        raise RequestProblem(
            f"prompt[{index}]: composer runs token ids as the text they decode to, and this model's tokenizer makes "
            f"other ids of that text (position {at}: {gave} sent, {got} made; {len(ids)} ids sent, {len(again)} "
            f"made, special tokens and chat template included); send the text instead (lm-eval: "
            f"tokenizer_backend=None), or ids as this tokenizer encodes them", "prompt")


def check_model(model: Any, generator: Any) -> None:
    """`model` must name the served model (or be left out): another name is OpenAI's 404 model_not_found."""
    if model is None:  # composer's clients may leave it out: the one served model
        return
    if not isinstance(model, str):
        raise RequestProblem(f"model = {_short(model)}: a string, the served model's name (GET /v1/models)", "model")
    if model not in served_names(generator):
        raise RequestProblem(f"The model {model!r} does not exist on this server: it serves "
                             f"{str(generator.model_path)!r} (GET /v1/models; also named {generator.family!r})",
                             "model", status=404)


def _settings(body: dict, chat: bool) -> dict[str, Any]:
    """composer's own settings (TextSamplingParam's fields, checked by the library), after refusing the OpenAI
    fields it cannot honour and those of the other endpoint."""
    from composer.text.sampling import TextSamplingParam

    fields = set(TextSamplingParam.__dataclass_fields__) - {"prompt", "gen_length", "temperature", "top_p", "seed"}
    settings: dict[str, Any] = {}
    for key, value in body.items():
        if key in OWN[chat] or key in IGNORED:
            continue
        if key in UNSUPPORTED:
            if value not in UNSUPPORTED[key]:
                raise RequestProblem(f"{key} is not supported by composer's diffusion language models", key)
            continue
        if key in OWN[not chat]:
            endpoint = "/v1/completions" if key == "prompt" else "/v1/chat/completions"
            raise RequestProblem(f"{key} belongs to {endpoint}; this endpoint takes "
                                 f"{'messages' if chat else 'prompt'}", key)
        name = ALIASES.get(key, key)
        if name not in fields:
            raise RequestProblem(f"unknown field {key!r} (OpenAI's: {', '.join(sorted(OWN[chat]))}; composer's "
                                 f"text settings: {', '.join(sorted(fields))})", key)
        settings[name] = value
    return settings


def _integer(body: dict, key: str, low: int, high: int | None, default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        rule = f"an integer from {low} to {high}" if high is not None else f"an integer of at least {low}"
        raise RequestProblem(f"{key} = {value!r}: {rule}", key)
    return value


def _number(body: dict, key: str, low: float, high: float, open_low: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (open_low and value == low):
        rule = f"{'above' if open_low else 'from'} {low:g} {'and at most' if open_low else 'to'} {high:g}"
        raise RequestProblem(f"{key} = {value!r}: a number {rule}", key)
    return float(value)


def _priority_of(body: dict) -> int:
    """`priority` as a video job takes it (an integer, higher first; default 0), refused as this API refuses: 400."""
    try:
        return _priority(body)
    except _Problem as exc:
        raise RequestProblem(str(exc), "priority") from None


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestProblem(f"{key} = {value!r}: true or false", key)
    return bool(value)


def _stop(stop: Any) -> list[str]:
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise RequestProblem(f"stop: a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    return stop


def _prompts(request: TextRequest, prompt: Any, generator: Any) -> None:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, a list of lists of token ids."""
    form = ("a string, a list of strings, a list of token ids or a list of lists of token ids (OpenAI's forms)")
    if isinstance(prompt, str):
        request.prompts, request.single = [prompt], True
        return
    if not isinstance(prompt, list) or not prompt:
        raise RequestProblem(f"prompt = {_short(prompt)}: {form}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        request.prompts = prompt
        return
    if all(_is_id(i) for i in prompt):
        ids, request.single = [prompt], True
    elif all(isinstance(p, list) for p in prompt):
        ids = prompt
    else:
        raise RequestProblem(f"prompt: {form}, not a mix", "prompt")
    tokenizer = generator.pipeline.tokenizer
    vocab = len(tokenizer)
    for index, row in enumerate(ids):
        if not row or not all(_is_id(i) for i in row):
            raise RequestProblem(f"prompt[{index}]: a non-empty list of token ids (integers)", "prompt")
        bad = next((i for i in row if not 0 <= i < vocab), None)
        if bad is not None:
            raise RequestProblem(f"prompt[{index}]: token id {bad} is not in this model's vocabulary (0 to "
                                 f"{vocab - 1})", "prompt")
    if request.settings.get("use_chat_template"):
        raise RequestProblem("use_chat_template with token-id prompts: ids run as sent, outside any chat template; "
                             "send text to have it templated", "use_chat_template")
    request.settings["use_chat_template"] = False
    request.prompt_ids = ids
    request.prompts = [tokenizer.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                       for row in ids]


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestProblem("messages: a non-empty list of {role, content}", "messages")
    return [_message(index, m) for index, m in enumerate(messages)]


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestProblem(f"{where}: a {{role, content}} object", "messages")
    role = message["role"]
    if role not in ROLES:
        raise RequestProblem(f"{where}.role = {_short(role)}: one of {', '.join(ROLES)} (tool and function "
                             "messages need tools, which composer's text models do not take)", "messages")
    if message.get("tool_calls"):
        raise RequestProblem(f"{where}.tool_calls: composer's text models do not take tools", "messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: text ones only
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestProblem(f"{where}.content[{number}]: a {kind!r} part; composer's text models take text "
                                     "parts ({\"type\": \"text\", \"text\": ...}) only", "messages")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise RequestProblem(f"{where}.content: a string (or a list of text parts)", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}
