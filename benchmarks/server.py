"""Server mode: vLLM's OpenAI server on 127.0.0.1, driven by an asyncio HTTP client.

One server per method, dataset and concurrency level, where `concurrency`
client workers each take a conversation and send its turns one after another to
/v1/completions (token-id prompts, greedy, streamed with `return_token_ids`, so
every chunk names the tokens it carries, and `include_usage`, which gives the
exact completion token count to check against). A chunk that carries tokens is
counted as one forward pass: the server sends one chunk per engine step that
produced tokens for the request, unless the client fell behind and vLLM merged
several steps' tokens into one chunk (then S here is too high; compare with S of
the offline modes). TTFT is measured to the first chunk carrying a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from benchmarks.datasets import WARMUP, WARMUP_TOKENS, Conversations
from benchmarks.offline import turns
from benchmarks.records import (
    RequestRecord,
    SpecDecodeCounters,
    measurement_json,
    proposer_counters,
    proposer_delta,
    round_json,
)
from benchmarks.sse import data_events

HOST = "127.0.0.1"
HEALTH_POLL_SECONDS = 2.0
LOG_TAIL_CHARS = 4000


def cli_flags(engine_args: dict) -> list[str]:
    """Engine keyword arguments as `vllm.entrypoints.openai.api_server` flags."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class ApiServer:
    """A vLLM OpenAI server subprocess in its own process group, stopped on exit, also
    when the harness is sent SIGTERM (``kill``, a timeout): in its own session the
    server would otherwise outlive the harness and load the machine of the next run."""

    def __init__(self, model_path: str, speculative_config: dict | None, engine_args: dict,
                 startup_timeout: float):
        self.model = model_path
        self.port = _free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                        "--model", model_path, "--host", HOST, "--port", str(self.port),
                        *cli_flags(engine_args)]
        if speculative_config is not None:
            self.command += ["--speculative-config", json.dumps(speculative_config)]
        self.startup_timeout = startup_timeout
        self.startup_seconds = 0.0
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            "w+", prefix="vllm-server-", suffix=".log", delete=False)
        self._process: subprocess.Popen | None = None
        self._previous_sigterm: object = None

    def __enter__(self) -> ApiServer:  # noqa: PYI034 - Self needs Python 3.11
        import httpx

        started = time.perf_counter()
        self._previous_sigterm = _exit_on_sigterm()
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"server exited with code {self._process.returncode}"
                                       f"{self._log_tail()}")
                if time.perf_counter() - started > self.startup_timeout:
                    raise RuntimeError(f"server not healthy after {self.startup_timeout:.0f} s"
                                       f"{self._log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.base_url}/health", timeout=5, trust_env=False).is_success:
                        break
                time.sleep(HEALTH_POLL_SECONDS)
        except BaseException:
            self.__exit__()
            raise
        self.startup_seconds = time.perf_counter() - started
        return self

    def __exit__(self, *exc_info) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self._log.close()
        os.unlink(self._log.name)

    @property
    def pid(self) -> int:
        return self._process.pid

    def _log_tail(self) -> str:
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            text = f.read()
        return f"; server log ({self._log.name}) ends with:\n{text[-LOG_TAIL_CHARS:]}"

    def counters(self) -> tuple[SpecDecodeCounters, dict[str, float]]:
        """vLLM's spec-decode counters and the proposer's (``proposer_counters``)."""
        import httpx

        response = httpx.get(f"{self.base_url}/metrics", timeout=30, trust_env=False)
        response.raise_for_status()
        return (SpecDecodeCounters.from_prometheus(response.text),
                proposer_counters(response.text))


def measure_server(model_path: str, speculative_config: dict | None, engine_args: dict,
                   dataset: str, conversations: Conversations, sampling: dict, concurrency: int,
                   request_timeout: float, startup_timeout: float,
                   on_request: Callable[[], None]) -> dict:
    """One measurement (JSON-ready): `conversations` at `concurrency` on a new server;
    `sampling`: request fields (max_tokens, temperature, top_p).

    A new server for every measurement, because suffix decoding keeps past outputs
    across requests: on a shared server, later concurrency levels would be handed
    the answers to the same prompts.
    """
    with ApiServer(model_path, speculative_config, engine_args, startup_timeout) as server:
        asyncio.run(_warm_up(server, conversations.prompter.prompt(WARMUP, []), sampling))
        spec_before, proposer_before = server.counters()
        records, wall_seconds = asyncio.run(_run_conversations(
            server, conversations, sampling, concurrency, request_timeout, on_request))
        spec_after, proposer_after = server.counters()
    proposer = proposer_delta(proposer_before, proposer_after)
    return measurement_json("server", dataset, concurrency, wall_seconds, None,
                            spec_after - spec_before, proposer, records, conversations.samples,
                            server.startup_seconds)


def measure_server_interleaved(model_path: str,
                               methods: dict[str, tuple[dict | None, dict]], dataset: str,
                               conversations: Conversations, sampling: dict, concurrency: int,
                               round_size: int, request_timeout: float,
                               startup_timeout: float, on_request: Callable[[], None]
                               ) -> dict[str, dict | Exception]:
    """`measure_server` with every method's server up at once, the methods taking turns
    on each round of ``max(round_size, concurrency)`` conversations (the order rotating
    by one each round), each measurement keeping its rounds' times for paired speedups.

    A server keeps what it answered in earlier rounds (a server's state, as in
    service; suffix decoding's and lookahead's corpora); no round repeats a
    conversation. `methods`: name -> (speculative config, engine arguments). Returns
    name -> measurement, or the exception that ended that method (the others go on).
    """
    size = max(round_size, concurrency)
    outcome: dict[str, dict | Exception] = {}
    with contextlib.ExitStack() as stack:
        servers, before = {}, {}
        for name, (config, engine_args) in methods.items():
            try:
                server = stack.enter_context(ApiServer(model_path, config, engine_args,
                                                       startup_timeout))
                asyncio.run(_warm_up(server, conversations.prompter.prompt(WARMUP, []),
                                     sampling))
                servers[name], before[name] = server, server.counters()
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
        answered = {name: ([], []) for name in servers}  # records, rounds
        for which, name in turns(len(conversations), size,
                                 lambda: [name for name in servers if name not in outcome]):
            try:
                records, wall_seconds = asyncio.run(_run_conversations(
                    servers[name], conversations, sampling, concurrency, request_timeout,
                    on_request, which))
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
                continue
            answered[name][0].extend(records)
            answered[name][1].append(round_json(which, wall_seconds, records))
        for name, server in servers.items():
            if name in outcome:
                continue
            try:
                spec_after, proposer_after = server.counters()
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
                continue
            records, rounds = answered[name]
            outcome[name] = measurement_json(
                "server", dataset, concurrency, sum(r["wall_seconds"] for r in rounds), None,
                spec_after - before[name][0], proposer_delta(before[name][1], proposer_after),
                records, conversations.samples, server.startup_seconds)
            outcome[name]["rounds"] = rounds
    return {name: outcome[name] for name in methods}


async def _warm_up(server: ApiServer, prompt: list[int], sampling: dict) -> None:
    """One untimed request (datasets.WARMUP)."""
    import httpx

    async with httpx.AsyncClient(trust_env=False) as client:
        await _stream_completion(client, server, RequestRecord(0, 0, len(prompt), 0.0), prompt,
                                 {**sampling, "max_tokens": WARMUP_TOKENS}, timeout=600)


async def _run_conversations(server: ApiServer, conversations: Conversations, sampling: dict,
                             concurrency: int, request_timeout: float,
                             on_request: Callable[[], None], which: range | None = None
                             ) -> tuple[list[RequestRecord], float]:
    """`which` conversations (all: None) at `concurrency`; their records and wall time."""
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for conversation in which if which is not None else range(len(conversations)):
        queue.put_nowait(conversation)
    records: list[RequestRecord] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            conversation = queue.get_nowait()
            answers: list[list[int]] = []
            while (prompt := conversations.next_prompt(conversation, answers)) is not None:
                record = RequestRecord(conversation, len(answers), len(prompt), time.perf_counter())
                await _stream_completion(client, server, record, prompt, sampling,
                                         request_timeout)
                answers.append(record.output)
                records.append(record)
                on_request()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, time.perf_counter() - started


async def _stream_completion(client, server: ApiServer, record: RequestRecord, prompt: list[int],
                             sampling: dict, timeout: float) -> None:
    """Stream one completion into `record`; checks the token count against usage."""
    body = {"model": server.model, "prompt": prompt, **sampling,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    usage_tokens = None
    async with client.stream("POST", f"{server.base_url}/v1/completions", json=body,
                             timeout=timeout) as response:
        if not response.is_success:
            detail = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"/v1/completions returned {response.status_code}: {detail}")
        async for chunk in data_events(response):
            now = time.perf_counter()
            if "error" in chunk:
                raise RuntimeError(f"/v1/completions stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                record.add_tokens(now, choice.get("token_ids") or [])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
    record.finished = time.perf_counter()
    if usage_tokens != len(record.output):
        raise RuntimeError(f"streamed {len(record.output)} token ids but usage reports "
                           f"{usage_tokens} completion tokens")


def _exit_on_sigterm() -> object:
    """SIGTERM raises SystemExit (so ``with`` blocks stop their servers); the handler it
    replaced, or None off the main thread (where handlers cannot be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]
