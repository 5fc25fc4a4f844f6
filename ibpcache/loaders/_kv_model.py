"""What the transformers adapter knows of a decoder's config and, for sparse mode, its insides (no transformers
import at module level).

:func:`decoder_geometry` reads the KV geometry from a config and refuses, at construction, any config the cache
cannot serve (:class:`~ibpcache.errors.UnsupportedModelError`), rather than failing later with a shape error.

Sparse mode speculates layer j's query from layer j-1's input, so it must reproduce the query the layer computes:
the layer's input norm, query projection, optional per-head ``q_norm`` and the model module's RoPE
(:func:`project_query`), and find the decoder layers to hook (:func:`decoder_layers`). It also translates
transformers' 4-D attention masks to and from the engine's selection (:func:`valid_from_mask`, :func:`gather_mask`).
The engine (``ibpcache.cache.kv_select``, ``kv_graph``) only ever sees query states and token indices.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import torch

from ..errors import InvalidArgumentError, UnsupportedModelError

__all__ = ["decoder_geometry", "project_query", "decoder_layers", "valid_from_mask", "gather_mask"]

_ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling")
"""Config fields of rotary position embeddings (transformers 5.x: ``rope_parameters``; the others: older configs)."""


def _positive_int(cfg: Any, field: str, value: Any) -> int:
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise UnsupportedModelError(f"{type(cfg).__name__}.{field}: expected a positive int, got {value!r} "
                                    "(IBPOffloadedCache reads the decoder's KV geometry from its config)")
    return n


def decoder_geometry(config: Any, mode: str) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim) of the decoder ``config`` describes, for ``IBPOffloadedCache`` in
    ``mode``; raises :class:`~ibpcache.errors.UnsupportedModelError` naming the problem for a config it cannot serve.

    What the cache relies on: a decoder-only model (it holds self-attention K/V, no cross-attention or encoder
    states), every layer full attention (no sliding window: the cache keeps and fetches every token), a geometry in
    the config (``num_hidden_layers``, ``num_attention_heads``, optional ``num_key_value_heads`` dividing it,
    ``head_dim`` or ``hidden_size`` divisible by the heads), and for sparse mode rotary position embeddings (the
    speculated query is rotated with the model's RoPE tables).
    """
    name = type(config).__name__
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False) or getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model: IBPOffloadedCache holds the self-attention "
                                    "K/V of a decoder-only model (no cross-attention cache)")
    if getattr(cfg, "is_decoder", None) is False:  # transformers 5 configs have the field only where it can be set
        raise UnsupportedModelError(f"{name} describes an encoder (is_decoder=False): IBPOffloadedCache serves "
                                    "decoder-only generation")
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise UnsupportedModelError(f"IBPOffloadedCache supports full-attention decoders only, got layer types "
                                    f"{set(types)}")
    if types is None and getattr(cfg, "sliding_window", None) is not None \
            and getattr(cfg, "use_sliding_window", True):
        raise UnsupportedModelError("IBPOffloadedCache supports full-attention decoders only (config has a "
                                    "sliding_window)")
    layers = _positive_int(cfg, "num_hidden_layers", getattr(cfg, "num_hidden_layers", None))
    heads = _positive_int(cfg, "num_attention_heads", getattr(cfg, "num_attention_heads", None))
    kv_heads = _positive_int(cfg, "num_key_value_heads", getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"{name}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None:
        hidden = _positive_int(cfg, "hidden_size", getattr(cfg, "hidden_size", None))
        if hidden % heads:
            raise UnsupportedModelError(f"{name}: hidden_size {hidden} is not a multiple of {heads} heads and the "
                                        "config gives no head_dim")
        head_dim = hidden // heads
    head_dim = _positive_int(cfg, "head_dim", head_dim)
    if mode == "sparse" and all(getattr(cfg, f, None) is None for f in _ROPE_FIELDS):
        raise UnsupportedModelError(f"{name} has no rotary position embeddings ({', '.join(_ROPE_FIELDS)}): sparse "
                                    "mode speculates each layer's query with the model's RoPE (use mode='dense')")
    return layers, heads, kv_heads, head_dim


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _same_code(a: object, b: object) -> bool:
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return ca is not None and cb is not None and ca.co_code == cb.co_code and ca.co_names == cb.co_names


def _rope_is_llamas(module: object) -> bool:
    """True when a model module's ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's (same bytecode): its
    query rotation is then exactly ``q * cos + rotate_half(q) * sin`` and the key half can be skipped."""
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:
        return False
    rope = getattr(module, "apply_rotary_pos_emb", None)
    rope = getattr(rope, "__wrapped__", rope)
    ref = getattr(llama.apply_rotary_pos_emb, "__wrapped__", llama.apply_rotary_pos_emb)
    return _same_code(rope, ref) and _same_code(getattr(module, "rotate_half", None), llama.rotate_half)


_LLAMA_ROPE: dict = {}  # module name -> _rope_is_llamas (checked once per model module)


def project_query(decoder_layer: torch.nn.Module, hidden: torch.Tensor,
                  position_embeddings: "tuple[torch.Tensor, torch.Tensor]") -> torch.Tensor:
    """Query states [B, Hq, T, D] that ``decoder_layer`` would compute from residual input ``hidden``.

    Uses the layer's own norm, projection, optional per-head ``q_norm`` (Qwen3) and the model module's
    ``apply_rotary_pos_emb`` when it has one, so RoPE variants of Llama-family models match. When that function
    is Llama's, only the query half of it is computed (the same operations, so the same bits, half the kernels).
    """
    attn = decoder_layer.self_attn
    head_dim = attn.head_dim
    x = decoder_layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(*hidden.shape[:-1], -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    name = type(attn).__module__
    module = sys.modules.get(name)
    if name not in _LLAMA_ROPE:
        _LLAMA_ROPE[name] = _rope_is_llamas(module)
    rope = getattr(module, "apply_rotary_pos_emb", None)
    if rope is not None and not _LLAMA_ROPE[name]:
        q, _ = rope(q, q, cos, sin)
        return q
    return (q * cos.unsqueeze(1)) + (_rotate_half(q) * sin.unsqueeze(1))


def valid_from_mask(mask: "torch.Tensor | None", n_past: int) -> "torch.Tensor | None":
    """bool [B, n_past]: which cached tokens the single decode query may attend (None: all of them).

    Accepts transformers' 4-D masks for one query row: boolean (True = attend) or additive float (0 = attend).
    """
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] < n_past + 1:
        raise InvalidArgumentError(f"sparse KV selection expects a [B, 1|H, 1, >= {n_past + 1}] attention mask for one "
                                   f"decode query, got shape {tuple(mask.shape)}")
    row = mask[:, 0, 0, :n_past]
    return row if row.dtype == torch.bool else row == 0


def gather_mask(mask: "torch.Tensor | None", idx: torch.Tensor, n_past: int, num_heads: int) -> "torch.Tensor | None":
    """The attention mask restricted to the selected tokens plus the current one: [B, Hq, 1, k + 1].

    ``idx`` is [B, Hkv, k]. The current token sits at column ``n_past`` of the full mask and last in the
    returned K/V. Masks stay in their dtype (bool or additive float) so every attention backend reads them.
    """
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] < n_past + 1:
        raise InvalidArgumentError(f"sparse KV selection expects a [B, 1|H, 1, >= {n_past + 1}] attention mask for one "
                                   f"decode query, got shape {tuple(mask.shape)}")
    b, hkv, k = idx.shape
    groups = num_heads // hkv
    cur = torch.full((b, hkv, 1), n_past, dtype=idx.dtype, device=idx.device)
    cols = torch.cat((idx, cur), dim=-1).repeat_interleave(groups, dim=1)  # [B, Hq, k + 1]
    rows = mask[:, :, 0, :].expand(b, num_heads, mask.shape[-1]) if mask.shape[1] == 1 else mask[:, :, 0, :]
    return rows.gather(-1, cols.to(mask.device)).unsqueeze(2)


def decoder_layers(model: torch.nn.Module) -> "torch.nn.ModuleList":
    """The decoder layer list of a Llama-family causal LM (``model.model.layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__} (expected "
                                    ".model.layers): sparse mode hooks them")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj") or not hasattr(layer, "input_layernorm"):
            raise UnsupportedModelError(f"decoder layer {i} of {type(model).__name__} is not Llama-like "
                             "(needs self_attn.q_proj and input_layernorm) : sparse mode cannot speculate its query")
    return layers
