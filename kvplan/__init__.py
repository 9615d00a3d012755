"""kvplan: LLM serving with a KV cache shaped by per-layer compression plans."""
__version__ = "0.1.0"
