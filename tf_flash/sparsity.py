"""Block-sparsity patterns for `tf_flash.flash_attention(block_mask=..., block_size=...)`.

A block mask is a bool array [num_q_blocks, num_k_blocks] (or [H, nqb, nkb] with `num_heads`): block
(i, j) covers query rows [i*bq, (i+1)*bq) and key columns [j*bk, (j+1)*bk) (the last blocks may be
partial); False = the block is skipped, its scores count as -inf. Every builder returns
`(block_mask, density)` where density is the fraction of True blocks, i.e. roughly the fraction of the
dense work that block-sparse attention does (paper Sec. 3.3: runtime and IO scale with it).

    mask, d = tf_flash.sparsity.butterfly(8192, 8192, block_size=128)
    out = tf_flash.flash_attention(q, k, v, block_mask=mask, block_size=128)

Patterns:
  - `local`: a sliding band of `window` key blocks on each side of the diagonal (optionally causal).
  - `global_local`: Longformer/BigBird: the first `num_global` query blocks see everything and every
    query sees the first `num_global` key blocks, plus the band, plus `num_random` random key blocks
    per query block (BigBird).
  - `butterfly`: the flat block butterfly of Pixelfly (Chen et al. 2021), the fixed pattern of the
    FlashAttention paper's block-sparse experiments: block (i, j) is kept when i XOR j is 0 or a power
    of two below `max_stride`, i.e. the union of the butterfly factors of strides 1, 2, 4, ...;
    `num_global` adds global rows/columns (Pixelfly's low-rank part).
  - `random_blocks`: a given fraction of blocks, uniformly at random for a seed.
"""
import numbers

import numpy as np

from tf_flash import _checks

__all__ = ["num_blocks", "dense", "local", "global_local", "butterfly", "random_blocks", "density",
           "to_element_mask"]


def _window_pair(window):
    pair = _checks.int_pair(window, lambda side: _checks.is_int(side) and side >= 0)
    if pair is None:
        raise ValueError("`window` must be a non-negative int (blocks on each side) or a pair (left, right) of "
                         f"non-negative ints. Received: window={window!r}")
    return pair


def _geometry(seqlen_q, seqlen_k, block_size):
    """The checked (seqlen_q, seqlen_k, block_q, block_k)."""
    return (_checks.check_int(seqlen_q, "seqlen_q", minimum=1), _checks.check_int(seqlen_k, "seqlen_k", minimum=1),
            *_checks.normalize_block_size(block_size))


def _check_heads(num_heads):
    return _checks.check_int(num_heads, "num_heads", minimum=1, optional=True)


def num_blocks(seqlen_q, seqlen_k, block_size=128):
    """(num_q_blocks, num_k_blocks) that a block mask for these lengths must have (last blocks partial)."""
    seqlen_q, seqlen_k, block_q, block_k = _geometry(seqlen_q, seqlen_k, block_size)
    return -(-seqlen_q // block_q), -(-seqlen_k // block_k)


def density(mask):
    """Fraction of True blocks of a block mask (numpy array, list or tf.Tensor of any rank)."""
    if hasattr(mask, "numpy"):
        mask = mask.numpy()
    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise ValueError(f"`mask` must be a bool array. Received: mask of dtype {mask.dtype}")
    if mask.size == 0:
        raise ValueError(f"`mask` must not be empty. Received: mask with shape {mask.shape}")
    return float(mask.mean())


def _finish(mask, num_heads):
    if num_heads is not None:
        mask = np.broadcast_to(mask, (num_heads,) + mask.shape[-2:]).copy()
    return mask, density(mask)


def _band(seqlen_q, seqlen_k, block_q, block_k, left, right):
    """Blocks whose key range meets [i*bq - left*bk, (i+1)*bq - 1 + right*bk]: a band of `left`/`right`
    key blocks around the element diagonal (for bq == bk: i - left <= j <= i + right)."""
    nqb, nkb = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    q_first = np.arange(nqb)[:, None] * block_q
    q_last = np.minimum(q_first + block_q, seqlen_q) - 1
    k_first = np.arange(nkb)[None, :] * block_k
    k_last = np.minimum(k_first + block_k, seqlen_k) - 1
    return (k_last >= q_first - left * block_k) & (k_first <= q_last + right * block_k)


def dense(seqlen_q, seqlen_k, block_size=128, *, num_heads=None):
    """All blocks kept (density 1): the dense baseline in block-mask form."""
    nqb, nkb = num_blocks(seqlen_q, seqlen_k, block_size)
    return _finish(np.ones((nqb, nkb), bool), _check_heads(num_heads))


def local(seqlen_q, seqlen_k, block_size=128, *, window=1, causal=False, num_heads=None):
    """Sliding band: query block i keeps the key blocks within `window` blocks of the diagonal.

    Args:
      seqlen_q, seqlen_k: sequence lengths (positive ints).
      block_size: int or (block_q, block_k).
      window: key blocks on each side of the diagonal, int or (left, right); 0 = the diagonal only.
      causal: drop the blocks right of the diagonal (same as right = 0).
      num_heads: if given, return [num_heads, nqb, nkb] (the same pattern for every head).

    Returns:
      (block_mask bool [nqb, nkb], density float)
    """
    seqlen_q, seqlen_k, block_q, block_k = _geometry(seqlen_q, seqlen_k, block_size)
    left, right = _window_pair(window)
    if causal:
        right = 0
    mask = _band(seqlen_q, seqlen_k, block_q, block_k, left, right)
    if causal:  # keep only blocks holding some j <= i
        mask &= (np.arange(mask.shape[1])[None, :] * block_k
                 <= np.minimum((np.arange(mask.shape[0])[:, None] + 1) * block_q, seqlen_q) - 1)
    return _finish(mask, _check_heads(num_heads))


def _random_per_row(rng, candidates, count):
    """For each row of bool `candidates` [R, C], pick `count` True entries at random (all if fewer)."""
    picked = np.zeros_like(candidates)
    for row in range(candidates.shape[0]):
        free = np.flatnonzero(candidates[row])
        if free.size:
            picked[row, rng.choice(free, size=min(count, free.size), replace=False)] = True
    return picked


def global_local(seqlen_q, seqlen_k, block_size=128, *, window=1, num_global=1, num_random=0, seed=0,
                 num_heads=None):
    """Longformer / BigBird: global blocks + sliding band (+ random blocks).

    The first `num_global` query blocks attend to every key block (global tokens), every query block
    attends to the first `num_global` key blocks, each query block keeps the key blocks within `window`
    of the diagonal, and with `num_random` > 0 also that many other key blocks chosen at random (BigBird).

    Args:
      seqlen_q, seqlen_k, block_size: as in `local`.
      window: int or (left, right), key blocks on each side of the diagonal.
      num_global: number of leading global blocks (non-negative int).
      num_random: random extra key blocks per query block (non-negative int).
      seed: seed of the random blocks (non-negative int, or None for fresh randomness).
      num_heads: if given, [num_heads, nqb, nkb]; the random blocks differ per head.

    Returns:
      (block_mask, density)
    """
    seqlen_q, seqlen_k, block_q, block_k = _geometry(seqlen_q, seqlen_k, block_size)
    left, right = _window_pair(window)
    num_global = _checks.check_int(num_global, "num_global", minimum=0)
    num_random = _checks.check_int(num_random, "num_random", minimum=0)
    num_heads = _check_heads(num_heads)
    seed = _checks.check_int(seed, "seed", minimum=0, optional=True)
    base = _band(seqlen_q, seqlen_k, block_q, block_k, left, right)
    base[:num_global, :] = True
    base[:, :num_global] = True
    if not num_random:
        return _finish(base, num_heads)
    rng = np.random.default_rng(seed)
    masks = [base | _random_per_row(rng, ~base, num_random) for _ in range(num_heads or 1)]
    mask = np.stack(masks) if num_heads is not None else masks[0]
    return mask, density(mask)


def butterfly(seqlen_q, seqlen_k, block_size=128, *, max_stride=None, num_global=0, num_heads=None):
    """The flat block butterfly pattern (Pixelfly), used by the FlashAttention paper's block-sparse runs.

    Block (i, j) is kept when i XOR j is 0 or a power of two smaller than `max_stride`: the union of the
    butterfly factors with strides 1, 2, 4, ..., max_stride / 2 (each factor pairs block i with block
    i XOR stride). With n blocks (n a power of two) and the default max_stride = n, each row keeps
    1 + log2(n) blocks: density (1 + log2 n) / n. Lengths whose block counts are not powers of two use
    the pattern of the next power of two, cropped.

    Args:
      seqlen_q, seqlen_k, block_size: as in `local`.
      max_stride: a power of two >= 1 (1 = diagonal only); default: the next power of two >= the number
        of blocks (the full butterfly).
      num_global: leading global block rows/columns added (the low-rank part of Pixelfly).
      num_heads: if given, [num_heads, nqb, nkb] (same pattern for every head).

    Returns:
      (block_mask, density)
    """
    nqb, nkb = num_blocks(seqlen_q, seqlen_k, block_size)
    num_global = _checks.check_int(num_global, "num_global", minimum=0)
    full = 1 << (max(nqb, nkb) - 1).bit_length()
    if max_stride is None:
        max_stride = full
    if not _checks.is_int(max_stride) or max_stride < 1 or max_stride & (max_stride - 1):
        raise ValueError(f"`max_stride` must be a power of two >= 1. Received: max_stride={max_stride!r}")
    xor = np.arange(nqb)[:, None] ^ np.arange(nkb)[None, :]
    mask = (xor == 0) | (((xor & (xor - 1)) == 0) & (xor < max_stride))
    mask[:num_global, :] = True
    mask[:, :num_global] = True
    return _finish(mask, _check_heads(num_heads))


def random_blocks(seqlen_q, seqlen_k, block_size=128, *, density=0.25, seed=0, num_heads=None,
                  keep_diagonal=False):
    """Exactly round(density * nqb * nkb) blocks (at least one) kept uniformly at random.

    Args:
      seqlen_q, seqlen_k, block_size: as in `local`.
      density: fraction of blocks kept, in (0, 1].
      seed: non-negative int (or None for fresh randomness); the same seed gives the same mask.
      num_heads: if given, [num_heads, nqb, nkb] with a different draw per head.
      keep_diagonal: also keep the diagonal blocks (i, i) so that no query block is left empty; the
        result is then somewhat denser than `density`.

    Returns:
      (block_mask, density actually achieved)
    """
    nqb, nkb = num_blocks(seqlen_q, seqlen_k, block_size)
    target = density
    if not isinstance(target, numbers.Real) or _checks.is_bool(target) or not 0.0 < target <= 1.0:
        raise ValueError(f"`density` must be a float in (0, 1]. Received: density={target!r}")
    seed = _checks.check_int(seed, "seed", minimum=0, optional=True)
    num_heads = _check_heads(num_heads)
    rng = np.random.default_rng(seed)
    total = nqb * nkb
    count = max(1, int(round(target * total)))
    masks = []
    for _ in range(num_heads or 1):
        flat = np.zeros(total, bool)
        flat[rng.choice(total, size=count, replace=False)] = True
        mask = flat.reshape(nqb, nkb)
        if keep_diagonal:
            diag = np.arange(min(nqb, nkb))
            mask[diag, diag] = True
        masks.append(mask)
    mask = np.stack(masks) if num_heads is not None else masks[0]
    return mask, float(mask.mean())


def to_element_mask(block_mask, seqlen_q, seqlen_k, block_size=128):
    """Expand a block mask [..., nqb, nkb] to the element mask [..., seqlen_q, seqlen_k] (bool numpy) it
    stands for: what `attention_mask` would have to be for dense attention to give the same result."""
    if hasattr(block_mask, "numpy"):
        block_mask = block_mask.numpy()
    block_mask = np.asarray(block_mask)
    if block_mask.dtype != bool:
        raise ValueError(f"`block_mask` must be a bool array. Received: block_mask of dtype {block_mask.dtype}")
    if block_mask.ndim < 2:
        raise ValueError(f"`block_mask` must have rank >= 2. Received: block_mask with shape {block_mask.shape}")
    nqb, nkb = num_blocks(seqlen_q, seqlen_k, block_size)
    if block_mask.shape[-2:] != (nqb, nkb):
        raise ValueError(f"`block_mask` must end in ({nqb}, {nkb}) blocks for seqlen_q={seqlen_q}, "
                         f"seqlen_k={seqlen_k}, block_size={block_size}. Received: block_mask with shape "
                         f"{block_mask.shape}")
    block_q, block_k = _checks.normalize_block_size(block_size)
    expanded = np.repeat(np.repeat(block_mask, block_q, axis=-2), block_k, axis=-1)
    return np.ascontiguousarray(expanded[..., :seqlen_q, :seqlen_k])
