"""KV layer groups: which layers share a page-table row, and each layer's slot in the pool."""

from jaxinfer.config import ModelConfig
from jaxinfer.kv_groups import Chunk, first_kept, kv_groups, window_pages


def config(num_layers: int, layer_types=(), **kw) -> ModelConfig:
    return ModelConfig(model_type="test", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=num_layers,
                       num_heads=2, num_kv_heads=1, head_dim=4, layer_types=tuple(layer_types), **kw)


S, F, C = "sliding_attention", "full_attention", "chunked_attention"


def test_every_layer_alike_is_one_group_with_a_slot_per_layer():
    g = kv_groups(config(5))
    assert g.windows == (None,) and g.group_of_layer == (0,) * 5 and g.slot_of_layer == (0, 1, 2, 3, 4) and g.num_slots == 5
    assert kv_groups(config(3, sliding_window=8)).windows == (8,)  # Mistral: one sliding group
    # SmolLM3's NoPE layers change the RoPE table, not what a layer keeps: still one group
    assert kv_groups(config(8, nope_layers=(3, 7))).windows == (None,)


def test_alternating_layers_make_two_groups_sharing_each_slot():
    g = kv_groups(config(6, [S, F] * 3, sliding_window=128))  # Gemma 2, GPT-OSS
    assert g.windows == (128, None)
    assert g.group_of_layer == (0, 1) * 3 and g.slot_of_layer == (0, 0, 1, 1, 2, 2) and g.num_slots == 3


def test_gemma3s_pattern_makes_six_equal_groups_and_a_short_tail():
    g = kv_groups(config(62, ([S] * 5 + [F]) * 10 + [S, S], sliding_window=1024))
    assert g.windows == (1024,) * 5 + (None,)
    assert g.num_slots == 11  # ten whole periods and the two layers after them
    assert g.slot_of_layer[:12] == (0,) * 6 + (1,) * 6 and g.slot_of_layer[60:] == (10, 10)
    assert g.group_of_layer[60:] == (0, 1)
    # no two layers share a (group, slot): every layer has its own storage
    assert len(set(zip(g.group_of_layer, g.slot_of_layer))) == 62


def test_a_sequence_holds_its_window_in_a_sliding_group():
    # keys from position n - 1024 + 1 on, in pages of 16: at most 65 pages, or fewer when shorter
    assert window_pages(1024, 32768, 16) == 65 and window_pages(1024, 100, 16) == 7
    assert window_pages(None, 32768, 16) == 2048
    # Gemma 3 at 32k tokens: each page id holds 11 layers (slots); a full-attention cache holds 62
    # layers of every page: 21 % of it
    g = kv_groups(config(62, ([S] * 5 + [F]) * 10 + [S, S], sliding_window=1024))
    assert g.pages_held(32768, 16) == 2048 + 5 * 65
    assert round(g.pages_held(32768, 16) * g.num_slots / (62 * 2048), 2) == 0.21


def test_llama4s_chunked_layers_make_a_group_each_beside_the_full_one():
    """Llama 4: three chunked RoPE layers, then a full NoPE one; a chunked group holds at most a
    chunk and the step's tokens, like a window of the chunk's size."""
    g = kv_groups(config(48, [C, C, C, F] * 12, attention_chunk_size=8192, nope_layers=tuple(range(3, 48, 4))))
    assert g.windows == (Chunk(8192),) * 3 + (None,) and g.num_slots == 12
    assert g.pages_held(32768, 16) == 2048 + 3 * window_pages(8192, 32768, 16)
    # the next query's chunk starts at a multiple of 8192: nothing before it is read again
    assert [first_kept(Chunk(8192), n) for n in (0, 8191, 8192, 20000)] == [0, 0, 8192, 16384]
    assert [first_kept(6, n) for n in (3, 10)] == [0, 5] and first_kept(None, 10) == 0


def test_gemma4s_groups_of_two_shapes_share_the_pool_with_page_factors_and_its_shared_layers_read_their_source():
    """Gemma-4-31B: 16 sliding KV heads of 256 against 4 global ones of 512 (half the row), so a
    global page holds twice the tokens (on a TPU pool as two lane blocks of page_size tokens, which
    its page-table row names); on 8 tensor shards the global heads are replicated and the rows per
    device agree. A KV-shared layer (E2B's last ones) takes the group and slot of the last earlier
    layer of its kind."""
    import jax.numpy as jnp

    from jaxinfer.aot.presets import read_model_config
    from jaxinfer.models.decoder import lane_block_table
    from jaxinfer.ops.kv_cache import page_factors

    g = kv_groups(read_model_config("gemma-4-31b"))
    assert g.windows == (1024,) * 5 + (None,) and g.shapes == ((16, 256),) * 5 + ((4, 512),) and g.num_slots == 10
    assert page_factors(g) == page_factors(g, tp=4) == (1,) * 5 + (2,)
    assert page_factors(g, tp=8) == page_factors(g, tp=8, combined=True) == (1,) * 6
    assert page_factors(g, tp=4, combined=True) == (1,) * 5 + (2,)
    # a row of group pages 5, 9, 0 (scratch) of 2 * page_size tokens: lane blocks 10, 11, 18, 19, 0, 1 (width kept)
    assert lane_block_table(jnp.array([[5, 9, 0, 0, 0]]), 2).tolist() == [[10, 11, 18, 19, 0]]

    e2b_like = config(7, [S, S, F] * 2 + [S], sliding_window=8, kv_shared_layers=3)  # layers 4, 5, 6 read 3, 2, 3
    g = kv_groups(e2b_like)
    assert [e2b_like.kv_source(i) for i in range(7)] == [0, 1, 2, 3, 3, 2, 3]
    assert g.group_of_layer[4:] == (g.group_of_layer[3], g.group_of_layer[2], g.group_of_layer[3])
    assert g.slot_of_layer[4:] == (g.slot_of_layer[3], g.slot_of_layer[2], g.slot_of_layer[3])
