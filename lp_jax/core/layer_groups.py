"""How many layer groups a layered-prefill batch uses, and which layers each group holds.

Layered prefill runs a batch of prompt tokens through one contiguous group of layers per
iteration, so per-iteration prefill work is about (batch tokens / G) token-layers' worth while
every layer still sees each prompt token exactly once. The paper's rule
G = max(1, ceil(tokens / 512)) keeps that work equal to one 512-token chunk; "pow2" rounds it to
a power of two so fewer distinct (tokens, layers) shapes need compiling; an int fixes G.

The paper leaves the split of L layers into G groups open when G does not divide L; we give
the first L % G groups one extra layer, so group sizes differ by at most one.
"""

from __future__ import annotations

LayerGroupMode = str | int  # "paper", "pow2", "adaptive" or a fixed group count
ADAPTIVE = "adaptive"  # spans chosen per iteration from a latency estimate (policies.py)

_PAPER_TOKENS_PER_GROUP = 512  # the paper's chunk size: G = ceil(tokens / 512)
_POW2_THRESHOLDS = ((512, 1), (1024, 2), (2048, 4), (4096, 8))  # (max tokens, G)


def _check_positive_int(name: str, x: object) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be an int >= 1, got {x!r}")


def check_mode(mode: object) -> None:
    if isinstance(mode, str):
        if mode not in ("paper", "pow2", ADAPTIVE):
            raise ValueError('layer_groups must be "paper", "pow2", "adaptive" or an int >= 1, '
                             f"got {mode!r}")
    else:
        _check_positive_int("layer_groups", mode)


def num_layer_groups(
    num_tokens: int,
    mode: LayerGroupMode = "paper",
    *,
    max_layer_groups: int = 16,
    num_layers: int,
) -> int:
    """G for a prefill batch of `num_tokens` prompt tokens, in [1, min(max_layer_groups, L)].
    ("adaptive" has no fixed G: it falls back to "paper" where a count is needed.)"""
    _check_positive_int("num_tokens", num_tokens)
    _check_positive_int("max_layer_groups", max_layer_groups)
    _check_positive_int("num_layers", num_layers)
    check_mode(mode)
    if mode in ("paper", ADAPTIVE):
        g = -(-num_tokens // _PAPER_TOKENS_PER_GROUP)
    elif mode == "pow2":
        g = next((g for limit, g in _POW2_THRESHOLDS if num_tokens <= limit), max_layer_groups)
    else:
        g = mode
    return max(1, min(g, max_layer_groups, num_layers))


def split_layers(num_layers: int, num_groups: int) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, end) layer ranges of `num_groups` groups covering [0, num_layers)."""
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("num_groups", num_groups)
    if num_groups > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_groups} non-empty groups")
    base, extra = divmod(num_layers, num_groups)
    ranges = []
    start = 0
    for g in range(num_groups):
        end = start + base + (g < extra)
        ranges.append((start, end))
        start = end
    return tuple(ranges)
