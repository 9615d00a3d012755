"""Cache-layer kinds, by the name a LayerPlan's `kind` gives. A plain dict: the cache looks
kinds up here and never inspects concrete classes."""
from executor.layers.codebook import CodebookLayer
from executor.layers.evicted import EvictedLayer
from executor.layers.full import FullLayer
from executor.layers.merge import MergeLayer
from executor.layers.offload import OffloadLayer
from executor.layers.quant import QuantLayer

LAYER_KINDS = {cls.kind: cls for cls in (FullLayer, EvictedLayer, CodebookLayer, MergeLayer, QuantLayer, OffloadLayer)}
