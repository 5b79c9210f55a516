"""Draft proposers as the replay drives them: a batch of rows, one request a row, the
way vLLM's runner hands its input batch to a proposer (an empty row holds none)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from benchmarks.methods import Method
from vllm_lookahead.tree import path_by_tokens

MAX_MODEL_LEN = 8192
#: Vocabulary size given to lookahead's recycled top-k table: larger than any traced
#: tokenizer's (a replay has no target predictions, so the table stays empty).
REPLAY_VOCAB_SIZE = 1 << 18
#: Longest context suffix the copy oracle matches (lookahead's ``suffix_match_max``).
COPY_ORACLE_MAX_MATCH = 16


def accepted_length(draft: list[int], output: list[int], done: int) -> int:
    """How many of ``draft``'s tokens greedy verification accepts after ``done``
    tokens of ``output``."""
    accepted = 0
    while accepted < len(draft) and done + accepted < len(output) \
            and draft[accepted] == output[done + accepted]:
        accepted += 1
    return accepted


class Replayer:
    """One proposer with ``batch_size`` rows (vLLM's ``max_num_seqs``): each row's
    tokens so far, and the id of the request it holds."""

    def __init__(self, spec: dict, batch_size: int = 1):
        self.k = spec["num_speculative_tokens"]
        self.batch_size = batch_size
        self.tokens = np.zeros((batch_size, MAX_MODEL_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(batch_size, dtype=np.int32)
        self.req_ids: list[str | None] = [None] * batch_size

    def start(self, row: int, request_id: str, prompt: list[int], output: list[int]) -> None:
        """The request takes ``row`` with its prompt; ``output`` is what it will
        generate (only oracles look)."""
        self.req_ids[row] = request_id
        self.num_tokens[row] = len(prompt)
        self.tokens[row, : len(prompt)] = prompt

    def append(self, row: int, tokens: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.tokens[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def propose(self, sampled: list[list[int]]) -> list[list[int]]:
        """Each row's draft, given the tokens the row's request was given by the last
        pass (empty: no request decodes in the row, and it gets no draft)."""
        return [self.propose_row(row, tokens) if tokens else []
                for row, tokens in enumerate(sampled)]

    def propose_row(self, row: int, sampled: list[int]) -> list[int]:
        raise NotImplementedError

    def accepted(self, row: int, draft: list[int], output: list[int], done: int) -> int:
        """How many of the row's ``draft`` tokens greedy verification accepts after
        ``done`` tokens of ``output`` (a linear draft)."""
        return accepted_length(draft, output, done)

    def use_clock(self, clock, step_cost) -> None:
        """Time passes on ``clock``, a pass taking ``step_cost(tokens)`` seconds (a
        proposer without a cost model ignores both)."""

    def before_pass(self, num_tokens: int, num_requests: int) -> None:
        """A decode pass of ``num_tokens`` scheduled tokens for ``num_requests``
        requests starts (simulated clock)."""

    def finish(self, row: int) -> None:
        self.req_ids[row] = None


class NoDraftReplayer(Replayer):
    """``none``: no speculation, each pass yields one token a request."""

    def __init__(self, spec: dict | None, batch_size: int = 1):
        super().__init__({"num_speculative_tokens": 0}, batch_size)

    def propose_row(self, row, sampled):
        return []


class LookaheadReplayer(Replayer):
    def __init__(self, spec: dict, batch_size: int = 1):
        from vllm_lookahead.lookahead.options import DEFAULT_SPEC_TOKENS
        from vllm_lookahead.lookahead.proposer import LookaheadProposer
        from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY

        spec = {"num_speculative_tokens": DEFAULT_SPEC_TOKENS, **spec}
        super().__init__(spec, batch_size)

        options = {k: v for k, v in spec.items() if k not in ("method", "num_speculative_tokens")}
        self.runner = SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=self.req_ids,
                                        num_prompt_tokens=np.zeros(batch_size, np.int32)),
            requests={})
        config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=self.k),
            model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN,
                                         get_vocab_size=lambda: REPLAY_VOCAB_SIZE),
            scheduler_config=SimpleNamespace(max_num_seqs=batch_size),
            additional_config={ADDITIONAL_CONFIG_KEY: options})
        self.proposer = LookaheadProposer(config)
        self.proposer.bind_model_runner(self.runner)

    def start(self, row, request_id, prompt, output):
        """... a greedy request (whose drafts may be trees)."""
        from vllm import SamplingParams

        super().start(row, request_id, prompt, output)
        self.runner.input_batch.num_prompt_tokens[row] = len(prompt)
        self.runner.requests[request_id] = SimpleNamespace(
            sampling_params=SamplingParams(temperature=0.0))

    def propose(self, sampled):
        return self.proposer.propose(sampled, self.num_tokens, self.tokens)

    def accepted(self, row, draft, output, done):
        """... and of a tree draft, the nodes along the longest root path that
        ``output`` follows (the Jacobi window slides nowhere: a replay captures no
        predictions)."""
        parents = self.proposer.draft_tree(self.req_ids[row], draft)
        if parents is None:
            return super().accepted(row, draft, output, done)
        emitted = output[done : done + len(draft) + 1]
        pending = int(self.tokens[row, self.num_tokens[row] - 1])
        return len(path_by_tokens(parents, [pending, *draft], emitted))

    def use_clock(self, clock, step_cost):
        """... and where the engine measures the step's cost at start-up (trees
        ``auto``), the proposer learns it as the worker would tell it, exactly."""
        from vllm_lookahead.worker.start_cost import StartCost

        self.proposer.clock = clock
        if self.proposer.measures_start_cost:
            self.proposer.on_start_cost(StartCost(step_cost(1), step_cost.draft_token))

    def before_pass(self, num_tokens, num_requests):
        self.proposer.on_step_start(num_tokens, decode_only=True, num_requests=num_requests)

    def finish(self, row):
        request_id = self.req_ids[row]
        super().finish(row)
        del self.runner.requests[request_id]
        self.proposer.on_requests_removed({request_id}, set())


class NgramReplayer(Replayer):
    def __init__(self, spec: dict, batch_size: int = 1):
        super().__init__(spec, batch_size)
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        config = SimpleNamespace(
            speculative_config=SimpleNamespace(
                num_speculative_tokens=self.k, prompt_lookup_min=spec["prompt_lookup_min"],
                prompt_lookup_max=spec["prompt_lookup_max"]),
            model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
            scheduler_config=SimpleNamespace(max_num_seqs=batch_size),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.proposer = NgramProposer(config)

    def propose(self, sampled):
        return self.proposer.propose(self.k, sampled, self.num_tokens, self.tokens)


class SuffixReplayer(Replayer):
    """Arctic Inference's cache, called as vLLM's SuffixDecodingProposer calls it."""

    def __init__(self, spec: dict, batch_size: int = 1):
        super().__init__(spec, batch_size)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.depth = spec.get("suffix_decoding_max_tree_depth", 24)
        self.spec_factor = spec.get("suffix_decoding_max_spec_factor", 1.0)
        self.min_prob = spec.get("suffix_decoding_min_token_prob", 0.1)
        self.cache = SuffixDecodingCache(
            max_tree_depth=self.depth,
            max_cached_requests=spec.get("suffix_decoding_max_cached_requests", 10000))

    def start(self, row, request_id, prompt, output):
        super().start(row, request_id, prompt, output)
        self.cache.start_request(request_id, np.asarray(prompt, dtype=np.int32))

    def propose_row(self, row, sampled):
        request_id = self.req_ids[row]
        self.cache.add_active_response(request_id, sampled)
        n = int(self.num_tokens[row])
        pattern = self.tokens[row, max(0, n - self.depth) : n]
        draft = self.cache.speculate(request_id, pattern, max_spec_tokens=self.k,
                                     max_spec_factor=self.spec_factor,
                                     min_token_prob=self.min_prob)
        return list(draft.token_ids)

    def finish(self, row):
        self.cache.stop_request(self.req_ids[row])
        super().finish(row)


class CopyOracleReplayer(Replayer):
    """``copy-oracle``: the best copy of an earlier span, chosen knowing the output
    (the package's docstring)."""

    def __init__(self, spec: dict, batch_size: int = 1):
        super().__init__(spec, batch_size)
        #: shortest match it copies after ("min_match"; 1: the last token alone)
        self.min_match = spec.get("min_match", 1)
        self.futures: list[np.ndarray] = [np.zeros(0, dtype=np.int32)] * batch_size
        self.output_starts = [0] * batch_size
        #: the outputs of the requests finished before, each followed by a separator
        self.earlier_outputs = np.zeros(0, dtype=np.int32)

    def start(self, row, request_id, prompt, output):
        super().start(row, request_id, prompt, output)
        self.output_starts[row] = len(prompt)
        self.futures[row] = np.asarray(output, dtype=np.int32)

    def propose_row(self, row, sampled):
        n, done = int(self.num_tokens[row]), int(self.num_tokens[row]) - self.output_starts[row]
        truth = self.futures[row][done : done + self.k]
        suffix = self.tokens[row, max(0, n - COPY_ORACLE_MAX_MATCH) : n]
        copies = [(best_copy(text, size, suffix, truth), text) for text, size in (
            (self.tokens[row], n), (self.earlier_outputs, len(self.earlier_outputs)))]
        (match, start, length), text = max(copies, key=lambda copy: (copy[0][0], copy[0][2]))
        return text[start : start + length].tolist() if match >= self.min_match else []

    def finish(self, row):
        output = self.tokens[row, self.output_starts[row] : int(self.num_tokens[row])]
        self.earlier_outputs = np.concatenate([self.earlier_outputs, output, [-1]]).astype(np.int32)
        super().finish(row)


def best_copy(text: np.ndarray, size: int, suffix: np.ndarray, truth: np.ndarray
              ) -> tuple[int, int, int]:
    """(match length, start, length) of the best copy in ``text[:size]``: among the
    occurrences of the longest suffix of ``suffix`` (its last token at least) that
    ``text[: size - 1]`` repeats, the one whose continuation ``text[start : start +
    length]`` (within ``text[:size]``) equals the longest prefix of ``truth`` (ties:
    the latest); length 0 where none equals even its first token. A negative token
    separates texts."""
    ends = np.flatnonzero(text[: max(size - 1, 0)] == suffix[-1])
    if not len(ends):
        return 0, 0, 0
    match = _run_lengths(text, ends[:, None] - np.arange(1, len(suffix)), suffix[-2::-1], size) + 1
    ends = ends[match == match.max()]
    agree = _run_lengths(text, ends[:, None] + 1 + np.arange(len(truth)), truth, size)
    best = len(agree) - 1 - int(np.argmax(agree[::-1]))  # the latest of the longest
    return int(match.max()), int(ends[best]) + 1, int(agree[best])


def _run_lengths(text: np.ndarray, positions: np.ndarray, wanted: np.ndarray,
                 size: int) -> np.ndarray:
    """Per row of ``positions``: how many leading positions hold ``wanted``'s tokens (a
    position outside ``text[:size]`` ends the run)."""
    inside = (positions >= 0) & (positions < size)
    equal = inside & (text[np.clip(positions, 0, len(text) - 1)] == wanted)
    return np.cumprod(equal, axis=1).sum(axis=1)


REPLAYERS = {"none": NoDraftReplayer, "lookahead": LookaheadReplayer, "ngram": NgramReplayer,
             "suffix": SuffixReplayer, "copy-oracle": CopyOracleReplayer}
#: Methods only a replay can run (they read the output ahead), for ``--methods``.
REPLAY_ONLY_METHODS = {"copy-oracle": Method("copy-oracle", {"method": "copy-oracle",
                                                             "num_speculative_tokens": 24})}
