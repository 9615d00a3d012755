"""The OpenAI wire format of the HTTP gateway's answers: a response body, its stream's chunks
(the first carries the role with the first token's text), the last and the usage chunk, in the
chat (`chat.completion`) or the text (`text_completion`) kind, with their tokens'
log-probabilities in that kind's OpenAI shape; `usage` with kvplan's own fields (`kv_bytes`,
`full_kv_bytes`, `reserve_ratio`, `degraded`, `budget_met`, `budget_floor_tokens`, `kv_strategy`,
`kv_risk`, `kv_at_risk`)."""
from __future__ import annotations

import time
from typing import Any, Literal

from protos import executor_pb2

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
LOGPROB_FLOOR = -9999.0         # a log-probability of -inf as JSON can write it (vLLM's floor)


def usage(r: executor_pb2.JobResult) -> dict[str, Any]:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.generated_tokens,
            "total_tokens": r.prompt_tokens + r.generated_tokens,
            "kv_bytes": r.kv_bytes, "full_kv_bytes": r.full_kv_bytes, "reserve_ratio": r.reserve_ratio,
            "degraded": r.degraded, "budget_met": r.budget_met if r.HasField("budget_met") else None,
            "budget_floor_tokens": r.budget_floor_tokens, "kv_strategy": r.strategy,
            "kv_risk": r.kv_risk, "kv_at_risk": r.kv_at_risk}


class Shape:
    """The response and chunk bodies of one request: `chat` (chat.completion) or `text`
    (text_completion); with `logprobs`, each choice's tokens' log-probabilities in that kind's
    OpenAI shape."""

    def __init__(self, kind: Literal["chat", "text"], job_id: str, model: str, logprobs: bool = False):
        self.kind, self.model, self.created = kind, model, int(time.time())
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{job_id}"
        self.logprobs = logprobs
        self.offset = 0                       # text_offset of the next token (completions)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, r: executor_pb2.JobResult) -> dict[str, Any]:
        finish = FINISH.get(r.finish_reason, "stop")
        lps = self._logprobs(r.logprobs)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": finish,
                      "logprobs": lps}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(r)}
        choice = {"index": 0, "text": r.text, "finish_reason": finish, "logprobs": lps}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(r)}

    def chunk(self, text: str = "", finish: str | None = None, first: bool = False,
              logprobs=()) -> dict[str, Any]:
        """One stream chunk: `text` and the log-probabilities of the tokens it came with."""
        lps = self._logprobs(logprobs) if logprobs else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lps}]}

    def last(self, r: executor_pb2.JobResult) -> dict[str, Any]:
        return self.chunk(finish=FINISH.get(r.finish_reason, "stop"))

    def usage_chunk(self, r: executor_pb2.JobResult) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(r)}

    def _logprobs(self, entries) -> dict[str, Any] | None:
        """`TokenLogprob`s in this kind's shape: chat's {"content": [...], "refusal": None};
        completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [{**_entry(e.token, e.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in e.top]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [_lp(e.logprob) for e in entries],
                "top_logprobs": [{t.token: _lp(t.logprob) for t in e.top} for e in entries], "text_offset": offsets}


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", "replace"))}
