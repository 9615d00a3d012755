"""The planner: resolves a strategy and turns a job's budget into a per-layer CompressionPlan."""
