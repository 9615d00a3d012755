"""Turn a request into token ids: the context that gets compressed, and the part appended after
compression (the question plus the chat template's generation prompt, kvpress-style)."""
from __future__ import annotations

from dataclasses import dataclass

_MARK = "\u2063kvplan-question\u2063"   # never produced by a user; split point of the template


@dataclass(frozen=True)
class Prompt:
    context_ids: list[int]    # compressed under the plan
    question_ids: list[int]   # prefilled after compression; may be empty

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def build(tokenizer, messages: list[dict[str, str]], question: str = "", raw: bool = False) -> Prompt:
    """`messages`: chat turns, the last one the user's. Without a chat template, their contents
    are joined as plain text. `raw`: one message, the model's input as it is — no template, the
    question appended as it is too (OpenAI's and vLLM's completions: the prompt is the text to
    continue)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return _chat(tokenizer, messages, question)
    text = "\n\n".join(m["content"] for m in messages)
    context = tokenizer(text, add_special_tokens=True)["input_ids"]
    q = tokenizer(("" if raw else "\n\n") + question, add_special_tokens=False)["input_ids"] if question else []
    return Prompt(context, q)


def _chat(tokenizer, messages: list[dict[str, str]], question: str) -> Prompt:
    if not question:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return Prompt(list(ids["input_ids"]), [])
    marked = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + "\n\n" + _MARK}]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    before, after = text.split(_MARK)
    context = tokenizer(before, add_special_tokens=False)["input_ids"]
    return Prompt(context, tokenizer(question + after, add_special_tokens=False)["input_ids"])
