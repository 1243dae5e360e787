"""Tiny models with seeded random weights for a real vLLM engine, written offline.

``make_model(path, kind="llama", seed=0)`` writes a Hugging Face model directory
(``config.json`` + ``model.safetensors``, bfloat16) with transformers, no hub, and
returns ``path``. The weights are drawn with ``initializer_range=0.2`` so that the
model is "sharp": greedy tokens depend on the whole prompt (with the default 0.02 the
logprobs are near uniform and it repeats one token, and equal tokens prove little).

Idempotent and atomic: an existing complete directory is kept (its name is part of
the cache key, so the same path must mean the same model every time); a new one is
written to a temporary sibling and renamed into place. The seed and the kind are
stamped in the directory: asking for a different model at an existing path raises.

Kinds:

* ``llama``: 4 layers, hidden 256, 4 heads, 2 KV heads (head size 64), vocab 2048.
* ``llama_long``: ``llama`` with positions up to 32768 (benchmarks/vllm_e2e.py: 16k
  prompts; the same weights for a seed, another model directory).
* ``deepseek_mla``: DeepSeek-V3 shaped, MLA attention (``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64: one latent "head" of 576 per token and layer, the only
  width vLLM's CPU MLA backend takes), 2 layers, hidden 256, 4 heads, every layer
  dense (``first_k_dense_replace`` = layers: no MoE kernel needed).

``python tiny_model.py PATH [KIND] [SEED]`` writes one and prints its path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("llama", "llama_long", "deepseek_mla")
_STAMP = "lmcache_mp_tiny_model.json"


def _config(kind: str) -> Any:
    if kind in ("llama", "llama_long"):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
            initializer_range=0.2,
            max_position_embeddings=32768 if kind == "llama_long" else 4096,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "deepseek_mla":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=2048, hidden_size=256, intermediate_size=512,
            moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=2,  # = num_hidden_layers: dense MLPs only
            # vLLM's CPU MLA kernels take only DeepSeek's latent width: 512 + 64.
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=64, v_head_dim=64, initializer_range=0.2,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False, num_mtp_layers=0)
    raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")


#: Bumped when a kind's config changes: a directory of an older version is refused.
_VERSIONS = {"llama": 1, "llama_long": 1, "deepseek_mla": 2}


def _stamp(kind: str, seed: int) -> dict[str, Any]:
    return {"kind": kind, "seed": seed, "version": _VERSIONS.get(kind, 0)}


def make_model(path: str, *, kind: str = "llama", seed: int = 0) -> str:
    """Write (once) a tiny random-weight model of ``kind`` at ``path``; return ``path``."""
    path = os.path.abspath(path)
    want = _stamp(kind, seed)
    stamp_path = os.path.join(path, _STAMP)
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            have = json.load(f)
        if have != want:
            raise ValueError(f"{path} holds {have}, not {want}")
        return path

    import torch
    from transformers import AutoModelForCausalLM

    config = _config(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, _STAMP), "w") as f:
            json.dump(want, f)
        try:
            os.rename(tmp, path)
        except OSError:
            # Another process won the race (the target now exists): keep its copy if
            # it is the same model.
            if not os.path.exists(stamp_path):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return make_model(path, kind=kind, seed=seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


if __name__ == "__main__":
    args = sys.argv[1:]
    if not 1 <= len(args) <= 3:
        sys.exit("usage: tiny_model.py PATH [KIND] [SEED]")
    print(make_model(args[0], kind=args[1] if len(args) > 1 else "llama",
                     seed=int(args[2]) if len(args) > 2 else 0))
