"""Runs in the vLLM venv: the connector's asynchronous saves against a stopped daemon.

    python vllm_save_cases.py MODEL_DIR ADDRESS DAEMON_PID OUT_JSON

``landed``: a request's save is queued while the daemon is stopped (SIGSTOP); the worker must
not name it finished (vLLM would free its blocks) until the daemon continues and the put
lands, and a lookup made the moment it is named finds every block. ``cap``: with room queued
for two saves, five requests step while the daemon is stopped: every step returns, three saves
are dropped and counted (their requests named finished at once), and once the daemon
continues the two queued ones land. Writes what was seen as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from vllm_identity_cases import PROMPT_TOKENS, Engine, make_request

from kvstore.client import Client
from kvstore.integrations.vllm import namespace_for

MAX_POLLS = 3000  # get_finished polls, 10 ms apart, before giving up on a report
STOPPED_POLLS = 20  # polls while the daemon is stopped
STEP_LIVENESS_S = 30.0  # far beyond a step; a step waiting on the stopped daemon never returns
BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # layers, K/V, block tokens, heads, head dim, float32


def prompt(seed: int) -> list[int]:
    return [3 + (31 * seed + j) % 500 for j in range(PROMPT_TOKENS)]


def poll(engine: Engine, req_ids: set[str], polls: int) -> set[str]:
    """The requests of ``req_ids`` the worker names finished within ``polls`` polls."""
    reported: set[str] = set()
    for _ in range(polls):
        done, _ = engine.worker.get_finished(req_ids)
        reported |= done or set()
        if reported == req_ids:
            break
        time.sleep(0.01)
    return reported


def stored_tokens(client: Client, engine: Engine, tokens: list[int]) -> int:
    return client.lookup(namespace_for(engine.config), tokens[:4 * 32]).matched_tokens


def landed(engine: Engine, address: str, pid: int) -> dict:
    tokens, request = prompt(0), make_request("landed", prompt(0), {})
    with Client(address) as client:
        os.kill(pid, signal.SIGSTOP)
        try:
            delayed = engine.step(request)
            while_stopped = poll(engine, {"landed"}, STOPPED_POLLS)
        finally:
            os.kill(pid, signal.SIGCONT)
        for _ in range(MAX_POLLS):
            done, _ = engine.worker.get_finished({"landed"})
            if done:  # the scheduler frees the blocks now: the put must have landed
                stored = stored_tokens(client, engine, tokens)
                break
            time.sleep(0.01)
        else:
            stored = None
    return {"delayed": delayed, "reported_while_stopped": sorted(while_stopped),
            "stored_when_reported": stored}


def cap(engine: Engine, address: str, pid: int) -> dict:
    names = [f"cap{i}" for i in range(5)]
    engine.worker.get_kv_connector_stats()  # counters from here on
    os.kill(pid, signal.SIGSTOP)
    try:
        delays: list[bool] = []
        steps = threading.Thread(target=lambda: delays.extend(
            engine.step(make_request(name, prompt(i + 1), {})) for i, name in enumerate(names)))
        steps.start()
        steps.join(STEP_LIVENESS_S)
        steps_returned = not steps.is_alive()
        while_stopped = poll(engine, set(names), STOPPED_POLLS)
        stopped_stats = engine.worker.get_kv_connector_stats()
    finally:
        os.kill(pid, signal.SIGCONT)
    reported = while_stopped | poll(engine, set(names), MAX_POLLS)
    after = engine.worker.get_kv_connector_stats()
    with Client(address) as client:
        stored = [stored_tokens(client, engine, prompt(i + 1)) for i in range(len(names))]
    return {"steps_returned": steps_returned, "delays": delays,
            "reported_while_stopped": sorted(while_stopped), "reported": sorted(reported),
            "stopped_stats": stopped_stats and stopped_stats.data,
            "after_stats": after and after.data, "stored": stored}


def stalled_load(engine: Engine, pid: int) -> dict:
    """A load planned from a hit, then the daemon stops before the worker loads: the step's
    ``start_load_kv`` returns after ``load_timeout_ms`` and reports every planned block as a
    load error, which vLLM recomputes."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    tokens = prompt(9)
    engine.save(make_request("stall-a", tokens, {}))
    request = make_request("stall-b", tokens, {})
    num, _ = engine.scheduler.get_num_new_matched_tokens(request, 0)
    engine.scheduler.update_state_after_alloc(request, None, num)
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(request, ([5, 6, 7, 8, 9],))]
    output.num_scheduled_tokens = {request.request_id: request.num_tokens - num}
    meta = engine.scheduler.build_connector_meta(output)
    os.kill(pid, signal.SIGSTOP)
    try:
        engine.worker.bind_connector_metadata(meta)
        start = time.monotonic()
        engine.worker.start_load_kv(None)
        elapsed = time.monotonic() - start
        errors = engine.worker.get_block_ids_with_load_errors()
        engine.worker.clear_connector_metadata()
    finally:
        os.kill(pid, signal.SIGCONT)
    return {"planned_tokens": num, "errors": sorted(errors), "elapsed_s": elapsed}


def main(model: str, address: str, pid: int, out: Path) -> None:
    results = {"landed": landed(Engine(model, address), address, pid)}
    tight = Engine(model, address, save_queue_bytes=2 * 4 * BLOCK_BYTES, save_timeout_ms=60_000)
    results["cap"] = cap(tight, address, pid)
    quick = Engine(model, address, load_timeout_ms=300, lookup_deadline_ms=30_000,
                   lookup_give_up_ms=60_000)
    results["stalled_load"] = stalled_load(quick, pid)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
