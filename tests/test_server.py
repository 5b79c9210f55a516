"""The OpenAI-compatible server with lookahead: same answers as without it, counters move."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import make_prompts
from openai import OpenAI

from benchmarks.load_test import evaluate, load_server, prometheus_value, reference_outputs
from benchmarks.load_workload import build_workload

SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
               "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0"]
COMPLETION_PROMPTS = ["def decode(self, s):", "import json\nclass JSONEncoder(object):"]
CHAT = [{"role": "user", "content": "Explain what JSONDecodeError means."}]
GENERATION = dict(max_tokens=96, temperature=0, extra_body={"ignore_eos": True})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model: str, extra_args: list[str], log_path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *extra_args],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        pytest.fail(f"server not ready in {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def metric(self, name: str) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return prometheus_value(text, name) or 0.0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def servers(llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    # the reference, vLLM alone: its engine core runs its model itself (no worker
    # process, one import of vLLM fewer), as in the offline in-process engines
    plain = Server(llama_path, [], logs / "plain.log", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    lookahead = Server(llama_path, ["--speculative-config", "lookahead"], logs / "lookahead.log")
    try:
        plain.wait_ready()
        lookahead.wait_ready()
        yield plain, lookahead
    finally:
        plain.stop()
        lookahead.stop()


def completion_texts(server, stream=False):
    texts = []
    for prompt in COMPLETION_PROMPTS:
        if stream:
            chunks = server.client.completions.create(
                model=server.client.models.list().data[0].id, prompt=prompt, stream=True,
                **GENERATION)
            texts.append("".join(c.choices[0].text for c in chunks))
        else:
            response = server.client.completions.create(
                model=server.client.models.list().data[0].id, prompt=prompt, **GENERATION)
            texts.append(response.choices[0].text)
    return texts


def chat_text(server, stream=False):
    model = server.client.models.list().data[0].id
    if stream:
        chunks = server.client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                       **GENERATION)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    response = server.client.chat.completions.create(model=model, messages=CHAT, **GENERATION)
    return response.choices[0].message.content


def test_completions_equal_plain_server(servers):
    plain, lookahead = servers
    expected = completion_texts(plain)
    assert all(expected)
    assert completion_texts(lookahead) == expected


def test_streaming_completions_equal_plain_server(servers):
    plain, lookahead = servers
    assert completion_texts(lookahead, stream=True) == completion_texts(plain)


def test_chat_and_streaming_chat_equal_plain_server(servers):
    plain, lookahead = servers
    expected = chat_text(plain)
    assert expected
    assert chat_text(lookahead) == expected
    assert chat_text(lookahead, stream=True) == expected


def test_spec_decode_counters_move(servers):
    _, lookahead = servers
    drafts_before = lookahead.metric("vllm:spec_decode_num_drafts_total")
    accepted_before = lookahead.metric("vllm:spec_decode_num_accepted_tokens_total")
    completion_texts(lookahead)
    assert lookahead.metric("vllm:spec_decode_num_drafts_total") > drafts_before
    assert lookahead.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted_before


@pytest.mark.parametrize("xargs, message", [
    ({"lookahead_num_speculative_tokens": 25}, "lookahead_num_speculative_tokens must be an "
                                               "integer in [0, 24]"),
    ({"lookahead_draft_min_prob": -0.5}, "lookahead_draft_min_prob must be a number in [0, 1]"),
    ({"lookahead_window": 3}, "unknown per-request option 'lookahead_window'"),
])
def test_bad_per_request_option_is_http_400_and_the_server_goes_on(servers, xargs, message):
    plain, lookahead = servers
    model = lookahead.client.models.list().data[0].id
    response = requests.post(f"{lookahead.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": COMPLETION_PROMPTS[0], "max_tokens": 8, "vllm_xargs": xargs})
    assert response.status_code == 400 and message in response.text, response.text
    assert completion_texts(lookahead) == completion_texts(plain)


def test_per_request_options_are_served_and_lossless(servers):
    plain, lookahead = servers
    model = lookahead.client.models.list().data[0].id
    expected = completion_texts(plain)
    drafts_before = lookahead.metric("vllm:spec_decode_num_drafts_total")
    for k in (0, 2):
        xargs = {"lookahead_num_speculative_tokens": k, "lookahead_draft_min_prob": 0.3}
        generation = {**GENERATION, "extra_body": {**GENERATION["extra_body"],
                                                   "vllm_xargs": xargs}}
        texts = [lookahead.client.completions.create(model=model, prompt=prompt,
                                                     **generation).choices[0].text
                 for prompt in COMPLETION_PROMPTS]
        assert texts == expected
        if k == 0:  # speculation off for these requests: no drafts at all
            assert lookahead.metric("vllm:spec_decode_num_drafts_total") == drafts_before
            decided_before = drafting_decisions(lookahead)
    # K=2 keeps them speculating: drafted, or drafts cut (or steps left undrafted) by the
    # cost-aware cut, which decides on step times measured on this maybe busy machine
    # (one CI run counted no vLLM drafts for these requests)
    deadline = time.monotonic() + 10  # the workers' counters reach /metrics by snapshot
    while drafting_decisions(lookahead) == decided_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert drafting_decisions(lookahead) > decided_before


def drafting_decisions(server) -> float:
    """Drafts proposed, draft tokens the cost-aware cut took and steps it left undrafted:
    one of them moves whenever the proposer speculates for a request, whatever the load."""
    return sum(server.metric(name) for name in (
        "vllm:speculative_drafts_total", "vllm:lookahead_cut_draft_tokens_total",
        "vllm:lookahead_undrafted_steps_total"))


def test_per_request_options_on_a_server_without_lookahead_are_http_400(servers):
    plain, _ = servers
    response = requests.post(f"{plain.url}/v1/completions", timeout=60, json={
        "model": plain.client.models.list().data[0].id, "prompt": "x", "max_tokens": 2,
        "vllm_xargs": {"lookahead_num_speculative_tokens": 2}})
    assert response.status_code == 400
    assert "does not run speculative method 'lookahead'" in response.text


def test_requests_vllm_refuses_under_speculation_are_served_streamed_with_echo_and_usage(
        servers):
    """logit_bias and min_p (vLLM's speculative servers answer 400) through the OpenAI
    API, streamed with usage and echoed: plain decoding's answer, counted."""
    plain, lookahead = servers
    counter = "vllm:speculative_requests_without_drafts_total"
    before = lookahead.metric(counter)
    request = dict(prompt=COMPLETION_PROMPTS[1], max_tokens=48, temperature=0, echo=True,
                   logit_bias={"7": 4.0, "100": 2.5}, stream=True,
                   stream_options={"include_usage": True},
                   extra_body={"ignore_eos": True, "min_p": 0.1})

    def answer(server):
        chunks = list(server.client.completions.create(
            model=server.client.models.list().data[0].id, **request))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    (text, usage), expected = answer(lookahead), answer(plain)
    assert (text, usage) == expected
    assert text.startswith(COMPLETION_PROMPTS[1]) and usage.completion_tokens == 48
    deadline = time.monotonic() + 10  # the workers' snapshots are at most a second old
    while lookahead.metric(counter) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lookahead.metric(counter) == before + 1


def test_lookahead_metrics_move(servers):
    """Pool size and state count rise while a request runs and fall back when it ends."""
    _, lookahead = servers
    counters = ["vllm:speculative_drafts_total", "vllm:lookahead_harvested_ngrams_total",
                "vllm:speculative_generated_tokens_total", "vllm:lookahead_draft_tokens_total"]
    before = {name: lookahead.metric(name) for name in counters}
    observed, stop = threading.Event(), threading.Event()

    def watch():  # snapshots are at most a second old
        while not stop.is_set():
            if (lookahead.metric("vllm:speculative_active_requests") > 0
                    and lookahead.metric("vllm:lookahead_pool_ngrams") > 0):
                observed.set()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    model = lookahead.client.models.list().data[0].id
    prompts = make_prompts(8, seed=5)  # up to 300 tokens; + 700 fits max_model_len
    # A batch may end within the snapshot interval (under 1 s on 2 cores), so one batch
    # may give the watcher no snapshot to see: batches go on until it has seen one.
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(len(prompts)) as pool:
        while not observed.is_set() and time.monotonic() < deadline:
            list(pool.map(lambda prompt: lookahead.client.completions.create(
                model=model, prompt=prompt, max_tokens=700, temperature=0,
                extra_body={"ignore_eos": True}), prompts))
    stop.set()
    watcher.join()
    assert observed.is_set(), "never saw the running request in the proposer gauges"
    assert all(lookahead.metric(name) > before[name] for name in counters)
    assert lookahead.metric("vllm:speculative_compression_ratio") > 1.0
    deadline = time.monotonic() + 30
    while lookahead.metric("vllm:speculative_active_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lookahead.metric("vllm:speculative_active_requests") == 0
    assert lookahead.metric("vllm:lookahead_pool_ngrams") == 0
    assert lookahead.metric("vllm:lookahead_corpus_size_tokens") > 0


#: The soak server's KV pool: 4096 tokens of the tiny model (1 KiB a token in float32),
#: a fraction of what 32 requests in flight need, so vLLM preempts and recomputes.
SOAK_KV_BYTES = 4 * 2**20


@pytest.mark.soak
def test_soak_under_preemption_with_aborts_sampling_and_request_options(
        servers, llama_path, tmp_path):
    """A modest soak (``benchmarks.load_test`` runs the full size): 192 requests, 32 in
    flight, on a server with the defaults and a KV pool that forces preemption; a
    quarter of them dropped by the client mid-stream (the server aborts them, preempted
    or running), some sampled, a quarter with their own lookahead options, a few bad
    ones. No engine error, every greedy answer served to the end equal to no
    speculation's, the plugin's per-request state and live-corpus slots empty
    afterwards, resident memory flat over the second half."""
    plain, _ = servers
    pressed = Server(llama_path, ["--speculative-config", "lookahead",
                                  "--kv-cache-memory-bytes", str(SOAK_KV_BYTES)],
                     tmp_path / "soak.log")
    try:
        pressed.wait_ready()
        model = pressed.client.models.list().data[0].id
        specs = build_workload(make_prompts(16, seed=3), 192, max_model_len=1024, seed=1,
                               disconnect_share=0.32, sampled_share=0.15, bad_share=0.03,
                               near_limit_share=0.03, options_share=0.25)
        assert sum(s.disconnect_after_chunks is not None for s in specs) >= 192 // 5
        assert any(s.options and s.compared for s in specs)
        reference = asyncio.run(reference_outputs(plain.url, model, specs, 32, 900))
        load = asyncio.run(load_server(pressed.url, model, pressed.process.pid, specs, 32, 900))
        evaluation = evaluate(specs, load["outcomes"], reference, load, rss_bound_mib=128)
        preemptions = pressed.metric("vllm:num_preemptions_total")
    finally:
        pressed.stop()
    assert evaluation["passed"], json.dumps({k: evaluation[k] for k in ("checks", "unexpected",
                                                             "mismatched_requests",
                                                             "rss_growth_mib")}, indent=1)
    assert evaluation["statuses"]["disconnected"] > 0 and preemptions > 0
    assert evaluation["compared"] > 60
