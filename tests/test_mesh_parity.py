"""The sharded model gives one device's logits on every mesh (8 simulated CPUs)."""

import jax
import numpy as np
import pytest

from lp_jax.loader import load_model
from lp_jax.models.simple import greedy_generate
from lp_jax.sharding import make_mesh

PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9]


def test_eight_devices_present():
    assert len(jax.devices()) >= 8, "conftest must force 8 host devices before JAX loads"


@pytest.fixture(scope="module")
def reference(tiny_dir):
    tokens, logits = greedy_generate(load_model(tiny_dir), PROMPT, 4, return_prompt_logits=True)
    return tokens, logits


@pytest.mark.parametrize("expert,tensor", [(1, 1), (1, 8), (8, 1), (2, 4)])
def test_mesh_matches_single_device(tiny_dir, reference, expert, tensor):
    mesh = make_mesh(expert=expert, tensor=tensor)
    model = load_model(tiny_dir, mesh=mesh)
    # The parameters really are spread over the mesh.
    w = model.model.layers.mlp.experts_gate_up_proj[...]
    assert len(w.sharding.device_set) == expert * tensor
    tokens, logits = greedy_generate(model, PROMPT, 4, return_prompt_logits=True)
    np.testing.assert_allclose(logits, reference[1], rtol=0, atol=1e-4)
    assert tokens == reference[0]
