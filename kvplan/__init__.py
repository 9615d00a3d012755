"""kvplan: LLM serving with a KV cache shaped by per-layer compression plans.

    kvplan.Client(address, api_key=...)   the SDK over a running cluster (kvplan.sdk)
    kvplan.pipeline()                     the whole system in this process (kvplan.inprocess)
"""
__version__ = "0.1.0"
__all__ = ["AuthenticationError", "Client", "Result", "JobFailed", "pipeline", "__version__"]


def __getattr__(name: str):
    # imported on first use: `kvplan --version` and the services never load the SDK
    if name in ("AuthenticationError", "Client", "Result", "JobFailed"):
        from kvplan import sdk
        return getattr(sdk, name)
    if name == "pipeline":
        from kvplan.inprocess import pipeline
        return pipeline
    raise AttributeError(f"module 'kvplan' has no attribute {name!r}")
