"""The lookahead method's options: defaults, documentation, validation, and the
per-request overrides (``SamplingParams.extra_args``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_lookahead.options import (
    MAX_SPEC_TOKENS,
    MethodOptions,
    check_value,
    option_field,
    options_table,
)

#: K when ``num_speculative_tokens`` is not given.
DEFAULT_SPEC_TOKENS = 24
TREE_MODES = ("auto", "on", "off")
UNIFORM_MODES = ("auto", "on", "off")
#: ``recycle_top_k: "auto"`` where trees are on.
RECYCLE_TOP_K_WITH_TREES = 8
#: Upper bounds of the size options, refused at start-up beyond them. The corpora keep
#: three int32 arrays a token (about 12 bytes, 200 MiB at the bound, per worker); the
#: recycled table is vocabulary x k token ids and log-probabilities (152k x 64: 78 MB);
#: a step verifies at most vLLM's 128 draft tokens a request, which bounds the rest.
MAX_CORPUS_TOKENS = 1 << 24
MAX_TOP_K = 64
MAX_TREE_SIZE = 64


@dataclass(frozen=True)
class LookaheadOptions(MethodOptions):
    """Options of ``{"method": "lookahead"}``; every field is a ``speculative_config`` key."""

    METHOD = "lookahead"
    RETIRED = {"tree_free_tokens": (
        "trees `auto` no longer read a start-up threshold; they measure whether tree steps "
        "pay while serving. Set trees to `on` or `off` to fix the choice.")}

    ngram_size: int = option_field(
        4, 2, "N: n-gram length in the pool (a key token plus N-1 continuation tokens).",
        high=16,
    )
    window_size: int = option_field(
        8, 1, high=MAX_SPEC_TOKENS, doc=
        "W: Jacobi columns harvested per verification pass (the target's predictions "
        "at the draft positions, also after the first rejection).",
    )
    guess_set_size: int = option_field(
        8, 0, high=MAX_TOP_K, doc=
        "G: most recent pool entries ranked per key when a draft comes from the pool; "
        "0 drafts from prompt/output suffix matches only.",
    )
    pool_from_prompt: bool = option_field(True, None, "Seed the pool with the prompt's n-grams.")
    pool_max_per_key: int = option_field(
        8, 1, "Pool bound: entries kept per key token (least recently used evicted).",
        high=256,
    )
    pool_max_keys: int = option_field(
        65536, 1, "Pool bound: key tokens kept per request (least recently used evicted).",
        high=1 << 20,
    )
    suffix_match_min: int = option_field(
        2, 1, "Shortest context suffix that a prompt/output match must repeat.", high=256,
    )
    suffix_match_max: int = option_field(
        16, 1, "Longest context suffix tried for a prompt/output match.", high=256,
    )
    draft_min_prob: float = option_field(
        0.1, None,
        "Drafts stop where their estimated probability (product of the continuation "
        "frequencies among context matches and pool entries) would fall below this.",
    )
    adaptive_draft_length: bool = option_field(
        True, None,
        "Bound each request's draft length by its recent acceptance: grown after a fully "
        "accepted draft, cut after a rejection (K stays the maximum).",
    )
    cost_aware_drafts: bool = option_field(
        True, None,
        "Under load, cut drafts to the tokens the step's compute affords: the decode step "
        "time (start to start) is fitted online against its token count, and a draft token "
        "is kept only while its expected acceptance (the worker's acceptance by draft "
        "position, by the source of each token and by how well the source supported it "
        "(seen once, copied after a long match, unanimous, a majority or a minority of the "
        "occurrences), among requests sampled alike (greedy, or by temperature and top-p), "
        "the first token's scaled by its request's own record; learned from every proposed "
        "draft, cut ones too, against the text then generated) raises the "
        "expected tokens per second of the whole step (an accepted token counted as 0.8 "
        "of one: where the batch drains, a request finishing early saves less than a "
        "step's share), at most half the kept tokens "
        "checked lately (at least 32, the longest draft or the free tokens): a burst of "
        "new requests on expensive tokens "
        "verifies its untested drafts a little at a time. A step where not even a "
        "certain token would pay is not drafted. At batch size 1 it rarely cuts. "
        "Tree nodes (tree_candidates, tree_window) hang below the main draft it kept; "
        "whether a step has them is the trees option's.",
    )
    corpus_tokens: int = option_field(
        262144, 0, high=MAX_CORPUS_TOKENS, doc=
        "Cross-request memory: tokens of finished responses kept (per worker, oldest "
        "dropped) and searched for repeats of the context's suffix; 0 turns all "
        "cross-request memory off (live_corpus_tokens too).",
    )
    live_corpus_tokens: int = option_field(
        262144, 0, high=MAX_CORPUS_TOKENS, doc=
        "Cross-request memory of the responses being generated: the other requests' "
        "outputs so far, searched like the finished ones (per worker, split evenly "
        "among max_num_seqs requests, each keeping its first tokens); 0 turns it off.",
    )
    harvest_jacobi: bool = option_field(
        True, None, "Feed the pool with the target's predictions captured at verification."
    )
    rescoring_top_k: int = option_field(
        0, 0, high=MAX_TOP_K, doc=
        "Draft rescoring (blockwise parallel decoding's lattice): capture the target's "
        "top-k tokens at the draft positions past a rejection, and choose the draft after "
        "the correction token among the pool's entries and the lattice's top path by "
        "pool frequency times lattice probability; 0 turns it off.",
    )
    recycle_top_k: int | str = option_field(
        "auto", 0, high=MAX_TOP_K, doc=
        "Token Recycling: keep the target's top-k next tokens after every token it has "
        "seen in any pass (draft positions, rejected ones too, and the sampled position; "
        "vocabulary x k per worker, shared by its requests) and continue a draft the "
        "context match and the pool cannot continue along the target's most likely next "
        "token, while the draft's probability estimate (times the target's probabilities) "
        "stays at or above draft_min_prob; where trees are on, also tree branches. `auto`: "
        f"{RECYCLE_TOP_K_WITH_TREES} where trees are on, else 0 (the capture is a top-k over "
        "the vocabulary at every verified position; as a linear source alone it earned "
        "0-2 % of the accepted tokens on a small CPU, about what it costs there), and no "
        "capture in a pass that verifies drafts filled to K (uniform_drafts), which grow "
        "no trees; 0 turns it off.",
        auto=True,
    )
    uniform_drafts: str = option_field(
        "auto", None,
        "Fill every draft to K tokens (the pool's next guesses, the recycled top-k, the "
        "last token repeated) so that a decode step is uniform (every request 1 + K "
        "tokens) and replays vLLM's full CUDA graph instead of running piecewise. "
        "`auto`: only where the runner has such graphs for the batch size and uniform "
        "steps are measured no slower than the others (each shape timed by batch size, "
        "the slower one retried now and then, each judged by its recent median); `on`: "
        "whenever every request of the step decodes with K tokens allowed; `off`: never. "
        "A step that fills grows no trees (tree steps run without CUDA graphs).",
        choices=UNIFORM_MODES,
    )
    trees: str = option_field(
        "auto", None,
        "Tree drafts (tree_candidates, tree_window), verified beside the main draft in one "
        "pass where the tree step's start-up self-check passes on the device (`auto`: else "
        "drafts stay linear, logged). `auto`: a step grows trees where they were measured "
        "to pay on this model and host: per batch size, the tokens tree steps emit over "
        "those their main drafts alone earn, against a tree step's time over a linear "
        "one's; both shapes are tried first, the losing one retried now and then, the "
        "first choice logged. `on`: trees in every step that can have them; an engine "
        "whose self-check fails refuses to start, naming the check's verdict. `off`: "
        "linear drafts, no self-check, no scratch blocks held.",
        choices=TREE_MODES,
    )
    tree_candidates: int = option_field(
        4, 0, high=MAX_TREE_SIZE, doc=
        "Tree drafts: the pool's most frequent continuations of the last token, and (with "
        "recycling) up to as many (ngram_size - 1)-token chains' worth of nodes from "
        "the target's recycled top-k, grown best-first by probability, verified beside "
        "the main draft in one pass (a token tree; its branches run through the "
        "attention kernel as sequences of their own); 0 turns them off.",
    )
    tree_window: int = option_field(
        4, 0, high=MAX_TREE_SIZE, doc=
        "Tree drafts: columns of Lookahead Decoding's Jacobi window (ngram_size - 1 "
        "levels) run in the same pass; each step harvests one n-gram per column and "
        "slides the window; 0 turns the window off.",
    )

    @property
    def tree_drafts(self) -> bool:
        """Trees may be built (subject to the target's attention and the self-check)."""
        return self.trees != "off" and bool(self.tree_candidates or self.tree_window)

    def recycled_top_k(self, trees_on: bool) -> int:
        """``recycle_top_k`` resolved for a worker whose trees are (or are not) on."""
        if self.recycle_top_k == "auto":
            return RECYCLE_TOP_K_WITH_TREES if trees_on else 0
        return self.recycle_top_k

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "LookaheadOptions":
        options = super().from_dict(values)
        if options.tree_window and options.ngram_size < 3:
            if "tree_window" in (values or {}):
                raise ValueError(
                    "lookahead: tree_window needs ngram_size >= 3 (its levels are the "
                    f"n-gram's continuation tokens; got ngram_size {options.ngram_size})")
            options = dataclasses.replace(options, tree_window=0)  # the default's window
        if options.suffix_match_min > options.suffix_match_max:
            raise ValueError(
                "lookahead: suffix_match_min must be <= suffix_match_max "
                f"(got {options.suffix_match_min} > {options.suffix_match_max})"
            )
        return options



#: Per-request overrides: keys of ``SamplingParams.extra_args`` (``vllm_xargs`` in the
#: OpenAI API) named by this prefix and an option.
REQUEST_KEY_PREFIX = "lookahead_"
REQUEST_OPTIONS = ("num_speculative_tokens", "draft_min_prob", "tree_candidates",
                   "tree_window")


def request_overrides(extra_args: dict[str, Any] | None, server_k: int,
                      server_options: LookaheadOptions | None = None) -> dict[str, Any]:
    """A request's validated overrides, by option name; errors name the key and range.

    ``num_speculative_tokens`` is bounded by the server's K (0: no drafts for this
    request), ``tree_candidates`` and ``tree_window`` by the server's values (0: no
    such nodes for this request); ``draft_min_prob`` accepts what the server option
    accepts.
    """
    server_options = server_options or LookaheadOptions()
    # options bounded by the server's value (the server reserves for its maxima)
    server_maxima = {"num_speculative_tokens": server_k,
                     "tree_candidates": server_options.tree_candidates,
                     "tree_window": server_options.tree_window}
    overrides = {}
    for key, value in (extra_args or {}).items():
        if not key.startswith(REQUEST_KEY_PREFIX):
            continue
        name = key[len(REQUEST_KEY_PREFIX):]
        if name in server_maxima:
            most = server_maxima[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                off = "0 turns speculation off for the request; " * (
                    name == "num_speculative_tokens")
                raise ValueError(f"{key} must be an integer in [0, {most}] ({off}{most} is "
                                 f"the server's {name}) (got {value!r})")
        elif name in REQUEST_OPTIONS:
            field_ = next(f for f in dataclasses.fields(LookaheadOptions) if f.name == name)
            value = check_value(field_, value, label=key)
        else:
            accepted = ", ".join(REQUEST_KEY_PREFIX + n for n in REQUEST_OPTIONS)
            raise ValueError(f"unknown per-request option {key!r}; accepted: {accepted}")
        overrides[name] = value
    return overrides




def lookahead_options_table() -> str:
    """Markdown table of the ``lookahead`` options, for docs/options.md (kept in sync by a test)."""
    return options_table(LookaheadOptions, DEFAULT_SPEC_TOKENS,
                         "Most draft tokens verified per step (the cap of the adaptive "
                         "draft length).")
