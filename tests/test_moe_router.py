"""Router variants (`pallas_kernels.moe.ref.Router`, `route`) against a numpy reference.

* softmax top-k, without bias, groups or scaling, is the plain softmax top-k bit for bit;
* sigmoid scores, `e_score_correction_bias`, group-limited top-k, norm_topk_prob and
  routed_scaling_factor equal a numpy reference, on logits built with ties (equal
  expert scores, equal group scores: the lower id wins) and on a correction bias that
  changes the choice but never the weights;
* every backend (xla, xla_tiles, tpu and gpu interpreted) and both dispatch schemes
  (allreduce, all_to_all on 8 CPU devices) route with the variant: their outputs equal
  the dense oracle's with the same router, and differ from softmax routing's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.models.sharded_kernels import sharded_moe_ffn
from lp_jax.sharding import make_mesh, named_sharding
from pallas_kernels.moe import gpu, moe_ffn, tpu
from pallas_kernels.moe.ref import Router, ref_moe_ffn_dense, route

E, D, F, A = 8, 16, 16, 2
SIGMOID_GROUPS = Router("sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)


def np_route(logits_TE, top_k, norm, router, bias_E=None):
    """The published models' routing in numpy, float64; ties to the lower id."""
    logits_TE = np.asarray(logits_TE, np.float64)
    if router.scoring == "sigmoid":
        scores_TE = 1 / (1 + np.exp(-logits_TE))
    else:
        z = np.exp(logits_TE - logits_TE.max(-1, keepdims=True))
        scores_TE = z / z.sum(-1, keepdims=True)
    choice_TE = scores_TE + (0 if bias_E is None else np.asarray(bias_E, np.float64))
    T, n = choice_TE.shape
    G = router.n_group
    ids_TA = np.zeros((T, top_k), np.int64)
    for t in range(T):
        per_group = choice_TE[t].reshape(G, n // G)
        group_score = np.sort(per_group, axis=1)[:, ::-1][:, :2].sum(1)
        kept = np.argsort(-group_score, kind="stable")[:router.topk_group]
        allowed = np.isin(np.arange(n) // (n // G), kept)
        c = np.where(allowed, choice_TE[t], -np.inf)
        ids_TA[t] = np.argsort(-c, kind="stable")[:top_k]
    w_TA = np.take_along_axis(scores_TE, ids_TA, 1)
    if norm:
        w_TA = w_TA / w_TA.sum(1, keepdims=True)
    return w_TA * router.routed_scaling_factor, ids_TA


def _logits_with_ties(T=12, seed=0):
    """Logits on a coarse grid (many equal scores inside a token) and two tokens whose
    groups tie exactly."""
    rng = np.random.default_rng(seed)
    logits_TE = rng.integers(-3, 4, size=(T, E)).astype(np.float32) / 2
    logits_TE[0] = 0.5  # every expert ties: groups and experts go by id
    logits_TE[1] = [1, 0, 1, 0, 0, 1, 0, 1]  # all four groups score 1 + 0
    return logits_TE


def test_softmax_default_is_plain_softmax_topk_bitwise():
    logits_TE = jnp.asarray(np.random.default_rng(1).normal(size=(9, E)) * 3, jnp.bfloat16)
    for norm in (False, True):
        w, ids = route(logits_TE, A, norm)
        p = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
        w_ref, ids_ref = jax.lax.top_k(p, A)
        if norm:
            w_ref = w_ref / jnp.sum(w_ref, axis=-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(w_ref))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))


@pytest.mark.parametrize("router", [
    Router("sigmoid"), Router("sigmoid", routed_scaling_factor=2.5), SIGMOID_GROUPS,
    Router("softmax", n_group=2, topk_group=1), Router("sigmoid", n_group=8, topk_group=3),
], ids=repr)
@pytest.mark.parametrize("bias", [False, True])
def test_route_matches_numpy_on_ties(router, bias):
    logits_TE = _logits_with_ties()
    bias_E = np.linspace(-0.2, 0.3, E).astype(np.float32) if bias else None
    for norm in (False, True):
        w, ids = route(jnp.asarray(logits_TE), A, norm, router,
                       None if bias_E is None else jnp.asarray(bias_E))
        w_ref, ids_ref = np_route(logits_TE, A, norm, router, bias_E)
        np.testing.assert_array_equal(np.asarray(ids), ids_ref)
        np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-6)


def test_correction_bias_chooses_but_does_not_weight():
    """Expert 7 has the lowest score but a bias that puts it first: it is chosen, with
    its unbiased sigmoid score as weight."""
    logits_TE = jnp.asarray([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
    bias_E = jnp.zeros(E).at[7].set(1.0)
    _, ids = route(logits_TE, A, False, Router("sigmoid"))
    assert ids.tolist() == [[0, 1]]
    w, ids = route(logits_TE, A, False, Router("sigmoid"), bias_E)
    assert ids.tolist() == [[7, 0]]
    np.testing.assert_allclose(np.asarray(w), [[1 / (1 + np.exp(2.0)), 1 / (1 + np.exp(-2.0))]],
                               rtol=1e-6)


def test_group_limit_excludes_the_best_expert_of_a_weak_group():
    """Group 0 = experts {0, 1}: expert 0 is the best expert but its group (one strong,
    one weak) loses to groups whose two experts are both good."""
    logits_TE = jnp.asarray([[3.0, -6.0, 2.0, 2.0, 1.8, 1.8, -6.0, -6.0]])
    router = Router("sigmoid", n_group=4, topk_group=2)
    _, ids = route(logits_TE, A, True, router)
    assert sorted(ids.tolist()[0]) == [2, 3]
    assert route(logits_TE, A, True, Router("sigmoid"))[1].tolist()[0][0] == 0


def test_router_checks_its_shape():
    with pytest.raises(ValueError, match="topk_group"):
        Router(n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="scoring"):
        Router("relu")
    with pytest.raises(ValueError, match="do not split"):
        route(jnp.zeros((2, E)), A, True, Router(n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="do not fit"):
        route(jnp.zeros((2, E)), 3, True, Router(n_group=8, topk_group=1))


# ------------------------------------------------------- every backend, both schemes
@functools.cache
def _case():
    rng = np.random.default_rng(7)
    T = 16
    x = rng.normal(size=(T, D)).astype(np.float32)
    logits = rng.normal(size=(T, E)).astype(np.float32)
    wgu = (rng.normal(size=(E, D, 2 * F)) / 4).astype(np.float32)
    wd = (rng.normal(size=(E, F, D)) / 4).astype(np.float32)
    bias = (rng.normal(size=E) * 0.3).astype(np.float32)
    mask = np.arange(T) % 5 != 2
    return tuple(map(jnp.asarray, (x, logits, wgu, wd, bias, mask)))


def _backend_call(backend, x, logits, wgu, wd, bias, mask, router):
    kw = dict(top_k=A, norm_topk_prob=True, token_mask_T=mask, router=router,
              correction_bias_E=bias)
    if backend == "tpu":
        return tpu.moe_ffn_tpu(x, logits, wgu, wd, **kw, interpret=True,
                               tiling=tpu.TpuTiling(tm=8, tk=16, tn=16, down_tk=16, down_tn=16))
    if backend == "gpu":
        return gpu.moe_ffn_gpu(x, logits, wgu, wd, **kw, interpret=True, num_sms=4,
                               tiling=gpu.GpuTiling(tm=8, bk=16, gate_up_bn=16, down_bn=16,
                                                    stages=2))
    return moe_ffn(x, logits, wgu, wd, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["xla", "xla_tiles", "tpu", "gpu"])
def test_every_backend_routes_with_the_variant(backend):
    x, logits, wgu, wd, bias, mask = _case()
    y, stats = jax.jit(functools.partial(_backend_call, backend, router=SIGMOID_GROUPS))(
        x, logits, wgu, wd, bias, mask)
    want = ref_moe_ffn_dense(x, logits, wgu, wd, top_k=A, norm_topk_prob=True,
                             token_mask_T=mask, router=SIGMOID_GROUPS, correction_bias_E=bias)
    softmax = ref_moe_ffn_dense(x, logits, wgu, wd, top_k=A, norm_topk_prob=True,
                                token_mask_T=mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(want) - np.asarray(softmax)).max() > 0.1
    _, ids = np_route(np.asarray(logits), A, True, SIGMOID_GROUPS, np.asarray(bias))
    counts = np.bincount(ids[np.asarray(mask)].ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"]), counts)


@pytest.mark.parametrize("scheme", [dict(dispatch="allreduce"),
                                    dict(dispatch="all_to_all", _transport="capacity")],
                         ids=lambda s: s["dispatch"])
def test_both_dispatch_schemes_route_with_the_variant(scheme):
    mesh = make_mesh(1, 8, 1)
    x, logits, wgu, wd, bias, mask = _case()
    L2 = lambda w: jnp.stack([w * 0, w])  # stacked [2, E, ...]: layer 1 is the real one
    axes = (("layers", "experts", "embed", "expert_mlp"),
            ("layers", "experts", "expert_mlp", "embed"))
    wgu_s, wd_s = (jax.device_put(L2(w), named_sharding(a, (2, *w.shape), mesh))
                   for w, a in zip((wgu, wd), axes, strict=True))

    def f(x, logits, wgu, wd, bias, mask, layer):
        return sharded_moe_ffn(mesh, x, logits, wgu, wd, layer=layer, top_k=A,
                               norm_topk_prob=True, backend="xla", token_mask_T=mask,
                               router=SIGMOID_GROUPS, correction_bias_E=bias, **scheme)

    y, stats = jax.jit(f)(x, logits, wgu_s, wd_s, bias, mask, jnp.int32(1))
    want, want_stats = moe_ffn(x, logits, wgu, wd, top_k=A, norm_topk_prob=True,
                               backend="xla", token_mask_T=mask, router=SIGMOID_GROUPS,
                               correction_bias_E=bias)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"]),
                                  np.asarray(want_stats["tokens_per_expert"]))
