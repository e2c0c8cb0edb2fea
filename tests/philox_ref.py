"""NumPy twin of cc/kernels/flash/philox.h (uint32 arithmetic), so tests can rebuild tf_flash's dropout
keep mask for a given (seed, offset) and compare the op with the reference under exactly that mask."""
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
    """An entry is dropped when its 32-bit draw is below rate * 2^32 (rate taken as float32, as the attr)."""
    t = float(np.float32(rate)) * 4294967296.0
    return np.uint32(0xFFFFFFFF) if t >= 4294967295.0 else np.uint32(int(t))


def _seed_words(seed, offset):
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    offset = int(offset) & 0xFFFFFFFFFFFFFFFF
    return seed, offset


def dropout_draws(seed, offset, batch_head, rows, cols):
    """The 32-bit Philox draw of each (row, col) for one batch*heads+head index: uint32 [len(rows), len(cols)]."""
    seed, offset = _seed_words(seed, offset)
    batch_head = int(batch_head)
    rows = np.asarray(rows, np.int64)[:, None]
    cols = np.asarray(cols, np.int64)[None, :]
    ctr = (cols >> 2, rows, np.uint64(batch_head & 0xFFFFFFFF),
           np.uint64((offset & 0xFFFFFFFF) ^ ((batch_head >> 32) & 0xFFFFFFFF)))
    key0 = seed & 0xFFFFFFFF
    key1 = (seed >> 32) ^ (offset >> 32)
    r = philox4x32_10(ctr, np.uint64(key0), np.uint64(key1))
    lane = (cols & 3) + np.zeros_like(rows)
    draws = np.choose(lane, [np.broadcast_to(x, lane.shape) for x in r])
    return draws.astype(np.uint32)


def dropout_keep_bits4(seed, offset, batch_head, row, col, drop_threshold):
    """Scalar twin of the C++ function: bit t set when column 4*(col//4)+t is kept."""
    base = (int(col) >> 2) << 2
    draws = dropout_draws(seed, offset, batch_head, [row], [base, base + 1, base + 2, base + 3])[0]
    bits = 0
    for t in range(4):
        if draws[t] >= np.uint32(drop_threshold):
            bits |= 1 << t
    return bits


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
