"""SamplingParams: defaults, normalisation and rejection of invalid values."""

import dataclasses
import math

import pytest

from lp_jax.core.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed) == (1.0, -1, 1.0, None)
    assert (sp.max_tokens, sp.stop_token_ids, sp.ignore_eos) == (16, frozenset(), False)
    assert not sp.greedy


def test_valid_values():
    sp = SamplingParams(
        temperature=0, top_k=1, top_p=0.01, seed=0, max_tokens=1, stop_token_ids=[5, 0]
    )
    assert sp.greedy
    assert sp.stop_token_ids == {5, 0}  # a list is stored as a frozenset (O(1) checks)
    assert SamplingParams(temperature=2.5, top_k=50, top_p=1).top_p == 1


def test_frozen_slotted_hashable():
    sp = SamplingParams(stop_token_ids=[1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 0.5  # type: ignore[misc]
    assert not hasattr(sp, "__dict__")
    assert hash(sp) == hash(SamplingParams(stop_token_ids=(1, 2)))
    assert sp == SamplingParams(stop_token_ids=(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "at most 64 stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logprobs_penalties_bias_and_min_tokens():
    sp = SamplingParams(logprobs=20, min_tokens=3, presence_penalty=-2, frequency_penalty=2,
                        repetition_penalty=1.2, logit_bias={5: 1, 2: -100.0})
    assert sp.logprobs == 20 and sp.min_tokens == 3 and sp.has_penalties
    assert sp.logit_bias == ((2, -100.0), (5, 1.0))  # sorted pairs: the params stay hashable
    assert isinstance(sp.presence_penalty, float)
    hash(sp)
    assert not SamplingParams().has_penalties and SamplingParams().logprobs is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty="1"), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.inf}), "logit_bias"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(logit_bias=5), "logit_bias"),
])
def test_new_fields_reject_bad_values_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
