"""Check a GenerateRequest before it is queued; every error names the field at fault. The
cheap checks come first: `check_size` before the prompt is tokenized, `check` before the job
is queued (every number bounded), `check_length` once the prompt's tokens are known."""
from __future__ import annotations

from dataclasses import dataclass

from executor.prompt import Prompt
from kvcore.request import InvalidRequest, validate_budget
from protos import executor_pb2

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 1024
MAX_NAME = 128                  # strategy and profile names
TEMPERATURE = (1e-3, 100.0)     # a positive temperature's range (0: greedy); 1e-40 would divide logits to inf
MAX_STOPS, MAX_STOP_CHARS = 16, 256     # stop sequences: each is searched for in the text at every token
MAX_TOP_LOGPROBS = 20                   # OpenAI's bound on top_logprobs


def check_size(req: executor_pb2.GenerateRequest, max_bytes: int) -> None:
    """The request's text is at most `max_bytes` UTF-8 bytes (prompt, messages, question
    together), and its names are short — before any tokenizing."""
    if len(req.messages) > MAX_MESSAGES:
        raise InvalidRequest("messages", f"{len(req.messages)} messages, at most {MAX_MESSAGES}")
    size = len(req.prompt.encode()) + len(req.question.encode()) + sum(len(m.content.encode()) for m in req.messages)
    if size > max_bytes:
        field = "prompt" if len(req.prompt.encode()) > max_bytes / 2 or not req.messages else "messages"
        raise InvalidRequest(field, f"{size} bytes of text (prompt, messages and question), at most {max_bytes} "
                                    "(KVPLAN_MAX_PROMPT_BYTES)")
    for name in ("strategy", "profile"):
        value = getattr(req, name)
        if len(value) > MAX_NAME or not value.isprintable():
            raise InvalidRequest(name, f"must be at most {MAX_NAME} printable characters")


@dataclass(frozen=True)
class Checked:
    messages: list[dict[str, str]]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    reserve_ratio: float | None
    kv_tokens: int | None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None     # set: the tokens' log-probabilities, with this many top tokens
    raw: bool = False                   # the prompt is the model's input as it is (no chat template)
    min_tokens: int = 0                 # no end-of-text token ends the job before this many


def check(req: executor_pb2.GenerateRequest, default_max_new_tokens: int, max_context: int | None = None) -> Checked:
    """Every field but the prompt's length (`check_length`); `max_context` bounds max_new_tokens."""
    if req.prompt and req.messages:
        raise InvalidRequest("messages", "give prompt or messages, not both")
    if req.raw_prompt and req.messages:
        raise InvalidRequest("raw_prompt", "a raw prompt is `prompt` text; messages take the chat template")
    if req.messages:
        for i, m in enumerate(req.messages):
            if m.role not in ROLES:
                raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
            if not m.content.strip():
                raise InvalidRequest(f"messages[{i}].content", "must not be empty")
        if req.messages[-1].role != "user":
            raise InvalidRequest(f"messages[{len(req.messages) - 1}].role", "the last message must be the user's")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
    elif req.prompt.strip():
        messages = [{"role": "user", "content": req.prompt}]
    else:
        raise InvalidRequest("prompt", "must not be empty (give prompt or messages)")
    n = req.max_new_tokens if req.HasField("max_new_tokens") else default_max_new_tokens
    if n < 1:
        raise InvalidRequest("max_new_tokens", f"must be >= 1, got {n}")
    if max_context is not None and n >= max_context:
        raise InvalidRequest("max_new_tokens", f"must be below the model's context of {max_context} tokens, got {n}")
    lo, hi = TEMPERATURE
    if not (req.temperature == 0 or lo <= req.temperature <= hi):
        raise InvalidRequest("temperature", f"must be 0 (greedy) or in [{lo:g}, {hi:g}], got {req.temperature:g}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p:g}")
    if not 0 <= req.min_tokens <= n:
        raise InvalidRequest("min_tokens", f"must be in [0, max_new_tokens = {n}], got {req.min_tokens}")
    check_stops(req.stop)
    k = req.top_logprobs if req.HasField("top_logprobs") else None
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    ratio, tokens = validate_budget(req.budget)
    return Checked(messages, n, float(req.temperature), float(top_p),
                   req.seed if req.HasField("seed") else None, ratio, tokens, tuple(req.stop), k, req.raw_prompt,
                   req.min_tokens)


def check_stops(stops, item=lambda i: f"stop[{i}]") -> None:
    """Stop sequences within their bounds (InvalidRequest naming `stop`, or `item(i)` for the i-th
    one: the HTTP API names a lone string `stop`)."""
    if len(stops) > MAX_STOPS:
        raise InvalidRequest("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise InvalidRequest(item(i), f"must be 1 to {MAX_STOP_CHARS} characters, got {len(stop)}")


def check_length(prompt: Prompt, max_new_tokens: int, max_context: int) -> None:
    need = prompt.num_tokens + max_new_tokens
    if need > max_context:
        raise InvalidRequest(
            "prompt", f"{prompt.num_tokens} prompt tokens + max_new_tokens {max_new_tokens} exceed the model's "
                      f"context of {max_context} tokens")


def check_strategy(name: str, known: list[str] | None) -> None:
    """`known` is None when the planner could not be asked; the planner then decides."""
    if name and known is not None and name not in known:
        raise InvalidRequest("strategy", f"unknown strategy {name!r} (known: {', '.join(sorted(known))})")
