"""Layer-group count formulas and the split of L layers into G contiguous groups."""

import pytest

from lp_jax.core.layer_groups import num_layer_groups, split_layers


@pytest.mark.parametrize(
    ("tokens", "groups"),
    [(1, 1), (511, 1), (512, 1), (513, 2), (1024, 2), (1025, 3), (4096, 8), (8192, 16)],
)
def test_paper_formula(tokens, groups):
    assert num_layer_groups(tokens, "paper", num_layers=48) == groups


def test_paper_is_the_default_mode():
    assert num_layer_groups(2048, num_layers=48) == 4


@pytest.mark.parametrize(
    ("tokens", "groups"),
    [
        (1, 1), (512, 1), (513, 2), (1024, 2), (1025, 4), (2048, 4),
        (2049, 8), (4096, 8), (4097, 16), (100_000, 16),
    ],
)  # fmt: skip
def test_pow2_thresholds(tokens, groups):
    assert num_layer_groups(tokens, "pow2", num_layers=48) == groups


def test_pow2_above_4096_takes_the_maximum():
    assert num_layer_groups(5000, "pow2", max_layer_groups=32, num_layers=48) == 32
    assert num_layer_groups(5000, "pow2", max_layer_groups=12, num_layers=48) == 12


def test_fixed_count_ignores_tokens():
    assert num_layer_groups(1, 4, num_layers=48) == 4
    assert num_layer_groups(100_000, 4, num_layers=48) == 4


def test_caps():
    # max_layer_groups caps every mode
    assert num_layer_groups(100_000, "paper", num_layers=48) == 16
    assert num_layer_groups(8192, "paper", max_layer_groups=8, num_layers=48) == 8
    assert num_layer_groups(1, 40, num_layers=48) == 16
    # so does the layer count
    assert num_layer_groups(8192, "paper", num_layers=7) == 7
    assert num_layer_groups(8192, "pow2", num_layers=3) == 3
    assert num_layer_groups(8192, 5, num_layers=1) == 1


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((0, "paper"), {"num_layers": 48}),
        ((-5, "paper"), {"num_layers": 48}),
        ((1.5, "paper"), {"num_layers": 48}),
        ((10, "linear"), {"num_layers": 48}),
        ((10, 0), {"num_layers": 48}),
        ((10, -2), {"num_layers": 48}),
        ((10, True), {"num_layers": 48}),
        ((10, 2.0), {"num_layers": 48}),
        ((10, "paper"), {"num_layers": 0}),
        ((10, "paper"), {"num_layers": 48, "max_layer_groups": 0}),
    ],
)
def test_num_layer_groups_rejects_bad_arguments(args, kwargs):
    with pytest.raises(ValueError):
        num_layer_groups(*args, **kwargs)


def test_num_layers_is_required():
    with pytest.raises(TypeError):
        num_layer_groups(10, "paper")  # type: ignore[call-arg]


def test_split_48_layers_into_16_groups():
    groups = split_layers(48, 16)
    assert groups == tuple((3 * g, 3 * g + 3) for g in range(16))


def test_split_7_layers_into_3_groups():
    assert split_layers(7, 3) == ((0, 3), (3, 5), (5, 7))


def test_split_edge_cases():
    assert split_layers(5, 1) == ((0, 5),)
    assert split_layers(5, 5) == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    assert split_layers(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))


def test_split_invariants_for_all_small_shapes():
    for num_layers in range(1, 65):
        for g in range(1, num_layers + 1):
            groups = split_layers(num_layers, g)
            assert len(groups) == g
            assert groups[0][0] == 0 and groups[-1][1] == num_layers
            assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
            sizes = [end - start for start, end in groups]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
            # the first num_layers % g groups are the larger ones
            extra = num_layers % g
            assert sizes == sorted(sizes, reverse=True)
            assert sum(s > num_layers // g for s in sizes) == extra


@pytest.mark.parametrize(("num_layers", "g"), [(4, 5), (4, 0), (0, 1), (4, -1), (4, 1.0)])
def test_split_rejects_bad_arguments(num_layers, g):
    with pytest.raises(ValueError):
        split_layers(num_layers, g)
