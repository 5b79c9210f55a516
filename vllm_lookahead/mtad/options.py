"""The ``mtad`` method's options (``speculative_config`` keys), validated at startup."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_lookahead.options import MethodOptions, option_field, options_table

#: MTAD's draft length γ when ``num_speculative_tokens`` is not given (the paper's 4).
DEFAULT_SPEC_TOKENS = 4
ACCEPTANCE_MODES = ("joint", "lossless")
AUXILIARY_RUNNERS = ("vllm", "transformers")
CANDIDATES = ("auto", "all", "best")


@dataclass(frozen=True)
class MTADOptions(MethodOptions):
    """Options of ``{"method": "mtad"}``; ``model`` is the auxiliary (draft) model."""

    METHOD = "mtad"

    model: str = option_field(
        dataclasses.MISSING, None,
        "Auxiliary model (local path or Hugging Face name) with the target's vocabulary; "
        "it drafts by beam sampling.",
    )
    beam_width: int = option_field(
        4, 1, "B: beams kept while drafting (verified: the best one, or all; `candidates`).",
        high=16,
    )
    acceptance: str = option_field(
        "joint", None,
        "`joint`: MTAD's rule, the longest draft prefix whose joint ratio P_target/Q_aux "
        "exceeds `acceptance_threshold` (over every path of a tree), then one token sampled "
        "from the target (not lossless: it favours likely sequences). `lossless`: the "
        "target's distribution exactly (vLLM's rejection sampler; a tree is walked by the "
        "target's own samples).",
        choices=ACCEPTANCE_MODES,
    )
    acceptance_threshold: float = option_field(
        0.5, 0.0, "τ of the joint rule (ignored by `lossless`).", low_open=True,
    )
    draft_temperature: float = option_field(
        1.0, 0.0, "Temperature of the auxiliary model's beam sampling.", high=100.0,
        low_open=True,
    )
    draft_top_k: int = option_field(10, 0, "Top-k of the auxiliary model's beam sampling (0: off).",
                                    high=1024)
    draft_top_p: float = option_field(
        0.9, 0.0, "Top-p of the auxiliary model's beam sampling.", low_open=True,
    )
    candidates: str = option_field(
        "best", None,
        "`all`: every distinct beam of a request is verified in the same target pass, as "
        "one token tree (the paper's multi-candidate MTAD; vLLM then schedules up to "
        "beam_width × num_speculative_tokens tokens a request). `best`: the best beam "
        "only, as a linear draft (the default: on 2 CPU cores `all` won on MT-Bench and "
        "lost on HumanEval, benchmarks/README.md run (z)). `auto`: `all` where the target's "
        "attention can verify trees (the tree step's start-up self-check passes), else "
        "`best`, logged.",
        choices=CANDIDATES,
    )
    auxiliary_runner: str = option_field(
        "vllm", None,
        "`vllm`: the auxiliary model runs on vLLM's model code, kernels and paged KV cache "
        "(beams in KV blocks of their own); where vLLM cannot (tensor or pipeline "
        "parallelism, a model vLLM cannot load) it runs on transformers, with the reason "
        "logged. `transformers`: always on transformers, first rank only.",
        choices=AUXILIARY_RUNNERS,
    )

    def scheduled_tokens(self, draft_length: int) -> int:
        """Tokens vLLM schedules a request for (its ``num_speculative_tokens``): the
        draft length γ, times the beams when all of them may be verified."""
        return draft_length if self.candidates == "best" else draft_length * self.beam_width

    def draft_length(self, scheduled_tokens: int) -> int:
        """γ from vLLM's ``num_speculative_tokens`` (the inverse of ``scheduled_tokens``)."""
        return scheduled_tokens if self.candidates == "best" else scheduled_tokens // self.beam_width


def mtad_options_table() -> str:
    """Markdown table of the ``mtad`` options, for docs/mtad.md (kept in sync by a test)."""
    return options_table(MTADOptions, DEFAULT_SPEC_TOKENS,
                         "γ: draft length (tokens per beam).")
