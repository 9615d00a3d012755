"""bench.steps: the decode step's floor it reports beside the step."""
from bench import steps


def test_a_steps_floor_counts_every_weight_a_decode_step_reads(tiny_model):
    """bench.steps' floor: the decoder layers' tensors (packed linears' included) and the LM head."""
    cfg = tiny_model.model.config
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h \
        + 3 * h * f + 2 * h
    size = tiny_model.model.dtype.itemsize
    assert steps.weight_bytes(tiny_model) == size * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)
    assert steps.bandwidth(mib=8, reps=1) > 1e8
