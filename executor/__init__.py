"""The executor: runs the model over a KV cache shaped by a CompressionPlan."""
