"""SamplingParams: defaults, normalisation and rejection of invalid values."""

import dataclasses
import math

import pytest

from lp_jax.engine.sampling_params import SamplingParams


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
