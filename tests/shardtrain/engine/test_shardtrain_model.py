"""The Llama decoder: parity with transformers' LlamaForCausalLM, config mapping, padding."""

from __future__ import annotations

import pytest
import torch
from shardtrain_helpers import tiny_config

from shardtrain import ConfigError, Llama, LlamaConfig, Partition, build_stage, canonical_parameter_names
from shardtrain.engine.model import rotary_tables

transformers = pytest.importorskip("transformers")


def _hf_model(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).eval()
    result = model.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    return model


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("head_dim", [None, 8])
def test_logits_match_transformers(tied: bool, head_dim: int | None) -> None:
    base = tiny_config(tied=tied)
    config = LlamaConfig(**{**base.__dict__, "head_dim": head_dim, "rope_theta": 500.0})
    ours = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=11).eval()
    weights = {n: p.detach().clone() for n, p in ours.named_parameters()}
    theirs = _hf_model(config, weights)
    assert [n for n, _ in theirs.named_parameters()] == list(canonical_parameter_names(config))
    tokens = torch.randint(0, config.vocab_size, (3, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(tokens)  # (B, T, V)
        b = theirs(input_ids=tokens).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_config_round_trips_through_transformers() -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=123.0,
        max_position_embeddings=96,
        tie_word_embeddings=True,
        head_dim=16,
    )
    hf = transformers.LlamaConfig(**config.to_hf_dict())
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == config
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config


def test_config_defaults_follow_transformers() -> None:
    config = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert (config.num_key_value_heads, config.head_dim) == (2, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "only default rotary"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "only default rotary"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "bias"),
        ({"model_type": "mistral"}, "not a Llama config"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 0}, "positive int"),
        ({"hidden_size": 50, "head_dim": None}, "not divisible"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ],
)
def test_config_rejects_unsupported_or_invalid(change: dict, message: str) -> None:
    d = tiny_config().to_hf_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf_dict(d)


def test_config_missing_field_is_a_config_error() -> None:
    d = tiny_config().to_hf_dict()
    del d["vocab_size"]
    with pytest.raises(ConfigError, match="incomplete"):
        LlamaConfig.from_hf_dict(d)


def test_right_padding_does_not_change_earlier_logits() -> None:
    config = tiny_config()
    model = build_stage(config, Partition.even(4, 1), 0, seed=2).eval()
    tokens = torch.randint(1, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([tokens, torch.zeros(1, 7, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded)[:, :9], model(tokens), rtol=1e-6, atol=1e-6)


def test_pieces_compose_to_the_whole_model() -> None:
    config = tiny_config(tied=False)
    whole = build_stage(config, Partition.even(4, 1), 0, seed=4).eval()
    partition = Partition.from_boundaries([1, 3], 4)
    pieces = [build_stage(config, partition, s, seed=4).eval() for s in range(3)]
    tokens = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cos, sin = rotary_tables(config, tokens.shape[1], "cpu")
        h = pieces[0].embed(tokens)
        for piece in (*pieces,):
            for i in piece.layer_range:
                h = piece.layer(i, h, cos, sin)
        assert torch.equal(pieces[0].logits(h), whole(tokens))


def test_piece_guards() -> None:
    config = tiny_config(tied=True)
    with pytest.raises(ConfigError, match="tied output head"):
        Llama(config, layers=range(0, 1), embedding=False, head=True)
    with pytest.raises(ConfigError, match="contiguous range"):
        Llama(config, layers=range(2, 9))
    with torch.device("meta"):
        piece = Llama(config, layers=range(1, 2), embedding=False, head=False)
    with pytest.raises(ConfigError, match="whole model"):
        piece(torch.zeros(1, 2, dtype=torch.int64, device="meta"))
