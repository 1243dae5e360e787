"""The compatibility table (release x feature), computed from the profiles.

README.md embeds its output between ``<!-- compat:start -->`` and
``<!-- compat:end -->``; a test keeps the two equal (``make readme`` rewrites it).
"""

from __future__ import annotations

from . import PROFILES
from .operations import Profile

__all__ = ["compatibility_table"]


def _wrapper_format(p: Profile) -> str:
    return p.wrappers.name


def _ranges(ids: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def compatibility_table() -> str:
    profiles = list(PROFILES.values())
    rows: list[tuple[str, list[str]]] = [
        ("LMCache releases", [", ".join(p.releases) for p in profiles]),
        ("operations spoken", [str(len(p.operations)) for p in profiles]),
        ("op ids sent", [_ranges([op.id for op in p.operations.values()]) for p in profiles]),
        ("GET_EXPERIMENTAL id", [str(p.op("GET_EXPERIMENTAL").id) for p in profiles]),
        ("QUERY_PREFETCH_LOOKUP_HITS", [_yes(p.has("QUERY_PREFETCH_LOOKUP_HITS"))
                                        for p in profiles]),
        ("CLEAR payload", ["[force]" if p.op("CLEAR").payloads else "none" for p in profiles]),
        ("key fields", [str(len(p.key_type.__struct_fields__)) for p in profiles]),
        ("num_kv_readers in the key", [_yes("num_kv_readers" in p.key_type.__struct_fields__)
                                       for p in profiles]),
        ("token ids in the key", ["`token_bytes` (packed big-endian uint32)"
                                  if "token_bytes" in p.key_type.__struct_fields__
                                  else "`token_ids` (list of ints)" for p in profiles]),
        ("FREE_LOOKUP_LOCKS / PREPARE_STORE payloads",
         [f"{len(p.op('FREE_LOOKUP_LOCKS').payloads)} / {len(p.op('PREPARE_STORE').payloads)}"
          for p in profiles]),
        ("KV-cache wrapper format", [_wrapper_format(p) for p in profiles]),
        ("CUDA wrapper forms", [", ".join(f"`{f}`" for f in p.wrappers.cuda)
                                for p in profiles]),
        ("CUDA VMM memory (`cuda_vmm`)", [
            "no" if p.wrappers.vmm is None else
            "kinds: " + ", ".join(p.wrappers.vmm_kinds) + " (no server receives a POSIX fd)"
            for p in profiles]),
    ]
    head = "| feature | " + " | ".join(f"`{p.name}` profile" for p in profiles) + " |"
    sep = "|---|" + "---|" * len(profiles)
    body = [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join([head, sep, *body])


if __name__ == "__main__":
    print(compatibility_table())
