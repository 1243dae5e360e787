#!/usr/bin/env python3
"""Record the KV-cache views vLLM's OWN allocator makes, for tests without vLLM.

    .venv-vllm/bin/python tools/gen_vllm_kv_layouts.py [--out fixtures/vllm/kv_layouts.json]

For each KV-cache layout vLLM 0.32 can resolve for attention (``LBHNC``, ``LBNHC``,
``BLHNC``, ``BLNHC``) and for an MLA spec, in a tiny geometry (``"geometry": "tiny"``,
the offline tests) and in ``scripts/gpu_check.py``'s (``"gpu_check"``: 8 layers, 8 KV
heads of 128, blocks of 16, bfloat16, the blocks its default sizes use; layer-compact
``LBNHC`` and blocks-first ``BLHNC``), this resolves the layout with vLLM's
``resolve_kv_cache_layout`` (``VLLM_KV_CACHE_LAYOUT`` set, as a user would), sizes the
cache with ``get_kv_cache_configs`` and allocates it with ``allocate_kv_cache`` on the
CPU, then writes what each per-layer view is: shape, strides and storage offset (in
elements), dtype, and the backing allocation's size. The offline CUDA tests build
their fake CUDA tensors from these (the same views vLLM hands a connector), and
``scripts/gpu_check.py`` rebuilds them on a GPU with ``torch.as_strided``.

    .venv-vllm-0.34.0/bin/python tools/gen_vllm_kv_layouts.py --extensible \
        [--out fixtures/vllm/kv_layouts_extensible.json]

vLLM 0.34's *extensible* KV cache (its default on CUDA when the connector's
``kv_cache_access`` allows it) in the block-compact layouts it allows a connector
(``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``; tiny geometry, and MLA): the layout
resolved with ``enable_extensible_kv_cache`` on, the capacity sized by
``get_kv_cache_configs``, the layers' regions padded to the 2 MiB VMM granule by
``pad_kv_cache_segments``, ``ExtensibleKVCache`` reserving the capacity and committing
the final block count, and the per-layer views ``committed_views`` hands the connector
in ``extend_kv_cache``: vLLM's own code, over host memory where the GPU has VMM
(``tests/integrations/vllm/extensible.py``'s ``ExtensibleTensor``; the geometry is
vLLM's, not the memory's). Each layer: shape, strides, storage offset (elements, in
its own storage: one per segment), its byte offset in the reservation and its
storage's bytes; and the reservation's size, the capacity and the final block count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: name -> (layers, KV heads, head size, block size, blocks, MLA latent, dtype)
GEOMETRIES = {"tiny": (2, 2, 8, 16, 40, 24, "float16"),
              # gpu_check.py's defaults: sizes 256 and 4096 tokens -> 552 blocks of 16
              "gpu_check": (8, 8, 128, 16, 552, 576, "bfloat16")}


def _model_dir(layers: int, heads: int) -> str:
    path = Path(tempfile.gettempdir()) / f"lmcache_mp_vllm_layouts_model_{layers}_{heads}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "num_hidden_layers": layers, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 1024, "torch_dtype": "float16"}))
    return str(path)


#: Every layout vLLM resolves from: the recording asks for VLLM_KV_CACHE_LAYOUT's.
EVERY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]


def _config_and_specs(geometry: str, mla: bool, blocks: int) -> tuple[Any, Any, dict[str, Any]]:
    """vLLM's own config for ``geometry`` (``blocks`` GPU blocks), the attention spec of
    every layer, and the specs by layer name, as the model runner builds them."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    layers, heads, head_size, block, _, latent, dtype_name = GEOMETRIES[geometry]
    dtype = getattr(torch, dtype_name)
    cfg = VllmConfig(
        model_config=ModelConfig(model=_model_dir(layers, heads), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=256),
        cache_config=CacheConfig(block_size=block, num_gpu_blocks_override=blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_model_len=256,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"))
    spec = (MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=latent,
                             dtype=dtype) if mla else
            FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size,
                              dtype=dtype))
    return cfg, spec, {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


def record(geometry: str, layout: str | None, mla: bool) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache

    layers, heads, head_size, block, blocks, latent, dtype_name = GEOMETRIES[geometry]
    if layout is None:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    else:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    cfg, spec, specs = _config_and_specs(geometry, mla, blocks)
    names = list(specs)
    with set_current_vllm_config(cfg):
        resolved = resolve_kv_cache_layout(cfg, [EVERY_LAYOUT], list(specs.values()))
        kcc = get_kv_cache_configs(cfg, [specs], [spec.page_size_bytes * blocks * layers])[0]
    views = allocate_kv_cache(kcc, torch.device("cpu"), resolved)
    base = views[names[0]].untyped_storage()
    return {
        "vllm": vllm.__version__, "geometry": geometry, "layout": resolved.name,
        "mla": mla, "num_blocks": kcc.num_blocks, "block_size": block,
        "heads": 1 if mla else heads, "head_size": latent if mla else head_size,
        "dtype": dtype_name, "alloc_bytes": base.nbytes(),
        "layers": [{"name": n, "shape": list(t.shape), "stride": list(t.stride()),
                    "storage_offset": t.storage_offset()} for n, t in views.items()],
    }


def record_extensible(layout: str, mla: bool) -> dict[str, Any]:
    """vLLM 0.34's extensible cache's committed per-layer views (module docstring)."""
    import copy

    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"
                           / "vllm"))
    import extensible

    layers, heads, head_size, block, blocks, latent, dtype_name = GEOMETRIES["tiny"]
    os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    capacity = 2 * blocks  # reserved; the final count, committed after warm-up: blocks
    cfg, spec, specs = _config_and_specs("tiny", mla, capacity)
    cfg.cache_config.enable_extensible_kv_cache = True
    with set_current_vllm_config(cfg):
        resolved = resolve_kv_cache_layout(cfg, [EVERY_LAYOUT], list(specs.values()))
        kcc = get_kv_cache_configs(cfg, [specs], [spec.page_size_bytes * capacity * layers],
                                   get_global_kv_cache_groups(cfg, [specs]))[0]
    padded, cache = extensible.allocate(kcc, resolved, 2)
    cache.commit(blocks, shrink=True)
    final = copy.copy(padded)
    final.num_blocks = blocks
    views = cache.committed_views(final, resolved)
    base = cache.buffer.base_ptr
    return {
        "vllm": vllm.__version__, "geometry": "tiny", "layout": resolved.name, "mla": mla,
        "extensible": True, "capacity_blocks": kcc.num_blocks, "num_blocks": blocks,
        "granule": extensible.GRANULE, "reservation_bytes": cache.size,
        "block_size": block, "heads": 1 if mla else heads,
        "head_size": latent if mla else head_size, "dtype": dtype_name,
        "layers": [{"name": n, "shape": list(t.shape), "stride": list(t.stride()),
                    "storage_offset": t.storage_offset(),
                    "offset_bytes": t.untyped_storage().data_ptr() - base,
                    "storage_bytes": t.untyped_storage().nbytes()}
                   for n, t in views.items()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--extensible", action="store_true",
                    help="vLLM 0.34's extensible cache (run under .venv-vllm-0.34.0)")
    args = ap.parse_args()
    if args.extensible:
        args.out = args.out or "fixtures/vllm/kv_layouts_extensible.json"
        out = [record_extensible(layout, False)
               for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")]
        out.append(record_extensible("LBNHC", True))
    else:
        args.out = args.out or "fixtures/vllm/kv_layouts.json"
        out = [record("tiny", layout, False)
               for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")]
        out.append(record("tiny", None, True))
        out += [record("gpu_check", layout, False) for layout in ("LBNHC", "BLHNC")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} layouts to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
