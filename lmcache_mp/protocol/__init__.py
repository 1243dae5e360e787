"""The sans-I/O protocol core: operation tables per server family, wire types, codec.

Nothing in this package opens a socket; see :mod:`lmcache_mp.transport` for that.
"""

from __future__ import annotations

from ..errors import ProtocolMismatch
from . import v0_5_3, v0_5_5, v0_5_6, v0_5_7
from .codec import decode_reply, encode_request
from .operations import Operation, Payload, Profile

__all__ = [
    "PROFILES",
    "get_profile",
    "Operation",
    "Payload",
    "Profile",
    "encode_request",
    "decode_reply",
]

PROFILES: dict[str, Profile] = {
    p.name: p for p in (v0_5_3.PROFILE, v0_5_5.PROFILE, v0_5_6.PROFILE, v0_5_7.PROFILE)
}
# Releases that share a family's wire format map to that family.
_RELEASE_TO_PROFILE = {rel: p.name for p in PROFILES.values() for rel in p.releases}


def get_profile(name: str) -> Profile:
    """The profile for a family or release name ("0.5.3", "0.5.4", ...)."""
    family = _RELEASE_TO_PROFILE.get(name, name)
    try:
        return PROFILES[family]
    except KeyError:
        known = ", ".join(sorted(_RELEASE_TO_PROFILE))
        raise ProtocolMismatch(
            f"no protocol profile for LMCache {name!r}; this client speaks {known}"
        ) from None
