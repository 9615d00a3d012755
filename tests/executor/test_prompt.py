"""Prompt assembly with the real chat template: the question goes after the compressed part; a
raw prompt (OpenAI's completions) is the model's input as it is. Every field's check names it."""
import pytest

from executor import prompt, validation
from kvcore.request import InvalidRequest
from protos import common_pb2, executor_pb2


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(real_model_dir)


def test_without_question_the_whole_templated_prompt_is_context(tokenizer):
    p = prompt.build(tokenizer, [{"role": "user", "content": "Hello there"}])
    text = tokenizer.decode(p.context_ids)
    assert p.question_ids == [] and "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_question_and_generation_prompt_come_after_the_context(tokenizer):
    p = prompt.build(tokenizer, [{"role": "user", "content": "A long document."}], question="What is it?")
    ctx, q = tokenizer.decode(p.context_ids), tokenizer.decode(p.question_ids)
    assert "A long document." in ctx and "What is it?" not in ctx and "<|im_start|>assistant" not in ctx
    assert q.startswith("What is it?") and q.endswith("<|im_start|>assistant\n")
    assert p.num_tokens == len(p.context_ids) + len(p.question_ids)


def test_a_raw_prompt_takes_no_template(tokenizer):
    p = prompt.build(tokenizer, [{"role": "user", "content": "The capital of France is"}], question=" Paris,",
                     raw=True)
    assert p.context_ids == tokenizer("The capital of France is")["input_ids"]
    assert tokenizer.decode(p.context_ids + p.question_ids) == "The capital of France is Paris,"


@pytest.mark.parametrize("req, field", [
    (executor_pb2.GenerateRequest(prompt="  "), "prompt"),
    (executor_pb2.GenerateRequest(prompt="x", max_new_tokens=-1), "max_new_tokens"),
    (executor_pb2.GenerateRequest(prompt="x", max_new_tokens=0), "max_new_tokens"),
    (executor_pb2.GenerateRequest(prompt="x", temperature=-0.5), "temperature"),
    (executor_pb2.GenerateRequest(prompt="x", top_p=0.0), "top_p"),
    (executor_pb2.GenerateRequest(prompt="x", budget=common_pb2.Budget(reserve_ratio=1.01)), "budget.reserve_ratio"),
    (executor_pb2.GenerateRequest(prompt="x", budget=common_pb2.Budget(reserve_ratio=-1)), "budget.reserve_ratio"),
    (executor_pb2.GenerateRequest(prompt="x", budget=common_pb2.Budget(kv_tokens=-4)), "budget.kv_tokens"),
    (executor_pb2.GenerateRequest(prompt="x", messages=[common_pb2.ChatMessage(role="user", content="y")]), "messages"),
    (executor_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="robot", content="y")]), "messages[0].role"),
    (executor_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content="")]), "messages[0].content"),
    (executor_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content="y")], raw_prompt=True),
     "raw_prompt"),
    (executor_pb2.GenerateRequest(prompt="x", stop=["a"] * 17), "stop"),
    (executor_pb2.GenerateRequest(prompt="x", stop=["ok", ""]), "stop[1]"),
    (executor_pb2.GenerateRequest(prompt="x", stop=["x" * 257]), "stop[0]"),
    (executor_pb2.GenerateRequest(prompt="x", top_logprobs=21), "top_logprobs"),
    (executor_pb2.GenerateRequest(prompt="x", top_logprobs=-1), "top_logprobs"),
])
def test_validation_names_the_field(req, field):
    with pytest.raises(InvalidRequest) as e:
        validation.check(req, default_max_new_tokens=8)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


def test_length_and_strategy_checks():
    p = prompt.Prompt(list(range(100)), list(range(10)))
    validation.check_length(p, 10, 120)
    with pytest.raises(InvalidRequest, match="^prompt: 110 prompt tokens"):
        validation.check_length(p, 11, 120)
    validation.check_strategy("x", None)          # planner unreachable: it decides later
    with pytest.raises(InvalidRequest, match="^strategy: unknown strategy 'x'"):
        validation.check_strategy("x", ["full"])


def test_stop_logprobs_and_raw_are_checked_through():
    c = validation.check(executor_pb2.GenerateRequest(prompt="x", stop=["\n\n", "END"], top_logprobs=0,
                                                      raw_prompt=True), default_max_new_tokens=8)
    assert (c.stop, c.top_logprobs, c.raw) == (("\n\n", "END"), 0, True)
    assert validation.check(executor_pb2.GenerateRequest(prompt="x"), 8).top_logprobs is None
