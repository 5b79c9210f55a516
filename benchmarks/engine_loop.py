"""The offline step loop: conversations through `LLMEngine.step()`, forward passes counted.

Outputs are requested as DELTAs, so every step that returns new tokens for a
request is exactly one forward pass of the target for that request (the pass
that verifies a draft and yields the accepted tokens plus one). Counting this for
every method, the compression ratio S = generated tokens / forward passes is
measured, not inferred from a method's own statistics. Prefill chunks that yield
no token are not counted; the pass that yields the first token is.

With `max_in_flight=1` this is batch-1 latency; with more, requests share steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.records import RequestRecord

#: next_prompt(conversation, answers so far) -> token ids of the next turn, or None when done.
NextPrompt = Callable[[int, list[list[int]]], "list[int] | None"]


@dataclass
class LoopResult:
    records: list[RequestRecord]  # in order of completion
    wall_seconds: float
    engine_steps: int  # steps that returned tokens to any request


def drive(engine, next_prompt: NextPrompt, conversations: int | range, sampling_params,
          max_in_flight: int,
          on_finish: Callable[[RequestRecord], None] | None = None) -> LoopResult:
    """Run conversations with at most `max_in_flight` requests in the engine at a time.

    `conversations`: how many (numbered from 0), or which. A conversation's next turn is
    added as soon as its previous turn finishes.
    """
    from vllm.sampling_params import RequestOutputKind

    params = sampling_params.clone()
    params.output_kind = RequestOutputKind.DELTA
    if isinstance(conversations, int):
        conversations = range(conversations)
    waiting = deque(conversations)
    answers: dict[int, list[list[int]]] = {conversation: [] for conversation in conversations}
    active: dict[str, RequestRecord] = {}
    records: list[RequestRecord] = []

    def start(conversation: int) -> bool:
        prompt = next_prompt(conversation, answers[conversation])
        if prompt is None:
            return False
        turn = len(answers[conversation])
        request_id = f"c{conversation}-t{turn}"
        active[request_id] = RequestRecord(conversation, turn, len(prompt), time.perf_counter())
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        return True

    def fill() -> None:
        while len(active) < max_in_flight and waiting:
            start(waiting.popleft())

    started = time.perf_counter()
    engine_steps = 0
    fill()
    while active:
        outputs = engine.step()
        now = time.perf_counter()
        produced = False
        for output in outputs:
            record = active.get(output.request_id)
            if record is None:
                continue
            tokens = list(output.outputs[0].token_ids) if output.outputs else []
            produced |= bool(tokens)
            record.add_tokens(now, tokens)
            if output.finished:
                record.finished = now
                del active[output.request_id]
                answers[record.conversation].append(record.output)
                records.append(record)
                if on_finish is not None:
                    on_finish(record)
                if not start(record.conversation):
                    fill()
        engine_steps += produced
    return LoopResult(records, time.perf_counter() - started, engine_steps)
