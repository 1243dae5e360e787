"""Small contracts of the sans-I/O core and the public key that the end-to-end tests do
not pin down: reply frame counts, the readers argument, wrapper blobs, descriptor
defaults, key and block-id validation edge cases."""

from __future__ import annotations

import array

import msgspec
import numpy as np
import pytest

from lmcache_mp import CacheKey, InvalidArgument, ProtocolMismatch
from lmcache_mp.protocol import decode_reply, get_profile
from lmcache_mp.protocol.operations import kv_readers
from lmcache_mp.protocol.types import EngineGroupInfo, WrapperBlob
from lmcache_mp.protocol.wrappers import cuda_raw_descriptor
from lmcache_mp.session.blocks import TransferLayout, normalize_block_ids

_enc = msgspec.msgpack.encode


def key(**kw: object) -> CacheKey:
    args: dict[str, object] = dict(model_name="m", world_size=1, worker_id=0,
                                   token_ids=list(range(512)), start=0, end=512,
                                   request_id="r")
    args.update(kw)
    return CacheKey(**args)  # type: ignore[arg-type]


def test_a_reply_with_an_extra_frame_is_refused() -> None:
    op = get_profile("0.5.3").op("GET_CHUNK_SIZE")
    assert decode_reply(op, [op.type_frame, _enc(256)]) == 256
    with pytest.raises(ProtocolMismatch, match="4 frames"):
        decode_reply(op, [op.type_frame, _enc(256), _enc(1)])


@pytest.mark.parametrize("bad", [0, -1, True, "2", 2.0])
def test_tp_size_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="tp_size"):
        kv_readers(bad, 1)  # type: ignore[arg-type]


def test_readers_follow_lmcache_0_5_3s_rule() -> None:
    # lookup.py compute_extra_count: readers = tp when tp exceeds the KV world size.
    table = {(1, 1): 1, (1, 4): 1, (2, 1): 2, (4, 2): 4, (2, 4): 1, (4, 4): 1, (8, 2): 8}
    assert {k: kv_readers(*k) for k in table} == table


@pytest.mark.parametrize("bad", [b"", "x", bytearray(b"x"), None])
def test_a_wrapper_blob_is_non_empty_bytes(bad: object) -> None:
    with pytest.raises(TypeError):
        WrapperBlob(bad)  # type: ignore[arg-type]
    assert WrapperBlob(b"x") == WrapperBlob(b"x") != WrapperBlob(b"y")


def test_a_raw_descriptor_defaults_to_the_allocation_base() -> None:
    data = cuda_raw_descriptor(bytes(64), 128, "float16", (64,), (1,), "cuda-uuid")
    assert msgspec.msgpack.decode(data)["alloc_offset"] == 0
    with pytest.raises(InvalidArgument, match="64 bytes"):
        cuda_raw_descriptor(bytes(63), 128, "float16", (64,), (1,), "cuda-uuid")


def test_key_edges() -> None:
    assert key().cache_salt == ""  # no salt unless given
    assert key(world_size=255, worker_id=254).worker_id == 254
    with pytest.raises(InvalidArgument, match="world_size"):
        key(world_size=256)
    for bad in (dict(start=0.0), dict(end=512.0)):
        with pytest.raises(InvalidArgument, match="ints"):
            key(**bad)
    with pytest.raises(InvalidArgument, match="ints"):
        key().with_range(0.0, 256)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ints"):
        key().with_range(0, 256.0)  # type: ignore[arg-type]
    assert key().with_range(256, 512).start == 256


def test_sequences_with_tolist_are_read_as_their_list() -> None:
    assert key(token_ids=array.array("I", [1, 2]), end=0).token_ids == (1, 2)


@pytest.mark.parametrize("tokens, message", [
    (array.array("d", [1.0, 2.0]), "uint32"),  # tolist() gives floats
    (np.array([2**32], dtype=np.uint64), "uint32"),
    (["1", "2"], "uint32"),  # strict: a str is not a token id
])
def test_token_ids_that_only_look_right_are_refused(tokens: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        key(token_ids=tokens, end=0)


def test_per_group_numpy_block_ids_are_accepted() -> None:
    layout = TransferLayout(1, "m", 1, 256, tuple(
        EngineGroupInfo(engine_group_id=i, tokens_per_block=16) for i in range(2)), 16, 64)
    groups = normalize_block_ids([np.arange(16), np.arange(16, 32)], key(end=256), layout, "STORE")
    assert groups == [list(range(16)), list(range(16, 32))]
    assert all(type(b) is int for g in groups for b in g)
