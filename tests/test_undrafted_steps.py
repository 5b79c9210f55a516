"""A speculative step without draft tokens skips vLLM's rejection sampling
(``worker/sampler.bonus_tokens_only``): the same verdict, the bonus tokens, without
the vocabulary of noise vLLM draws for sampled rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler

from vllm_lookahead.worker.sampler import _hooked_rejection_sample

VOCAB = 64
BONUS = torch.tensor([[5], [7], [9]], dtype=torch.int32)
# vLLM's own function, whether or not the plugin has wrapped it in this process
VLLM_REJECTION_SAMPLE = getattr(rejection_sampler.rejection_sample, "__wrapped__",
                                rejection_sampler.rejection_sample)


def sampling(temperatures: list[float]) -> SimpleNamespace:
    """What ``rejection_sample`` reads of vLLM's ``SamplingMetadata``."""
    t = torch.tensor(temperatures, dtype=torch.float32)
    return SimpleNamespace(all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()),
                           temperature=t, generators={})


def undrafted_args(temperatures: list[float]) -> tuple:
    rows = len(temperatures)
    return (torch.empty(0, dtype=torch.int32), [0] * rows, 0,
            torch.zeros(rows, dtype=torch.int32), None, torch.empty(0, VOCAB),
            BONUS[:rows].clone(), sampling(temperatures))


@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [0.0, 0.7, 1.0], [0.7, 1.0, 0.7]])
def test_the_verdict_is_vllms(temperatures):
    register = getattr(type(current_platform), "register_triton_kernel_overrides", None)
    if register is None:  # 0.26 on CPU; CUDA kernels would need CUDA tensors
        pytest.skip("vLLM's rejection kernels are callable outside an engine only with "
                    "vLLM 0.32's CPU overrides")
    register()
    hooked = _hooked_rejection_sample(VLLM_REJECTION_SAMPLE)
    expected = VLLM_REJECTION_SAMPLE(*undrafted_args(temperatures))
    got = hooked(*undrafted_args(temperatures))
    assert got.dtype == expected.dtype and got.tolist() == expected.tolist()


def test_undrafted_steps_draw_no_noise():
    """vLLM draws a row of exponential noise over the vocabulary per sampled request
    (1.2 ms a step on a 2-core CPU at 49152 tokens); without draft tokens none is needed,
    and steps with drafts still go to vLLM."""
    calls = []

    def original(*args, **kwargs):
        calls.append(len(args[0]))
        return "vLLM's verdict"

    hooked = _hooked_rejection_sample(original)
    state = torch.get_rng_state()
    assert hooked(*undrafted_args([0.7, 1.0, 0.7])).tolist() == [[5], [7], [9]]
    assert torch.equal(torch.get_rng_state(), state)
    assert calls == []
    drafted = hooked(torch.tensor([3], dtype=torch.int32), [1, 0, 0], 1,
                     torch.tensor([1, 1, 1], dtype=torch.int32), None, torch.zeros(1, VOCAB),
                     BONUS.clone(), sampling([0.7, 1.0, 0.7]))
    assert drafted == "vLLM's verdict" and calls == [1]
