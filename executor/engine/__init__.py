"""The continuous-batching engine (nano-vllm's shape): `Sequence` holds a job's state, the
`Scheduler` decides a step under the `KVBudget`, the `ModelRunner` runs it, `LLMEngine.step()`
ties them together."""
from executor.engine.kv_budget import KVBudget, OverBudget
from executor.engine.llm_engine import LLMEngine
from executor.engine.sequence import Sampling, Sequence, Status

__all__ = ["KVBudget", "LLMEngine", "OverBudget", "Sampling", "Sequence", "Status"]
