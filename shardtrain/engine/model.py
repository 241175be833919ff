"""A compact Llama decoder in plain PyTorch, with Hugging Face's parameter names.

Adapted from the structure of `transformers`' `modeling_llama.py` (RMSNorm computed in
float32, default rotary embeddings with `rope_theta`, grouped-query causal attention,
SwiGLU MLP, optional tied input/output embeddings; no bias, no dropout) so that the tensors
of a `LlamaForCausalLM` checkpoint load by name and produce the same logits.

The model knows nothing about parallelism. A `Llama` can be built as a *piece*: the
embedding, any contiguous range of decoder layers, and the final norm with the output
head, each optional. The whole model is simply the piece that has all of them; a pipeline
stage is a piece that has only what its slot owns. Parameter names do not depend on which
pieces exist (`model.layers.7...` is called that wherever layer 7 lives).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.errors import ConfigError

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "KVCache",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "Llama",
    "rotary_tables",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shape, with Hugging Face `LlamaConfig` field names and defaults."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None means multi-head attention (= num_attention_heads)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None means hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if value is None and name in ("num_key_value_heads", "head_dim"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"LlamaConfig.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        assert self.num_key_value_heads is not None and self.head_dim is not None
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive and finite, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive and finite, got {self.rope_theta!r}")

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def dim_per_head(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a Hugging Face `config.json` dict (`LlamaConfig(**d)` accepts it)."""
        d: dict[str, Any] = dataclasses.asdict(self)
        d.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            rope_scaling=None,
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Read the fields this model supports from a Hugging Face Llama config dict.

        Features this model does not implement (biases, non-SiLU activations, scaled RoPE)
        are rejected rather than silently ignored, since ignoring them changes the logits.
        """
        if d.get("model_type", "llama") != "llama":
            raise ConfigError(f"not a Llama config: model_type={d.get('model_type')!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"only hidden_act='silu' is supported, got {d.get('hidden_act')!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError("attention_bias and mlp_bias are not supported")
        rope_theta = d.get("rope_theta")
        # transformers >= 5 nests RoPE settings under rope_parameters; older ones use rope_scaling.
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.get(key)
            if rope is not None and not isinstance(rope, dict):
                raise ConfigError(f"{key} must be an object or null, got {_shown(rope)}")
            if rope:
                if rope.get("rope_type", rope.get("type", "default")) != "default":
                    raise ConfigError(f"only default rotary embeddings are supported, got {key}={_shown(rope)}")
                rope_theta = rope.get("rope_theta", rope_theta)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields and k != "rope_theta"}
        if rope_theta is not None:
            kwargs["rope_theta"] = _real("rope_theta", rope_theta)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise ConfigError(f"incomplete Llama config: {exc}") from exc


def _shown(value: Any) -> str:
    """A config value as an error message shows it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _real(name: str, value: Any) -> float:
    """A config's real number as a float: an int or a float (not a bool), finite once converted."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {_shown(value)}")
    try:
        x = float(value)
    except OverflowError:  # an integer of hundreds of digits
        x = math.inf
    if not math.isfinite(x):
        raise ConfigError(f"{name} must be finite, got {_shown(value)}")
    return x


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's `LlamaRMSNorm`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)  # (..., 1)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


def rotary_tables(
    config: LlamaConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of the default RoPE for positions 0..seq_len-1, each (T, D).

    Computed on the fly (not a buffer) so that a piece built on the meta device has nothing
    to materialise but its parameters, and so every stage derives bitwise the same table.
    """
    dim = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """One attention layer's keys and values so far, for incremental decoding.

    `past` is the number of cached positions; new positions are appended by `extend`.
    Keys are stored after rotary embedding, as HF's cache does.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, Hkv, past, D)
        self.v: torch.Tensor | None = None  # (B, Hkv, past, D)

    @property
    def past(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.kv_heads
        self.head_dim = config.dim_per_head
        c, d = config.hidden_size, config.dim_per_head
        self.q_proj = nn.Linear(c, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(c, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(c, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, c, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """`cos`/`sin` are the tables of x's positions; with `cache`, x follows the cached positions."""
        b, t, _ = x.shape  # (B, T, C)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        past = 0
        if cache is not None:
            past = cache.past
            k, v = cache.extend(k, v)  # (B, Hkv, past + T, D)
        if self.n_kv != self.n_heads:
            # Each key/value head serves n_heads // n_kv consecutive query heads (HF's repeat_kv).
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)  # (B, H, T, D)
        # Causal masking alone handles right padding: a real token never attends to a later
        # (padding) position, so padding cannot change the loss on real tokens.
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        else:  # query i sits at position past + i and sees keys 0..past + i
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)  # (T, past + T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T, C)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm residual block: attention then MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache)  # (B, T, C)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, C)


class _Body(nn.Module):
    """Holds the `model.` prefix of Hugging Face's names: embed_tokens, layers, norm."""

    def __init__(self, config: LlamaConfig, layers: range, embedding: bool, head: bool) -> None:
        super().__init__()
        if embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # A dict keyed by the global layer index keeps `model.layers.{i}` names for any range.
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in layers})
        if head:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """A Llama decoder, or the piece of one that holds `embedding`, `layers` and `head`.

    `head` means the final norm and the output projection (`lm_head`, or the embedding
    matrix when `tie_word_embeddings`, in which case the piece must also hold the
    embedding). Use `embed`, `layer` and `logits` to run a piece; `forward` runs a
    complete model.
    """

    def __init__(
        self, config: LlamaConfig, *, layers: range | None = None, embedding: bool = True, head: bool = True
    ) -> None:
        super().__init__()
        layers = range(config.num_hidden_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= config.num_hidden_layers:
            raise ConfigError(f"layers must be a contiguous range inside 0..{config.num_hidden_layers}, got {layers}")
        if head and config.tie_word_embeddings and not embedding:
            raise ConfigError("a piece with a tied output head must also hold the embedding")
        self.config = config
        self.layer_range = layers
        self.has_embedding = embedding
        self.has_head = head
        self.model = _Body(config, layers, embedding, head)
        if head and not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) hidden states."""
        return self.model.embed_tokens(tokens)

    def layer(
        self, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Apply decoder layer `index` (a global index this piece holds) to (B, T, C)."""
        return self.model.layers[str(index)](h, cos, sin, cache)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, C) last hidden states -> (B, T, V) logits, through the final norm and head."""
        h = self.model.norm(h)
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(h, weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) logits; only for a piece that holds everything."""
        if not (self.has_embedding and self.has_head and len(self.layer_range) == self.config.num_hidden_layers):
            raise ConfigError("forward() needs the whole model; run a piece with embed/layer/logits")
        h = self.embed(tokens)
        cos, sin = rotary_tables(self.config, tokens.shape[1], h.device, h.dtype)
        for i in self.layer_range:
            h = self.layer(i, h, cos, sin)
        return self.logits(h)
