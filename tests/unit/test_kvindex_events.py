"""Decoding vLLM's KV-event payloads and applying them to the BlockIndex (no sockets)."""

from __future__ import annotations

import msgpack
import pytest

from gateway.kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventApplier,
    KvEventsConfig,
    chain_root,
    decode_batch,
)
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex

# Bytes produced by vLLM 0.32's own encoder (msgspec.msgpack.Encoder().encode(KVEventBatch(...)))
# for: ts=1.5, rank 0, events = BlockStored([2**64-1, 7], parent None, tokens 1..8, block 4,
# group 0), BlockStored([b"\x01"*32], parent 7, tokens 9..12, extra_keys [("salt",)]),
# BlockRemoved([7], group 0), AllBlocksCleared().
VLLM_032_PAYLOAD = bytes.fromhex(
    "93cb3ff80000000000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfff"
    "ffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708"
    "aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a96772"
    "6f75705f6964780089a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c42001010101"
    "01010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f636b5f68617368"
    "07a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347"
    "5055a96c6f72615f6e616d65c0aa65787472615f6b6579739191a473616c7484a474797065ac426c6f636b52656d"
    "6f766564ac626c6f636b5f6861736865739107a66d656469756da3475055a967726f75705f6964780081a4747970"
    "65b0416c6c426c6f636b73436c656172656400"
)


def test_decodes_vllm_032_payload_bytes() -> None:
    batch = decode_batch(VLLM_032_PAYLOAD)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0 and batch.unknown_events == 0
    first, second, removed, cleared = batch.events
    assert first == BlockStored(
        block_hashes=(2**64 - 1, 7),
        parent_block_hash=None,
        token_ids=tuple(range(1, 9)),
        block_size=4,
        medium="GPU",
        group_idx=0,
    )
    assert isinstance(second, BlockStored)
    assert second.block_hashes == (b"\x01" * 32,) and second.parent_block_hash == 7
    assert second.extra_keys == (["salt"],)
    assert removed == BlockRemoved((7,), "GPU", 0)
    assert cleared == AllBlocksCleared()


def test_decodes_older_tagged_array_events() -> None:
    payload = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockRemoved", [11], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((11, 12), None, (1, 2, 3, 4), 2, None, "GPU"),
        BlockRemoved((11,), "GPU"),
        AllBlocksCleared(),
    )


def test_unknown_event_types_are_counted_not_fatal() -> None:
    batch = decode_batch(msgpack.packb([0.0, [{"type": "SomethingNew", "x": 1}], 0]))
    assert batch.events == () and batch.unknown_events == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb(5),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, [42]]),
        msgpack.packb([1.0, [{"type": "BlockStored"}]]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def stored(
    hashes: list[int | bytes],
    tokens: list[int],
    parent: int | None = None,
    *,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: tuple[object, ...] | None = None,
) -> BlockStored:
    return BlockStored(
        tuple(hashes),
        parent,
        tuple(tokens),
        4,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=group_idx,
    )


@pytest.fixture
def index() -> BlockIndex:
    return BlockIndex()


def test_stored_blocks_are_keyed_by_the_gateways_own_hash(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([stored([901, 902], list(range(8)))])
    ours = block_hashes(list(range(8)), 4)
    assert index.match_prefix(ours, ["w"]) == {"w": 2}
    assert index.stats()["w"].confirmed == 2


def test_child_store_chains_from_the_mapped_parent(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply(
        [stored([901], [1, 2, 3, 4]), stored([902, 903], [5, 6, 7, 8, 9, 10, 11, 12], parent=901)]
    )
    assert index.match_prefix(block_hashes(list(range(1, 13)), 4), ["w"]) == {"w": 3}


def test_engine_hash_algorithm_does_not_matter(index: BlockIndex) -> None:
    """Two engines with different hash seeds report the same tokens: same gateway keys."""
    a = EventApplier("a", index, 4)
    b = EventApplier("b", index, 4)
    a.apply([stored([1], [1, 2, 3, 4]), stored([2], [5, 6, 7, 8], parent=1)])
    b.apply([stored([777], [1, 2, 3, 4]), stored([b"\x09" * 32], [5, 6, 7, 8], parent=777)])
    ours = block_hashes(list(range(1, 9)), 4)
    assert index.match_prefix(ours, ["a", "b"]) == {"a": 2, "b": 2}


def test_store_with_unknown_parent_is_skipped(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([stored([902], [5, 6, 7, 8], parent=12345)])
    assert index.match_prefix(block_hashes([5, 6, 7, 8], 4), ["w"]) == {"w": 0}
    assert applier.counts["skipped_orphan"] == 1


def test_removed_blocks_leave_the_index_and_the_map(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([stored([901, 902], list(range(8)))])
    applier.apply([BlockRemoved((902, 555), "GPU")])
    assert index.match_prefix(block_hashes(list(range(8)), 4), ["w"]) == {"w": 1}
    assert applier.mapped_blocks == 1
    applier.apply([stored([903], [9, 9, 9, 9], parent=902)])  # its parent is gone
    assert applier.counts["skipped_orphan"] == 1


def test_all_blocks_cleared_empties_the_worker_and_the_map(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([stored([901, 902], list(range(8)))])
    index.record_routed("w", [42])
    applier.apply([AllBlocksCleared()])
    assert index.stats()["w"].total == 0
    assert applier.mapped_blocks == 0


def test_blocks_from_the_first_with_extra_keys_on_are_skipped(index: BlockIndex) -> None:
    """LoRA / multimodal / cache-salt blocks hash differently in the engine: a plain prompt
    never hits them, so they must not be predicted as hits."""
    applier = EventApplier("w", index, 4)
    applier.apply([stored([1, 2, 3], list(range(12)), extra_keys=(None, ("mm", "img0", 0), None))])
    assert index.match_prefix(block_hashes(list(range(12)), 4), ["w"]) == {"w": 1}
    assert applier.mapped_blocks == 1
    # A LoRA adapter's block is kept under that adapter (issue 14), never a plain prompt's hit.
    applier.apply([stored([7], [1, 2, 3, 4], lora_name="adapter", lora_id=3)])
    assert applier.counts["skipped_lora"] == 0
    assert index.match_prefix(block_hashes([1, 2, 3, 4], 4), ["w"]) == {"w": 0}


def test_a_salted_chain_is_kept_under_its_salt(index: BlockIndex) -> None:
    """vLLM puts a request's ``cache_salt`` last in its first block's extra keys (after the
    adapter's name): the chain, and every block stored after it, are that salt's only."""
    applier = EventApplier("w", index, 4)
    tokens = list(range(12))
    applier.apply([stored([1, 2, 3], tokens, extra_keys=(("s1",), None, None))])
    salted = block_hashes(tokens, 4, chain_root(None, "s1"))
    assert index.match_prefix(salted, ["w"]) == {"w": 3}
    assert index.match_prefix(block_hashes(tokens, 4), ["w"]) == {"w": 0}
    assert index.match_prefix(block_hashes(tokens, 4, chain_root(None, "s2")), ["w"]) == {"w": 0}
    applier.apply([stored([4], [20, 21, 22, 23], parent=3)])  # the chain grows, salted
    assert index.match_prefix(block_hashes([*tokens, 20, 21, 22, 23], 4, chain_root(None, "s1")),
                              ["w"]) == {"w": 4}
    # An adapter's salted chain: the adapter's name, then the salt.
    applier.apply([stored([7, 8], tokens[:8], lora_name="ad", lora_id=1,
                          extra_keys=(("ad", "s1"), ("ad",)))])
    assert index.match_prefix(block_hashes(tokens[:8], 4, chain_root("ad", "s1")),
                              ["w"]) == {"w": 2}
    assert index.match_prefix(block_hashes(tokens[:8], 4, chain_root("ad", None)),
                              ["w"]) == {"w": 0}
    # A salt is only ever on a prompt's first block: anywhere else, the keys are not ours.
    applier.apply([stored([9], [30, 31, 32, 33], parent=4, extra_keys=(("s1",),))])
    assert applier.counts["skipped_extra_keys"] == 1
    assert applier.counts["stored_blocks"] == 6


def test_chain_roots_never_collide() -> None:
    roots = [chain_root(a, s) for a in (None, "a", "ab", "a\x00") for s in (None, "b", "\x00b")]
    assert roots[0] is None
    assert len(set(roots[1:])) == len(roots) - 1


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([1], [1, 2, 3, 4], medium="CPU"), "skipped_medium"),
        (stored([1], [1, 2, 3, 4], group_idx=1), "skipped_group"),
        (BlockStored((1,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8), "skipped_block_size"),
        (stored([1, 2], [1, 2, 3, 4]), "skipped_shape"),
    ],
)
def test_events_the_gateway_cannot_use_are_skipped(
    index: BlockIndex, event: BlockStored, reason: str
) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([event])
    assert applier.counts[reason] == 1
    assert applier.mapped_blocks == 0


def test_removal_from_another_tier_keeps_the_device_block(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4)
    applier.apply([stored([1], [1, 2, 3, 4])])
    applier.apply([BlockRemoved((1,), "CPU"), BlockRemoved((1,), "GPU", 1)])
    assert index.match_prefix(block_hashes([1, 2, 3, 4], 4), ["w"]) == {"w": 1}


def test_engine_hash_map_is_bounded(index: BlockIndex) -> None:
    applier = EventApplier("w", index, 4, max_mapped_blocks=10)
    for i in range(100):
        applier.apply([stored([i], [i, i, i, i])])
    assert applier.mapped_blocks == 10


def test_events_config_refuses_to_connect_to_a_wildcard() -> None:
    with pytest.raises(ValueError):
        KvEventsConfig("tcp://*:5557")
    with pytest.raises(ValueError):
        KvEventsConfig("http://worker:5557")
    assert KvEventsConfig("tcp://*:5557", bind=True).bind
