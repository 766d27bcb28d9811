"""A KV-cache-aware router's side of kvstore's KV events: vLLM's event classes decoded with
msgspec, an index of which host holds which block in which medium, a replay on a gap, and a
prompt scored per host by hashing it as kvstore does (``block_keys``).

Run a daemon with ``[events] enabled = true`` and ``replay_endpoint = "tcp://127.0.0.1:5558"``,
then ``python examples/kv_event_router.py``.
"""

import msgspec
import zmq

from kvstore.keys import Namespace, block_keys


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass

class BlockStored(Event):
    block_hashes: list[int]; parent_block_hash: int | None; token_ids: list[int]
    block_size: int; lora_id: int | None; medium: str | None; lora_name: str | None

class BlockRemoved(Event):
    block_hashes: list[int]; medium: str | None

class AllBlocksCleared(Event):
    pass

class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float; events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None

decode = msgspec.msgpack.Decoder(KVEventBatch).decode
where: dict[int, set[tuple[str, str]]] = {}  # block hash -> {(host, medium)}

def apply(host: str, batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            for held in where.values():
                held -= {h for h in held if h[0] == host}
            continue
        for block in event.block_hashes:
            held = where.setdefault(block, set())
            (held.add if isinstance(event, BlockStored) else held.discard)((host, event.medium))

def cached_blocks(host: str, ns: Namespace, tokens: list[int]) -> int:
    """How many leading blocks of a prompt ``host`` holds, in any tier."""
    count = 0
    for key in block_keys(ns, tokens):
        if not any(h == host for h, _ in where.get(int.from_bytes(key[8:], "big"), ())):
            break
        count += 1
    return count

def follow(endpoint: str = "tcp://127.0.0.1:5557", replay_endpoint: str = "tcp://127.0.0.1:5558",
           num_batches: int | None = None) -> None:
    """Apply the daemon's batches as they come (``num_batches``: stop after that many)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    next_seq, applied = 0, 0
    while num_batches is None or applied < num_batches:
        topic, seq, payload = sub.recv_multipart()
        host, seq = topic.decode().split("@")[1], int.from_bytes(seq, "big")
        if seq > next_seq:  # missed some (or joined late): ask for them, then go on live
            replay.send_multipart([b"", next_seq.to_bytes(8, "big")])
            while (frames := replay.recv_multipart())[1] != (-1).to_bytes(8, "big", signed=True):
                if int.from_bytes(frames[1], "big") < seq:
                    apply(host, decode(frames[2]))
                    applied += 1
        apply(host, decode(payload))
        applied += 1
        next_seq = seq + 1
    sub.close()
    replay.close()


if __name__ == "__main__":
    follow()
