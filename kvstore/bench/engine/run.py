"""``kvstore bench engine``: real vLLM engines, one per configuration, each in its own venv's
python, driven round by round from here; kvstore daemons (raw and fp8 DRAM pages) from here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.engine.configs import (
    BASELINE,
    CONFIGS,
    EngineConfig,
    EngineOptions,
    worker_env,
    worker_spec,
)
from kvstore.bench.engine.workloads import (
    SHAPES,
    Workload,
    WorkloadSize,
    restart_workload,
    warm_workloads,
    warmup_prompts,
)
from kvstore.bench.procs import child, daemon_args, wait_until
from kvstore.errors import KVStoreError

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DAEMON_DRAM_BYTES = 2 << 30  # far more than any run stores: no eviction in the daemons
MODULE = "kvstore.bench.engine.worker"


_ERROR_LINE = re.compile(r"\b([A-Za-z]*(?:Error|Exception)): (.+)$")


def root_cause(log_path: Path) -> str | None:
    """The first exception message an engine's log names (vLLM's own "failed to start" says
    only "see root cause above")."""
    for line in log_path.read_text(errors="replace").splitlines():
        found = None if " WARNING " in line else _ERROR_LINE.search(line)
        if found and "root cause" not in found.group(2):
            return f"{found.group(1)}: {found.group(2).strip()}"
    return None


def default_python() -> Path:
    """The vLLM venv ``scripts/services/vllm.sh`` exported, else this checkout's."""
    exported = os.environ.get("KVSTORE_TEST_VLLM_PYTHON")
    return Path(exported) if exported else DEFAULT_PYTHON


class EngineWorker:
    """One engine subprocess (``worker.py``), a command at a time; ``error`` holds why it did
    not start (the worker's own message), and then every call is refused."""

    def __init__(self, config: EngineConfig, spec: dict[str, Any], env: dict[str, str],
                 options: EngineOptions, log_path: Path) -> None:
        self.config, self.log_path, self.options = config, log_path, options
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen([str(options.python), "-m", MODULE, json.dumps(spec)],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, cwd=REPO_ROOT)
        self.error: str | None = None
        self.init_s: float | None = None

    def wait_ready(self) -> None:
        """Wait for the engine's first reply; an engine that fails keeps its message."""
        try:
            first = self._reply(self.options.start_timeout_s)
        except KVStoreError as exc:
            first = {"error": str(exc)}
        self.error = first.get("error")
        if self.error and "root cause" in self.error:
            self.error = root_cause(self.log_path) or self.error
        self.init_s = first.get("init_s")

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        timer = threading.Timer(timeout_s, self._proc.kill)  # a hung engine ends the wait
        timer.start()
        try:
            line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            code = self._proc.wait()
            tail = self.log_path.read_text(errors="replace")[-1500:]
            raise KVStoreError(f"engine {self.config.name} exited ({code}): {tail}")
        return json.loads(line)

    def call(self, **command: Any) -> dict[str, Any]:
        if self.error is not None:
            raise KVStoreError(f"engine {self.config.name} did not start: {self.error}")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._reply(self.options.request_timeout_s)

    def close(self) -> None:
        """``exit`` (the engine shuts down and the connector drains its saves), SIGKILL after
        a minute."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")  # type: ignore[union-attr]
                self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


@dataclass(slots=True)
class RunResults:
    """Every request's result, by configuration and workload, and what the engines said."""

    results: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # configuration -> why it did not run
    # configuration -> the first exception its engine's log names, though it ran (a
    # connector that failed inside a running engine serves no hits; this says why)
    log_errors: dict[str, str] = field(default_factory=dict)
    init_s: dict[str, list[float]] = field(default_factory=dict)
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)  # workload -> per request

    def add(self, config: str, workload: str, results: list[dict[str, Any]]) -> None:
        self.results.setdefault(config, {}).setdefault(workload, []).extend(results)


def build_model(options: EngineOptions, size: WorkloadSize, model_dir: Path,
                log_path: Path) -> None:
    """The run's model directory: ``config.json``, and with ``weights='checkpoint'`` random
    weights written by the engine's own python (its transformers)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = SHAPES[options.shape].config_json(options.dtype, options.model_len(size))
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    if options.weights != "checkpoint":
        return
    env = worker_env(CONFIGS[0], options, REPO_ROOT, dict(os.environ))
    with open(log_path, "w") as log:
        proc = subprocess.run([str(options.python), "-m", MODULE, "build", str(model_dir),
                               json.dumps(config), options.device], env=env, stdout=log,
                              stderr=subprocess.STDOUT, cwd=REPO_ROOT, check=False)
    if proc.returncode != 0:
        raise KVStoreError(f"building the model failed ({proc.returncode}): "
                           f"{log_path.read_text(errors='replace')[-2000:]}")


@contextlib.contextmanager
def daemons(configs: tuple[EngineConfig, ...], root: Path) -> Iterator[dict[str, str]]:
    """A kvstore daemon per kvstore configuration (its DRAM tier's codec that of the
    configuration; no SSD), running until the end; yields configuration -> address."""
    from kvstore.client import NO_RETRY, Client

    with contextlib.ExitStack() as stack:
        addresses = {}
        for config in configs:
            if not config.is_kvstore:
                continue
            socket_path, log = root / f"{config.name}.sock", root / f"daemon-{config.name}.log"
            args = daemon_args(socket_path, DAEMON_DRAM_BYTES)
            args += ["--set", f"dram.codec={config.daemon_codec}"]
            proc = stack.enter_context(child(args, log))
            with Client(f"unix://{socket_path}", retry=NO_RETRY) as client:
                wait_until(client.health, proc, log)
            addresses[config.name] = f"unix://{socket_path}"
        yield addresses


def start_engines(configs: tuple[EngineConfig, ...], options: EngineOptions,
                  size: WorkloadSize, model_dir: Path, addresses: dict[str, str], root: Path,
                  generation: str) -> list[EngineWorker]:
    """One engine per configuration, started together (the box starts them in about the
    time of one each, while the others wait on imports), each warmed up; waits for all."""
    workers = []
    for config in configs:
        spec = worker_spec(config, options, model_dir, size, addresses.get(config.name))
        env = worker_env(config, options, REPO_ROOT, dict(os.environ))
        workers.append(EngineWorker(config, spec, env, options,
                                    root / f"engine-{config.name}-{generation}.log"))
    warmup = warmup_prompts(size, SHAPES[options.shape].vocab_size)
    for worker in workers:
        worker.wait_ready()
        if worker.error is None:
            try:
                worker.call(op="generate", prompts=warmup, max_tokens=2)
                worker.call(op="reset")
            except KVStoreError as exc:
                worker.error = str(exc)
    return workers


def run_rounds(workers: list[EngineWorker], workload: Workload, size: WorkloadSize,
               out: RunResults) -> None:
    """Round by round, and within a round prompt by prompt, every configuration's engine in
    turn, the order rotated each time: drift on a shared box falls on all of them alike,
    and an engine's background saves of one request have the others' turns to end in
    before its next request is timed."""
    turn = 0
    for prompts in workload.rounds:
        out.prompt_tokens.setdefault(workload.name, []).extend(len(p) for p in prompts)
        for prompt in prompts:
            live = [w for w in workers if w.error is None]
            shift = turn % len(live) if live else 0
            turn += 1
            for worker in live[shift:] + live[:shift]:
                try:
                    reply = worker.call(op="generate", prompts=[list(prompt)],
                                        max_tokens=size.max_tokens)
                except KVStoreError as exc:
                    worker.error = str(exc)
                    continue
                out.add(worker.config.name, workload.name, reply["results"])


def _close_all(workers: list[EngineWorker], out: RunResults) -> None:
    for worker in workers:
        worker.close()
        cause = root_cause(worker.log_path)
        if worker.error is None and cause is not None:
            out.log_errors.setdefault(worker.config.name, cause)
        if worker.error is not None:
            out.errors.setdefault(worker.config.name, worker.error)
        elif worker.init_s is not None:
            out.init_s.setdefault(worker.config.name, []).append(worker.init_s)


@dataclass(slots=True)
class Generations:
    """Engines started, run and closed a generation at a time against the same daemons."""

    options: EngineOptions
    size: WorkloadSize
    model_dir: Path
    addresses: dict[str, str]
    root: Path
    out: RunResults

    def generation(self, configs: tuple[EngineConfig, ...], workloads: tuple[Workload, ...],
                   name: str) -> None:
        """Every workload on a fresh engine per configuration: all at once, taking rounds
        in turn, or one configuration after another (``options.interleave``)."""
        groups = [configs] if self.options.interleave else [(c,) for c in configs]
        for group in groups:
            workers = start_engines(group, self.options, self.size, self.model_dir,
                                    self.addresses, self.root, name)
            try:
                for workload in workloads:
                    run_rounds(workers, workload, self.size, self.out)
            finally:
                _close_all(workers, self.out)


def run_engines(configs: tuple[EngineConfig, ...], options: EngineOptions,
                size: WorkloadSize, work_dir: str | None = None,
                keep_dir: bool = False) -> tuple[RunResults, dict[str, Any]]:
    """Every workload on every configuration: first engines (chat, documents, overflow),
    then fresh engines against the same daemons (restart). All of a generation's engines
    run together, taking rounds in turn (``options.interleave``), or one configuration's
    engine at a time (one GPU rarely holds several engines). Returns the results and the
    run's facts (engine blocks, wall time)."""
    if not options.python.exists():
        raise KVStoreError(f"no engine python at {options.python} (scripts/services/vllm.sh "
                           "builds .venv-vllm; or pass --python)")
    vocab = SHAPES[options.shape].vocab_size
    out = RunResults()
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvbe-", dir=work_dir))
    try:
        model_dir = root / "model"
        build_model(options, size, model_dir, root / "build.log")
        with daemons(configs, root) as addresses:
            run = Generations(options, size, model_dir, addresses, root, out)
            run.generation(configs, warm_workloads(size, vocab), "a")
            # A fresh engine finds only what outlived the last one: the others would repeat
            # their docs rows (the same prompts on an empty cache), so only the baseline
            # runs again beside them, for ratios measured at the same time.
            again = tuple(c for c in configs if c.outlives_engine or c.name == BASELINE)
            if any(c.outlives_engine for c in again):
                run.generation(again, (restart_workload(size, vocab),), "b")
    finally:
        if not keep_dir:
            shutil.rmtree(root, ignore_errors=True)
    facts = {"engine_blocks": options.num_blocks(size), "work_dir": str(root) if keep_dir
             else None, "wall_s": time.perf_counter() - started}
    return out, facts


__all__ = ["DEFAULT_PYTHON", "EngineWorker", "RunResults", "default_python", "run_engines"]
