"""Runs in the vLLM venv: the connector's key-partitioning cases with real vLLM requests.

    python vllm_identity_cases.py MODEL_DIR ADDRESS OUT_JSON

For each case, request A (a prompt of 4 full blocks and one token) is saved through the
connector's two halves as the engine drives them: the scheduler side plans the step
(``get_num_new_matched_tokens``, ``build_connector_meta``) and a worker-side connector over
caches laid out as vLLM 0.32's CPU backend lays them out saves it to the daemon
(``wait_for_save``). Then request B, the same token ids differing only in its adapter, image,
salt or prompt embeddings, asks how many tokens the connector holds for it (``hit``), and a
second request like A asks the same (``control``). Writes ``{case: {"hit", "control"}}`` and
whether a plain request's namespace and key ids are those of the connector before identity
binding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

BLOCK_SIZE = 32
PROMPT_TOKENS = 4 * BLOCK_SIZE + 1
HIDDEN = 128  # vllm_engine.build's hidden size


def lora(name: str, int_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def image(identifier, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def embeds(seed: int, changed_row: int | None = None) -> torch.Tensor:
    e = torch.randn(PROMPT_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
    if changed_row is not None:
        e[changed_row] += 1.0
    return e


def cases(i: int) -> list[tuple[str, dict, dict]]:
    """(name, A's identity, B's identity); both have the same token ids unless embedded."""
    salt_long = "s" * 300
    return [
        ("salt", {"cache_salt": "alice"}, {"cache_salt": "bob"}),
        ("salt_vs_none", {"cache_salt": "alice"}, {}),
        ("none_vs_salt", {}, {"cache_salt": "alice"}),
        ("long_salt", {"cache_salt": salt_long}, {"cache_salt": salt_long[:-1] + "t"}),
        ("lora_name", {"lora_request": lora("x", 1, "/a/x")},
         {"lora_request": lora("y", 2, "/a/y")}),
        ("lora_vs_base", {"lora_request": lora("x", 1, "/a/x")}, {}),
        ("base_vs_lora", {}, {"lora_request": lora("x", 1, "/a/x")}),
        ("lora_path", {"lora_request": lora("x", 1, "/a/x")},
         {"lora_request": lora("x", 1, "/a/x2")}),
        ("lora_id", {"lora_request": lora("x", 1, "/a/x")},
         {"lora_request": lora("x", 2, "/a/x")}),
        ("image", {"mm_features": [image(f"img-a{i}", 40, 20)]},
         {"mm_features": [image(f"img-b{i}", 40, 20)]}),
        ("image_offset", {"mm_features": [image(f"img-a{i}", 40, 20)]},
         {"mm_features": [image(f"img-a{i}", 42, 20)]}),
        ("image_vs_none", {"mm_features": [image(f"img-a{i}", 70, 40)]}, {}),
        ("second_image", {"mm_features": [image(f"img-a{i}", 10, 10)]},
         {"mm_features": [image(f"img-a{i}", 10, 10), image(f"img-c{i}", 100, 10)]}),
        ("embeds", {"prompt_embeds": embeds(i)}, {"prompt_embeds": embeds(i, changed_row=70)}),
        ("embeds_vs_zero_ids", {"prompt_embeds": embeds(i + 1000)},
         {"prompt_token_ids": [0] * PROMPT_TOKENS}),
        ("unexpressible", {"mm_features": [image(1.5, 40, 20)]},
         {"mm_features": [image(1.5, 40, 20)]}),
    ]


class Engine:
    """A scheduler-side and a worker-side connector, driven one request step at a time."""

    def __init__(self, model: str, address: str, kv_role: str = "kv_both",
                 **extra_config: float) -> None:
        from vllm.config import KVTransferConfig
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs

        from kvstore.integrations.vllm import KVStoreConnector

        self.config = EngineArgs(
            model=model, block_size=BLOCK_SIZE, dtype="float32", max_model_len=1024,
            enable_prefix_caching=False, enforce_eager=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStoreConnector", kv_role=kv_role,
                kv_load_failure_policy="recompute",
                kv_connector_module_path="kvstore.integrations.vllm",
                kv_connector_extra_config={"address": address, "revision": "r1",
                                           **extra_config}),
        ).create_engine_config()
        self.scheduler = KVStoreConnector(self.config, KVConnectorRole.SCHEDULER)
        # One worker, no distributed group: rank 0 of a tensor-parallel group of one.
        parallel_state.get_tensor_model_parallel_rank = lambda: 0
        self.worker = KVStoreConnector(self.config, KVConnectorRole.WORKER)
        g = torch.Generator().manual_seed(0)
        self.worker.register_kv_caches({
            f"model.layers.{i}.self_attn.attn":
                torch.randn(16, 2, BLOCK_SIZE, 64, generator=g) for i in range(2)})

    def step(self, request, block_ids: list[int] | None = None) -> bool:
        """One step computing the whole of ``request`` (blocks ``block_ids``, default 0-4):
        its saves queued on the worker; then the request finishes. Returns whether the
        scheduler delays freeing its blocks until the worker reports it."""
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

        self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, None, 0)
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(
            request, (block_ids or [0, 1, 2, 3, 4],))]
        output.num_scheduled_tokens = {request.request_id: request.num_tokens}
        meta = self.scheduler.build_connector_meta(output)
        self.worker.bind_connector_metadata(meta)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return self.scheduler.request_finished(request, [])[0]

    def save(self, request) -> None:
        """``step``, then wait until the worker reports the request (its puts done), as
        vLLM does before it frees the blocks."""
        if self.step(request):
            finished: set[str] = set()
            while request.request_id not in finished:
                finished, _ = self.worker.get_finished({request.request_id})
                finished = finished or set()
                time.sleep(0.001)

    def hit(self, request) -> int:
        num, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.request_finished(request, [])
        return num or 0


def make_request(req_id: str, tokens: list[int], identity: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    identity = dict(identity)
    prompt = identity.pop("prompt_token_ids", None if "prompt_embeds" in identity else tokens)
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, **identity)


def plain_keys_unchanged(engine: Engine, tokens: list[int]) -> bool:
    """A plain request's namespace and key ids are the connector's before identity binding:
    the same fields, the extra salt spelled as it was, the token ids themselves."""
    from kvstore.integrations.vllm import namespace_for
    from kvstore.integrations.vllm_identity import BlockIdentity
    from kvstore.keys import Namespace

    for salt, spelled in ((None, "vllm/cpu/LBHNC"), ("s", "vllm/cpu/LBHNC/salt=s")):
        ns = namespace_for(engine.config, salt)
        before = Namespace(model_id=ns.model_id, spec=ns.spec, revision=ns.revision,
                           tenant=ns.tenant, tp_rank=0, tp_size=1, extra_salt=spelled)
        request = make_request("plain", tokens, {"cache_salt": salt})
        if ns.fingerprint != before.fingerprint or \
                BlockIdentity(request, BLOCK_SIZE).tokens(len(tokens)).tolist() != tokens:
            return False
    return True


def ids_grow_with_the_request(tokens: list[int]) -> bool:
    """Key ids asked for as a request grows are the ids of a fresh conversion each time, and a
    token id in the reserved range is refused when it first appears."""
    from kvstore.integrations.vllm_identity import BlockIdentity, Unexpressible
    from kvstore.keys import EXTRA_ID_BIT

    request = make_request("grows", tokens, {})
    identity = BlockIdentity(request, BLOCK_SIZE)
    for n in (BLOCK_SIZE, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE, len(tokens)):
        ids = identity.tokens(n)
        if ids.tolist() != tokens[:n] or ids.flags.writeable:
            return False
    bad = make_request("bad", tokens + [EXTRA_ID_BIT] * BLOCK_SIZE, {})
    identity = BlockIdentity(bad, BLOCK_SIZE)
    if identity.tokens(len(tokens)).tolist() != tokens:
        return False
    try:
        identity.tokens(len(tokens) + BLOCK_SIZE)
    except Unexpressible:
        return True
    return False


def roles_keep_to_their_side(model: str, address: str) -> dict:
    """A kv_producer saves and never loads; a kv_consumer loads and never saves."""
    producer = Engine(model, address, kv_role="kv_producer", lookup_deadline_ms=30_000,
                      lookup_give_up_ms=60_000)
    consumer = Engine(model, address, kv_role="kv_consumer", lookup_deadline_ms=30_000,
                      lookup_give_up_ms=60_000)
    both = Engine(model, address, lookup_deadline_ms=30_000, lookup_give_up_ms=60_000)
    produced = [3 + (11 * j) % 500 for j in range(PROMPT_TOKENS)]
    producer.save(make_request("role-p", produced, {}))
    consumed = [3 + (13 * j) % 500 for j in range(PROMPT_TOKENS)]
    consumer.save(make_request("role-c", consumed, {}))
    return {"producer_loads": producer.hit(make_request("role-p2", produced, {})),
            "consumer_loads": consumer.hit(make_request("role-p3", produced, {})),
            "consumer_saved": both.hit(make_request("role-c2", consumed, {}))}


def events_of_landed_saves(model: str, address: str) -> dict:
    """A save that landed comes back through vLLM's event path as BlockStored events of medium
    kvstore, under vLLM's own block hashes, with the request's token ids."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    engine = Engine(model, address, lookup_deadline_ms=30_000, lookup_give_up_ms=60_000)
    tokens = [3 + (17 * j) % 500 for j in range(PROMPT_TOKENS)]
    request = Request("events", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn))
    engine.save(request)
    report = engine.worker.get_kv_connector_kv_cache_events()
    engine.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=report))
    events = list(engine.scheduler.take_events())
    hashes = [h for e in events for h in e.block_hashes]
    ids = [t for e in events for t in e.token_ids]
    full = len(tokens) // BLOCK_SIZE
    return {"media": sorted({e.medium for e in events}),
            "hashes_match": hashes == [maybe_convert_block_hash(h)
                                       for h in request.block_hashes[:full]],
            "tokens_match": ids == tokens[:full * BLOCK_SIZE],
            "taken_again": len(list(engine.scheduler.take_events()))}


def reset_drops_what_was_stored(model: str, address: str) -> dict:
    """vLLM's reset of the external cache (after a weight update) invalidates the engine's
    blocks in kvstore, under any salt: no later lookup finds them."""
    engine = Engine(model, address, lookup_deadline_ms=30_000, lookup_give_up_ms=60_000)
    tokens = [3 + (19 * j) % 500 for j in range(PROMPT_TOKENS)]
    engine.save(make_request("reset-a", tokens, {}))
    engine.save(make_request("reset-s", tokens, {"cache_salt": "s"}))
    before = engine.hit(make_request("reset-b", tokens, {}))
    reset = engine.scheduler.reset_cache()
    return {"before": before, "reset": reset,
            "after": engine.hit(make_request("reset-c", tokens, {})),
            "after_salted": engine.hit(make_request("reset-d", tokens, {"cache_salt": "s"}))}


def mla_keys_are_one_copy(engine: Engine) -> bool:
    """An MLA model's namespace is its latent group's: the same on every TP rank (so TP=2
    stores one copy), rows of kv_lora_rank + rope halved into the pages' K and V."""
    from types import SimpleNamespace as Fake

    from kvstore.integrations.vllm import namespace_for

    model = Fake(model="mla", revision=None, dtype=torch.bfloat16, use_mla=True,
                 hf_text_config=Fake(kv_lora_rank=64, qk_rope_head_dim=16),
                 get_num_layers=lambda parallel: 2)
    config = Fake(model_config=model, parallel_config=Fake(tensor_parallel_size=2),
                  cache_config=Fake(block_size=16, cache_dtype="auto"),
                  kv_transfer_config=engine.config.kv_transfer_config,
                  device_config=Fake(device_type="cuda"))
    rank0, rank1 = namespace_for(config, None, 0), namespace_for(config, None, 1)
    salted = namespace_for(config, "s", 1)
    return (rank0.fingerprint == rank1.fingerprint != salted.fingerprint
            and (rank0.spec.num_kv_heads, rank0.spec.head_dim) == (1, 40))


def main(model: str, address: str, out: Path) -> None:
    # Lookups are answered in full here, however slow the box (vllm_lookup_cases tests the
    # deadline).
    engine = Engine(model, address, lookup_deadline_ms=30_000, lookup_give_up_ms=60_000)
    results: dict = {}
    for i, (name, a, b) in enumerate(cases(0)):
        tokens = [3 + (17 * i + j) % 500 for j in range(PROMPT_TOKENS)]
        engine.save(make_request(f"{name}-a", tokens, a))
        results[name] = {"hit": engine.hit(make_request(f"{name}-b", tokens, b)),
                         "control": engine.hit(make_request(f"{name}-a2", tokens, a))}
    results["plain_keys_unchanged"] = plain_keys_unchanged(engine, list(range(3, 3 + 128)))
    results["roles"] = roles_keep_to_their_side(model, address)
    results["events"] = events_of_landed_saves(model, address)
    results["reset"] = reset_drops_what_was_stored(model, address)
    results["mla_keys_are_one_copy"] = mla_keys_are_one_copy(engine)
    results["ids_grow_with_the_request"] = ids_grow_with_the_request(
        [3 + (7 * j) % 500 for j in range(8 * BLOCK_SIZE)])
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
