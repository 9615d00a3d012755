"""The request fields the HTTP API takes beyond the ones its body models read (`kvplan.openai_api`):
OpenAI's, and the common extensions of vLLM's and SGLang's OpenAI servers, each with what kvplan
does with it. A field in no list here and no model is refused by name (400, `param` = the
field), as OpenAI's API refuses it — never dropped: a client that sends `top_k` or `foo` learns
that it had no effect (issue 42; `foo` used to be a 200).

    NO_EFFECT   describe the request, not its output (OpenAI's `user`, `metadata`, vLLM's
                `request_id`, `cache_salt`): taken, and nothing changes
    NEUTRAL     sampling and output options kvplan does not do, taken at the value that asks
                for nothing (`presence_penalty: 0`, `top_k: -1`, `skip_special_tokens: true`,
                `use_beam_search: false`); any other value is refused naming the field

A JSON `null` is an absent field, as OpenAI's clients send them.
"""
from __future__ import annotations

import json
from typing import Any

from kvplan.openai_errors import bad

NO_EFFECT = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",     # OpenAI's
    "prompt_cache_retention", "parallel_tool_calls",
    "request_id", "cache_salt",                                                                  # vLLM's
    "rid",                                                                                       # SGLang's
})

# field -> (the values that ask for nothing, what kvplan does instead)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "presence_penalty": ((0,), "penalties are not supported"),
    "frequency_penalty": ((0,), "penalties are not supported"),
    "repetition_penalty": ((1,), "penalties are not supported"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "top_k": ((-1, 0), "top-k sampling is not supported (top_p is)"),
    "min_p": ((0,), "min-p sampling is not supported (top_p is)"),
    "best_of": ((1,), "only 1 is supported"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1,), "beam search is not supported"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix is not supported"),
    "tools": (([],), "tools are not supported"),
    "functions": (([],), "functions are not supported"),
    "tool_choice": (("none", "auto"), "tools are not supported"),
    "function_call": (("none", "auto"), "functions are not supported"),
    "modalities": ((["text"],), "only text is supported"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the text"),
    "include_stop_str_in_output": ((False,), "the text ends before its stop sequence"),
    "no_stop_trim": ((False,), "the text ends before its stop sequence"),
    "stop_token_ids": (([],), "stop token ids are not supported (stop sequences are)"),
    "add_generation_prompt": ((True,), "the chat template always ends with the assistant's turn"),
    "continue_final_message": ((False,), "the last message must be the user's"),
    "priority": ((0,), "priorities are not supported (tenants are weighted: docs/security.md)"),
    "prompt_logprobs": ((0,), "prompt log-probabilities are not supported"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
}


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that tells `true` from `1` and `0` from `false`."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return value == neutral


def check_extra(extra: dict[str, Any], known_kv: tuple[str, ...]) -> None:
    """Every field the body models did not read: taken (NO_EFFECT, NEUTRAL at its neutral value)
    or refused with 400 naming it."""
    for name, value in extra.items():
        if value is None or name in NO_EFFECT:
            continue
        if name in NEUTRAL:
            neutral, why = NEUTRAL[name]
            if not any(_same(value, n) for n in neutral):
                raise bad(name, f"{why}; only {' or '.join(_json(n) for n in neutral)} is taken")
            continue
        if name.startswith("kv_"):
            raise bad(name, f"unknown kvplan field (known: {', '.join(known_kv)})")
        raise bad(name, "unknown field (the fields kvplan takes: docs/http-api.md)")


def _json(value: Any) -> str:
    return json.dumps(value)
