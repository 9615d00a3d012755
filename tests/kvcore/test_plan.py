from kvcore.plan import Codebook, CompressionPlan, Eviction, KVCrush, LayerPlan, Merge, OffloadPlan, Quant, full_plan


def test_plan_round_trips_through_the_proto():
    plan = CompressionPlan(
        plan_id="p1", strategy="mix", model_fingerprint="abc", predicted_reserve_ratio=0.25,
        layers=(LayerPlan(0), LayerPlan(1, eviction=Eviction(keep_tokens=17, kvcrush=KVCrush(rep_fraction=0.5))),
                LayerPlan(2, codebook=Codebook(0.97, 0.9), quant=Quant(bits=2)),
                LayerPlan(3, eviction=Eviction(keep_ratio=0.5), merge=Merge(with_layer=2))),
        offload=OffloadPlan(enabled=True, top_k=32))
    msg = plan.to_proto()
    assert msg.layers[1].eviction.keep_tokens == 17 and msg.layers[1].eviction.WhichOneof("budget") == "keep_tokens"
    assert msg.layers[3].eviction.WhichOneof("budget") == "keep_ratio"
    assert not msg.layers[0].HasField("eviction")
    assert CompressionPlan.from_proto(msg) == plan


def test_layer_kind_follows_the_declared_parts():
    assert [lp.kind for lp in full_plan(3, "x").layers] == ["full"] * 3
    assert LayerPlan(0, eviction=Eviction(keep_tokens=4)).kind == "evicted"
    assert LayerPlan(0, codebook=Codebook()).kind == "codebook"
    assert LayerPlan(0, eviction=Eviction(keep_tokens=4), codebook=Codebook()).kind == "codebook"
    assert LayerPlan(0, eviction=Eviction(keep_tokens=4), quant=Quant()).kind == "quant"     # not ignored
