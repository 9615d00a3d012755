"""Moved to `kvcore.offload_budget` (issue 25: the executor decides no budget, and the planner
does not import the executor). Kept for `executor.engine.llm_engine` until it imports the new
home; nothing else imports this."""
from kvcore.offload_budget import TOP_KS, VALUE_GROUPS, fit, ratio, resident_bytes  # noqa: F401
