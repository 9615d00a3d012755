"""Compression as one function per method (kvpress's one press per file): a layer's dense context
in, the rows its plan keeps written back as pages of their storage form (`executor.engine.
block_tables`), the context's pages freed.

    evict      SnapKV / H2O / StreamingLLM selection (KVCrush representatives, sinks, copy span,
               window): per KV head the kept rows as dense pages, or per query head (GQA
               `repeat`) each group's union as exact coded rows with the heads that keep each
    quant      KIVI at the pool's form for its width, under such an eviction or not
    codebook   SpindleKV: cosine codebooks of pre-RoPE keys and of values, eviction taking only
               what the codebook cannot
    merge      MiniCache: a layer pair's context merged by SLERP into shared directions, each
               layer's magnitudes and its most distinct rows exact
    offload    SpeCache: the context to the cachestore, a low-bit copy in the pool, sinks and
               the prefetched rows exact beside it

`press(ctx, seq, layer, lp, q, k, v, later_k, later_v)`: q [H, W, D] the context's last queries,
k, v [H_kv, C, D] its rows (post-RoPE keys, compute dtype), later_k, later_v [H_kv, L, D] the rows
fed since (a plan that came after the context, or a shrink) or None. Which press a layer takes:
`registry.kind(plan, layer)`; a plan the pool cannot hold is refused by `registry.check`."""
