"""Runs in the vLLM venv: the connector's scheduler-side lookup against a stopped daemon.

    python vllm_lookup_cases.py MODEL_DIR ADDRESS DAEMON_PID OUT_JSON

Saves a prompt, stops the daemon (SIGSTOP: a tier that does not answer), asks the scheduler
side for a request of the same prompt, continues the daemon and asks again until answered;
then the same with a connector that gives up at once. Writes the answers as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from vllm_identity_cases import PROMPT_TOKENS, Engine, make_request

MAX_ASKS = 500  # the scheduler's steps to wait for the continued daemon's answer


def ask_stopped(engine: Engine, pid: int, req_id: str, tokens: list[int]) -> dict:
    """The answer while the daemon is stopped, and the answers after it continues."""
    request = make_request(req_id, tokens, {})
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.perf_counter()
        stopped = engine.scheduler.get_num_new_matched_tokens(request, 0)
        stopped_s = time.perf_counter() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    answers = [stopped]
    while answers[-1][0] is None and len(answers) < MAX_ASKS:
        time.sleep(0.01)
        answers.append(engine.scheduler.get_num_new_matched_tokens(request, 0))
    engine.scheduler.request_finished(request, [])
    return {"stopped": list(stopped), "stopped_s": stopped_s, "final": list(answers[-1]),
            "num_asks": len(answers)}


def main(model: str, address: str, pid: int, out: Path) -> None:
    tokens = [3 + j % 500 for j in range(PROMPT_TOKENS)]
    engine = Engine(model, address, lookup_deadline_ms=50, lookup_give_up_ms=30_000)
    engine.save(make_request("a", tokens, {}))
    results = {"pending": ask_stopped(engine, pid, "a2", tokens)}
    impatient = Engine(model, address, lookup_deadline_ms=50, lookup_give_up_ms=0)
    results["give_up"] = ask_stopped(impatient, pid, "a3", tokens)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
