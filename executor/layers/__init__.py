"""Cache-layer kinds, by the name a LayerPlan's `kind` gives. A plain dict: the cache looks
kinds up here and never inspects concrete classes."""
from executor.layers.full import FullLayer

LAYER_KINDS = {
    FullLayer.kind: FullLayer,
}
