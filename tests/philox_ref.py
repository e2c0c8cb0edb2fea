"""NumPy twin of cc/kernels/flash/philox.h (uint32 arithmetic), so tests can rebuild tf_flash's dropout
keep mask for a given (seed, offset) and compare the op with the reference under exactly that mask."""
import math

import numpy as np

_MUL0, _MUL1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_WEYL0, _WEYL1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def _u32(x):
    return np.asarray(x).astype(np.uint64) & _MASK32


def philox4x32_10(ctr, key0, key1):
    """ctr: 4 arrays of uint32 (broadcastable); key0, key1: uint32 scalars/arrays. Returns 4 uint32 arrays."""
    x0, x1, x2, x3 = (_u32(c) for c in ctr)
    k0, k1 = _u32(key0), _u32(key1)
    for _ in range(10):
        p0 = _MUL0 * x0  # fits in 64 bits: both factors < 2^32
        p1 = _MUL1 * x2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0 = (k0 + np.uint64(_WEYL0)) & _MASK32
        k1 = (k1 + np.uint64(_WEYL1)) & _MASK32
    return tuple(x.astype(np.uint32) for x in (x0, x1, x2, x3))


def dropout_threshold(rate):
    """Entries whose byte draw is below round(256 * rate) are dropped (1..255 for rate > 0; rate as float32,
    as the attr)."""
    rate = float(np.float32(rate))
    if not rate > 0:
        return 0
    return int(min(255, max(1, math.floor(rate * 256.0 + 0.5))))


def keep_scale(rate):
    """The scale of kept entries: 1 / (the keep probability the threshold gives), as a float32."""
    return float(np.float32(256.0) / np.float32(256 - dropout_threshold(rate)))


def _seed_words(seed, offset):
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    offset = int(offset) & 0xFFFFFFFFFFFFFFFF
    return seed, offset


def dropout_draws(seed, offset, batch_head, rows, cols):
    """The byte draw of each (row, col) for one batch*heads+head index: uint8 [len(rows), len(cols)].
    One Philox call covers rows r, r + 8 of a 16-row block and columns 2q, 2q + 1 of the four 8-column
    groups of a 32-column block (the layout of philox.h)."""
    seed, offset = _seed_words(seed, offset)
    batch_head = int(batch_head)
    rows = np.asarray(rows, np.int64)[:, None]
    cols = np.asarray(cols, np.int64)[None, :]
    ctr = (((cols >> 5) << 2) | ((cols >> 1) & 3), ((rows >> 4) << 3) | (rows & 7),
           np.uint64(batch_head & 0xFFFFFFFF), np.uint64((offset & 0xFFFFFFFF) ^ ((batch_head >> 32) & 0xFFFFFFFF)))
    key0 = seed & 0xFFFFFFFF
    key1 = (seed >> 32) ^ (offset >> 32)
    words = philox4x32_10(ctr, np.uint64(key0), np.uint64(key1))
    word = ((cols >> 3) & 3) + np.zeros_like(rows)
    byte = 2 * ((rows >> 3) & 1) + (cols & 1)
    chosen = np.choose(word, [np.broadcast_to(x, word.shape) for x in words]).astype(np.uint64)
    return ((chosen >> (8 * byte).astype(np.uint64)) & np.uint64(0xFF)).astype(np.uint8)


def dropout_keep(seed, offset, batch_head, row, col, threshold):
    """Scalar twin of the C++ dropout_keep."""
    return bool(dropout_draws(seed, offset, batch_head, [row], [col])[0, 0] >= threshold)


def keep_mask(seed, offset, batch, heads, seqlen_q, seqlen_k, rate):
    """tf_flash's keep mask bool [B, H, Sq, Sk] for rng state (seed, offset): keep iff draw >= threshold.
    batch_head = b * heads + h with `heads` the number of query heads."""
    threshold = dropout_threshold(rate)
    rows, cols = np.arange(seqlen_q), np.arange(seqlen_k)
    mask = np.empty((batch, heads, seqlen_q, seqlen_k), bool)
    for b in range(batch):
        for h in range(heads):
            mask[b, h] = dropout_draws(seed, offset, b * heads + h, rows, cols) >= threshold
    return mask
