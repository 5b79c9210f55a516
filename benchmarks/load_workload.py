"""The load test's workload: seeded requests of mixed shapes, and a client that sends
them with a number in flight (``benchmarks.load_test``, ``tests/test_server.py``)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from benchmarks.sse import data_events

MAX_TOKENS_CHOICES = (16, 64, 128, 256)
BAD_OPTION = {"lookahead_num_speculative_tokens": 10_000}
PER_REQUEST_OPTIONS = ({"lookahead_num_speculative_tokens": 0},
                       {"lookahead_num_speculative_tokens": 3},
                       {"lookahead_draft_min_prob": 0.4},
                       {"lookahead_tree_candidates": 0, "lookahead_tree_window": 0})


@dataclass
class RequestSpec:
    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    disconnect_after_chunks: int | None = None  # the client drops the stream
    temperature: float = 0.0
    bad_option: bool = False  # must be rejected with HTTP 400
    near_max_model_len: bool = False
    options: dict | None = None  # valid per-request lookahead options (vllm_xargs)

    @property
    def compared(self) -> bool:
        """Greedy, served to the end: must equal the reference."""
        return (self.temperature == 0 and not self.bad_option
                and self.disconnect_after_chunks is None)


@dataclass
class Outcome:
    status: str  # completed | disconnected | rejected | failed
    tokens: list[int] = field(default_factory=list)
    http_status: int | None = None
    detail: str = ""


def build_workload(prompts: list[list[int]], num_requests: int, max_model_len: int,
                   seed: int = 0, disconnect_share: float = 0.15, sampled_share: float = 0.1,
                   bad_share: float = 0.02, near_limit_share: float = 0.02,
                   options_share: float = 0.0) -> list[RequestSpec]:
    """Seeded requests; ``options_share`` of the others carry valid per-request options
    (a lower K, 0 included, or another draft_min_prob), which must not change a greedy
    answer."""
    rng = random.Random(seed)
    specs = []
    for index in range(num_requests):
        prompt = list(prompts[index % len(prompts)])
        max_tokens = rng.choice(MAX_TOKENS_CHOICES)
        spec = RequestSpec(index, prompt, max_tokens, stream=rng.random() < 0.5)
        draw = rng.random()
        if draw < near_limit_share:  # fill to the limit with the prompt's own tokens
            spec.near_max_model_len = True
            length = max_model_len - max_tokens - rng.randint(0, 3)
            spec.prompt = (prompt * (length // len(prompt) + 1))[:length]
        elif draw < near_limit_share + bad_share:
            spec.bad_option = True
        elif draw < near_limit_share + bad_share + sampled_share:
            spec.temperature = 0.8
        elif spec.stream and rng.random() < disconnect_share * 2:  # streams are half
            spec.disconnect_after_chunks = rng.randint(1, 8)
        if not spec.bad_option and rng.random() < options_share:
            spec.options = rng.choice(PER_REQUEST_OPTIONS)
        spec.prompt = spec.prompt[: max_model_len - max_tokens]
        specs.append(spec)
    return specs


async def run_workload(base_url: str, model: str, specs: list[RequestSpec], concurrency: int,
                       request_timeout: float, on_done=None) -> dict[int, Outcome]:
    """Send ``specs`` with ``concurrency`` requests in flight; never raises per request."""
    import httpx

    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    outcomes: dict[int, Outcome] = {}

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            try:
                outcomes[spec.index] = await asyncio.wait_for(
                    _send(client, base_url, model, spec), request_timeout)
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                outcomes[spec.index] = Outcome("failed", detail=f"{type(exc).__name__}: {exc}")
            if on_done is not None:
                on_done()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=request_timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return outcomes


async def _send(client, base_url: str, model: str, spec: RequestSpec) -> Outcome:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "ignore_eos": True, "return_token_ids": True,
            "stream": spec.stream}
    if spec.temperature:
        body["top_p"] = 0.95
    if spec.bad_option:
        body["vllm_xargs"] = BAD_OPTION
    elif spec.options:
        body["vllm_xargs"] = spec.options
    url = f"{base_url}/v1/completions"
    if not spec.stream:
        response = await client.post(url, json=body)
        if not response.is_success:
            return Outcome("rejected", http_status=response.status_code, detail=response.text)
        return _checked(spec, response.json()["choices"][0]["token_ids"])
    tokens, chunks = [], 0
    async with client.stream("POST", url, json=body) as response:
        if not response.is_success:
            detail = (await response.aread()).decode(errors="replace")
            return Outcome("rejected", http_status=response.status_code, detail=detail)
        async for chunk in data_events(response):
            if "error" in chunk:  # a request refused after the stream began (vLLM:
                error = chunk["error"]  # admission checks) names its HTTP status here
                status = "rejected" if error.get("code") == 400 else "failed"
                return Outcome(status, tokens, error.get("code"), str(error.get("message")))
            for choice in chunk.get("choices") or ():
                tokens += choice.get("token_ids") or []
            chunks += 1
            if chunks == spec.disconnect_after_chunks:
                return Outcome("disconnected", tokens)  # leaving the block closes it
    return _checked(spec, tokens)


def _checked(spec: RequestSpec, tokens: list[int]) -> Outcome:
    if len(tokens) != spec.max_tokens:
        return Outcome("failed", tokens, 200,
                       f"{len(tokens)} tokens for max_tokens={spec.max_tokens} with ignore_eos")
    return Outcome("completed", tokens, 200)
