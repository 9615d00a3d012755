"""The OpenAI wire format of the HTTP gateway's requests: their bodies and their translation into
a `kvplan.v1.GenerateRequest` (the response and stream-chunk bodies: `kvplan.openai_shapes`).

kvplan's own request fields ride next to OpenAI's (the openai client's `extra_body`):

    kv_strategy   a planner strategy ("" / absent: the planner's default; with a budget and a
                  `full` default, `auto`)
    kv_ratio      KV reserve ratio in (0, 1]
    kv_tokens     KV budget in tokens per KV head
    kv_budget     the same budget as an object: {"reserve_ratio": r} or {"kv_tokens": n}; or
                  {"adaptive": {"floor_ratio": f}} ({} for no floor): the largest ratio the
                  executor's load leaves room for
    kv_question   appended after the compressed context (kvpress-style)

and `usage` gains `kv_bytes`, `full_kv_bytes`, `reserve_ratio`, `degraded`, `budget_met`,
`budget_floor_tokens` and `kv_strategy`. A chat request's messages take the model's chat
template; a completion's `prompt` is the text to continue as it is (`raw_prompt`), as OpenAI's
and vLLM's completions take it. `stop` sequences end the text before the first one generated
(finish_reason "stop"); `logprobs` come in OpenAI's two shapes: chat's `{"content": [{token,
logprob, bytes, top_logprobs}]}` (`logprobs: true`, `top_logprobs: k`), completions'
`{tokens, token_logprobs, top_logprobs, text_offset}` (`logprobs: k`), streamed with each chunk's
tokens. Unset `temperature` is greedy (kvplan's default), and a sampled request without a `seed`
gets one, so a job re-run on another executor replays the same text. vLLM's and SGLang's
`ignore_eos` and `min_tokens` are honoured. What kvplan cannot do is refused with 400 naming the
parameter, never ignored: `n` > 1, `response_format` other than text, and every field of
`kvplan.openai_fields` at a value that asks for something (penalties, `logit_bias`, tools, `top_k`,
...); a field nobody knows is refused by name.
"""
from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from executor.validation import MAX_TOP_LOGPROBS, check_stops
from kvcore.request import InvalidRequest
from kvplan.openai_errors import bad
from kvplan.openai_fields import check_extra
from protos import common_pb2, executor_pb2

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
KV_FIELDS = ("kv_strategy", "kv_ratio", "kv_tokens", "kv_budget", "kv_question")
# executor field names (INVALID_ARGUMENT details) -> the request's own names
PARAMS = {"max_new_tokens": "max_tokens", "budget.reserve_ratio": "kv_ratio", "budget.kv_tokens": "kv_tokens",
          "budget.adaptive.floor_ratio": "kv_budget.adaptive.floor_ratio",
          "strategy": "kv_strategy", "question": "kv_question", "prompt": "prompt"}


def field_path(loc) -> str:
    """A field's path from its parts: `messages[0].role` (pydantic's loc ("messages", 0, "role"))."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_utf8(value: Any, path: str) -> None:
    """Every string in `value` (a JSON body, walked) is valid UTF-8: a lone surrogate (`"\\ud800"`)
    decodes from JSON into text no UTF-8 encoder takes. 400 naming the first one's path."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(path or "body", "not valid UTF-8 text (a lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k, path)
            check_utf8(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_utf8(v, f"{path}[{i}]")


def _in_range(param: str, value: int | None, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad(param, f"must be in [{lo}, {hi}], got {value}")


class RequestBody(BaseModel):
    # Strict types: JSON's own (a number is not "0.5", a boolean is not a number), as OpenAI's API
    # checks them. Fields not modelled here are checked by `kvplan.openai_fields`: taken when they
    # change nothing, else refused by name.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False                       # vLLM's and SGLang's: generate max_tokens whatever the model says
    min_tokens: int | None = None                  # vLLM's and SGLang's: no end-of-text token before this many
    kv_strategy: str = ""
    kv_ratio: float | None = None
    kv_tokens: int | None = None
    kv_budget: dict[str, Any] | None = None
    kv_question: str = ""

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def top_logprobs(self) -> int | None:
        """The job's `top_logprobs` (GenerateRequest): None when the request asks no logprobs."""
        return None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(RequestBody):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs_: int | None = Field(None, alias="top_logprobs")

    @property
    def top_logprobs(self) -> int | None:
        if self.top_logprobs_ is not None and not self.logprobs:
            raise bad("top_logprobs", "needs \"logprobs\": true")
        return (self.top_logprobs_ or 0) if self.logprobs else None


class CompletionBody(RequestBody):
    prompt: str | list[str]
    logprobs: int | None = None

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


def _text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"messages[{i}].content[{j}]", "only text parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _unsupported(body: RequestBody) -> None:
    check_extra(body.model_extra or {}, KV_FIELDS)
    if body.n != 1:
        raise bad("n", f"only 1 choice per request is supported, got {body.n} (send {body.n} requests, "
                       "each with its own seed)")
    fmt = body.response_format
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", f"only {{\"type\": \"text\"}} is supported (no JSON mode, no JSON schema), "
                                     f"got type {str(fmt.get('type'))[:40]!r}")


def _budget(body: RequestBody) -> common_pb2.Budget:
    given = [name for name in ("kv_ratio", "kv_tokens", "kv_budget") if getattr(body, name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one of kv_ratio, kv_tokens, kv_budget, not {' and '.join(given)}")
    ratio, tokens = body.kv_ratio, body.kv_tokens
    if body.kv_budget is not None:
        b = body.kv_budget
        if len(b) != 1 or not set(b) <= {"reserve_ratio", "kv_tokens", "adaptive"}:
            raise bad("kv_budget", 'must be {"reserve_ratio": r}, {"kv_tokens": n} or {"adaptive": {"floor_ratio": f}}')
        if "adaptive" in b:
            return _adaptive(b["adaptive"])
        ratio, tokens = b.get("reserve_ratio"), b.get("kv_tokens")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))):
            raise bad("kv_budget.reserve_ratio", f"must be a number, got {ratio!r}")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise bad("kv_budget.kv_tokens", f"must be an integer, got {tokens!r}")
    param = "kv_budget" if body.kv_budget is not None else None
    if ratio is not None:
        if not 0.0 < ratio <= 1.0:                      # (NaN too)
            raise bad(f"{param}.reserve_ratio" if param else "kv_ratio", f"must be in (0, 1], got {ratio:g}")
        return common_pb2.Budget(reserve_ratio=ratio)
    if tokens is not None:
        if not 1 <= tokens <= INT64_MAX:
            raise bad(f"{param}.kv_tokens" if param else "kv_tokens", f"must be >= 1 and at most 2^63 - 1, got {tokens}")
        return common_pb2.Budget(kv_tokens=tokens)
    return common_pb2.Budget()


def _adaptive(a: Any) -> common_pb2.Budget:
    if not isinstance(a, dict) or not set(a) <= {"floor_ratio"}:
        raise bad("kv_budget.adaptive", 'must be {} or {"floor_ratio": f}')
    floor = a.get("floor_ratio", 0.0)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
        raise bad("kv_budget.adaptive.floor_ratio", f"must be a number in [0, 1], got {floor!r}")
    return common_pb2.Budget(adaptive=common_pb2.Adaptive(floor_ratio=floor))


def _request(body: RequestBody, max_tokens: int | None, param: str = "max_tokens") -> executor_pb2.GenerateRequest:
    check_utf8(body.model_dump(exclude_unset=True), "")
    _unsupported(body)
    _in_range(param, max_tokens, 1, INT32_MAX)
    if len(body.kv_strategy) > 128:
        raise bad("kv_strategy", f"must be at most 128 characters, got {len(body.kv_strategy)}")
    if body.temperature is not None and not body.temperature >= 0:
        raise bad("temperature", f"must be >= 0, got {body.temperature:g}")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {body.top_p:g}")
    if body.seed is not None and not 0 <= body.seed < 2 ** 64:
        raise bad("seed", f"must be in [0, 2^64), got {body.seed}")
    _in_range("min_tokens", body.min_tokens, 0, max_tokens if max_tokens is not None else INT32_MAX)
    req = executor_pb2.GenerateRequest(question=body.kv_question, temperature=body.temperature or 0.0,
                                       strategy=body.kv_strategy, budget=_budget(body), stop=_stops(body.stop),
                                       ignore_eos=body.ignore_eos, min_tokens=body.min_tokens or 0)
    k = body.top_logprobs
    if k is not None:
        _in_range("top_logprobs" if isinstance(body, ChatBody) else "logprobs", k, 0, MAX_TOP_LOGPROBS)
        req.top_logprobs = k
    if max_tokens is not None:
        req.max_new_tokens = max_tokens
    if body.top_p is not None:
        req.top_p = body.top_p
    if body.seed is not None:
        req.seed = body.seed
    elif req.temperature > 0:            # a re-attempt on another executor replays the same text
        req.seed = random.getrandbits(63)
    return req


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    try:
        check_stops(stops, (lambda i: "stop") if isinstance(stop, str) else (lambda i: f"stop[{i}]"))
    except InvalidRequest as e:
        raise bad(e.field, str(e).removeprefix(e.field + ": ")) from None
    return stops


def chat_request(body: ChatBody) -> executor_pb2.GenerateRequest:
    if body.max_completion_tokens is not None:
        req = _request(body, body.max_completion_tokens, "max_completion_tokens")
    else:
        req = _request(body, body.max_tokens)
    if not body.messages:
        raise bad("messages", "must not be empty")
    req.messages.extend(common_pb2.ChatMessage(role=m.role, content=_text(m.content, i))
                        for i, m in enumerate(body.messages))
    return req


def completion_request(body: CompletionBody) -> executor_pb2.GenerateRequest:
    req = _request(body, body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    req.prompt, req.raw_prompt = prompt, True          # the text to continue, as it is: no chat template
    return req
