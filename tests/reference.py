"""Float64 NumPy reference attention with every tf_flash feature, for the tests.

Layout [B, S, H, D] as the op: q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv].
Everything is computed densely in float64 with the [B, H, Sq, Sk] score matrix materialized, so keep
the shapes small. Semantics follow the README's API section:

- scale on the scores (default 1/sqrt(D)); all masks combine by AND;
- causal top-left (i sees j <= i); window (left, right): i sees i-left .. i+right, None = unlimited;
  causal="bottom_right": row i sits at i + kv_len[b] - Sq for both (kv_len = kv_lengths[b] or Sk);
- q_lengths / kv_lengths: rows >= q_len and columns >= kv_len invisible;
- attention_mask bool broadcastable to [B, H, Sq, Sk]; block_mask [nqb, nkb] | [H, nqb, nkb] |
  [B, H, nqb, nkb] with block_size int or (bq, bk), False = invisible block;
- GQA: query head h reads key/value head h // (H // Hkv);
- dropout given as an explicit keep mask [B, H, Sq, Sk] bool: kept probabilities scaled by
  philox_ref.keep_scale(p) (1 / the keep probability of the rate in steps of 1/256);
  lse is the log-sum-exp of the (undropped) scaled scores;
- softcap: the scaled scores s become softcap * tanh(s / softcap) before masking and the softmax;
- segment_ids [B, S] or a tuple (q ids [B, Sq], kv ids [B, Sk]): i sees j only where their ids are equal;
- a row with nothing visible: output 0, lse -inf, zero gradients.
"""
import numpy as np

import philox_ref

__all__ = ["to_numpy", "relative_error", "max_error", "element_mask", "reference_attention",
           "reference_attention_grad", "standard_attention"]


def to_numpy(x, dtype=np.float64):
    """A tf.Tensor / array-like (any float dtype, bfloat16 included) as a NumPy array of `dtype`."""
    if x is None:
        return None
    if hasattr(x, "numpy"):
        x = x.numpy()
    x = np.asarray(x)
    return x.astype(dtype) if dtype is not None else x


def relative_error(x, ref, floor=1e-30):
    """||x - ref|| / ||ref|| (Frobenius, float64). A NaN in x fails here: `error < bound` would be False
    for NaN, but `not error > bound` would pass it. `floor` keeps tiny references (1e-8 inputs) apart from
    an all-zero one."""
    x, ref = to_numpy(x), to_numpy(ref)
    assert not np.isnan(x).any(), "NaN in the result"
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), floor)


def max_error(actual, expected):
    """max |actual - expected| / max(1, max |expected|) (float64): absolute below 1, relative above."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    return np.abs(actual - expected).max() / max(1.0, np.abs(expected).max())


def _block_pair(block_size):
    if isinstance(block_size, (tuple, list)):
        bq, bk = block_size
    else:
        bq = bk = block_size
    return int(bq), int(bk)


def draw_features(rng, features, batch, seqlen_q, seqlen_k, heads):
    """flash_attention keyword arguments from a feature spec, with the placeholders drawn from rng:
    q_lengths="q" / kv_lengths="kv" (random prefixes, the first row full), attention_mask="full"
    ([B, H, Sq, Sk]) or "rows" ([B, 1, 1, Sk] key padding), block_mask="heads" ([H, nqb, nkb])."""
    kwargs = dict(features)
    if kwargs.get("q_lengths") == "q":
        kwargs["q_lengths"] = rng.integers(0, seqlen_q + 1, size=batch).astype(np.int32)
        kwargs["q_lengths"][0] = seqlen_q
    if kwargs.get("kv_lengths") == "kv":
        kwargs["kv_lengths"] = rng.integers(1, seqlen_k + 1, size=batch).astype(np.int32)
    if kwargs.get("attention_mask") == "full":
        kwargs["attention_mask"] = rng.random((batch, heads, seqlen_q, seqlen_k)) < 0.7
    elif kwargs.get("attention_mask") == "rows":  # [B, 1, 1, Sk]: key padding, broadcast over heads and rows
        kwargs["attention_mask"] = rng.random((batch, 1, 1, seqlen_k)) < 0.8
    if kwargs.get("block_mask") == "heads":
        bq, bk = _block_pair(kwargs["block_size"])
        kwargs["block_mask"] = rng.random((heads, -(-seqlen_q // bq), -(-seqlen_k // bk))) < 0.6
    return kwargs


def _window_sides(window):
    if window is None:
        return None, None
    if isinstance(window, (tuple, list)):
        return window[0], window[1]
    return int(window), int(window)


def element_mask(batch, heads, seqlen_q, seqlen_k, *, causal=False, window=None, q_lengths=None,
                 kv_lengths=None, attention_mask=None, block_mask=None, block_size=128, segment_ids=None):
    """The visibility of every (b, h, i, j) as a bool array [B, H, Sq, Sk] (True = visible)."""
    # Each row's position: i, or with causal="bottom_right" i + kv_len[b] - Sq (causal and window move).
    kv_len = (np.full(batch, seqlen_k) if kv_lengths is None
              else to_numpy(kv_lengths, np.int64).reshape(batch))
    shift = kv_len - seqlen_q if causal == "bottom_right" else np.zeros(batch, np.int64)
    rows = np.arange(seqlen_q)[None, :, None] + shift[:, None, None]  # [B, Sq, 1]
    cols = np.arange(seqlen_k)[None, None, :]
    visible = np.ones((batch, seqlen_q, seqlen_k), bool)
    if causal:
        visible &= cols <= rows
    left, right = _window_sides(window)
    if left is not None:
        visible &= cols >= rows - left
    if right is not None:
        visible &= cols <= rows + right
    mask = np.broadcast_to(visible[:, None], (batch, heads, seqlen_q, seqlen_k)).copy()
    if q_lengths is not None:
        q_len = to_numpy(q_lengths, np.int64).reshape(batch)
        mask &= (np.arange(seqlen_q)[None, :] < q_len[:, None])[:, None, :, None]
    if kv_lengths is not None:
        kv_len = to_numpy(kv_lengths, np.int64).reshape(batch)
        mask &= (np.arange(seqlen_k)[None, :] < kv_len[:, None])[:, None, None, :]
    if attention_mask is not None:
        am = to_numpy(attention_mask, bool)
        am = am.reshape((1,) * (4 - am.ndim) + am.shape)
        mask &= np.broadcast_to(am, mask.shape)
    if block_mask is not None:
        bm = to_numpy(block_mask, bool)
        bm = bm.reshape((1,) * (4 - bm.ndim) + bm.shape)
        bq, bk = _block_pair(block_size)
        nqb, nkb = -(-seqlen_q // bq), -(-seqlen_k // bk)
        if bm.shape[-2:] != (nqb, nkb):
            raise ValueError(f"block_mask has {bm.shape[-2:]} blocks; expected {(nqb, nkb)} for "
                             f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, block_size={block_size}")
        expanded = np.repeat(np.repeat(bm, bq, axis=-2), bk, axis=-1)[..., :seqlen_q, :seqlen_k]
        mask &= np.broadcast_to(expanded, mask.shape)
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        q_ids, kv_ids = to_numpy(q_ids, np.int64), to_numpy(kv_ids, np.int64)
        mask &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    return mask


def _prepare(q, k, v, causal, window, q_lengths, kv_lengths, attention_mask, block_mask, block_size,
             scale, keep_mask, dropout_rate, softcap=None, segment_ids=None):
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if heads % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} must divide heads={heads}")
    group = heads // heads_kv
    # [B, H, S, D] with kv heads repeated for GQA.
    qh = q.transpose(0, 2, 1, 3)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    mask = element_mask(batch, heads, seqlen_q, seqlen_k, causal=causal, window=window,
                        q_lengths=q_lengths, kv_lengths=kv_lengths, attention_mask=attention_mask,
                        block_mask=block_mask, block_size=block_size, segment_ids=segment_ids)
    scores = scale * np.einsum("bhqd,bhkd->bhqk", qh, kh)
    d_capped = None  # d(capped score) / d(score)
    if softcap:
        tanh = np.tanh(scores / softcap)
        scores = softcap * tanh
        d_capped = 1.0 - tanh ** 2
    scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    empty = ~mask.any(axis=-1, keepdims=True)
    row_max = np.where(empty, 0.0, row_max)
    with np.errstate(under="ignore"):
        unnorm = np.where(mask, np.exp(scores - row_max), 0.0)
    row_sum = unnorm.sum(axis=-1, keepdims=True)
    probs = unnorm / np.where(empty, 1.0, row_sum)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, row_max + np.log(np.where(empty, 1.0, row_sum)))[..., 0]
    if keep_mask is not None:
        keep = np.broadcast_to(to_numpy(keep_mask, bool), probs.shape)
        drop_scale = np.where(keep, philox_ref.keep_scale(dropout_rate), 0.0)
    elif dropout_rate:
        raise ValueError("reference_attention needs the keep_mask [B, H, Sq, Sk] when dropout_rate > 0 "
                         f"(it cannot draw tf_flash's Philox mask itself). Received: dropout_rate={dropout_rate}")
    else:
        drop_scale = None
    return dict(qh=qh, kh=kh, vh=vh, scale=scale, probs=probs, lse=lse, drop_scale=drop_scale,
                group=group, heads_kv=heads_kv, d_capped=d_capped)


def reference_attention(q, k, v, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                        attention_mask=None, block_mask=None, block_size=128, scale=None, keep_mask=None,
                        dropout_rate=0.0, softcap=None, segment_ids=None):
    """Returns (out [B, Sq, H, Dv], lse [B, H, Sq]) in float64."""
    c = _prepare(q, k, v, causal, window, q_lengths, kv_lengths, attention_mask, block_mask, block_size,
                 scale, keep_mask, dropout_rate, softcap, segment_ids)
    probs = c["probs"] if c["drop_scale"] is None else c["probs"] * c["drop_scale"]
    out = np.einsum("bhqk,bhkd->bqhd", probs, c["vh"])
    return out, c["lse"]


def _sum_groups(x, heads_kv, group):
    # [B, H, S, D] -> [B, S, Hkv, D], summing the query heads that share one kv head.
    b, _, s, d = x.shape
    return x.reshape(b, heads_kv, group, s, d).sum(axis=2).transpose(0, 2, 1, 3)


def reference_attention_grad(q, k, v, dout, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                             attention_mask=None, block_mask=None, block_size=128, scale=None, keep_mask=None,
                             dropout_rate=0.0, d_lse=None, softcap=None, segment_ids=None):
    """Gradients (dq, dk, dv) of sum(out * dout) [+ sum(lse * d_lse)] in float64."""
    c = _prepare(q, k, v, causal, window, q_lengths, kv_lengths, attention_mask, block_mask, block_size,
                 scale, keep_mask, dropout_rate, softcap, segment_ids)
    probs, qh, kh, vh, scale = c["probs"], c["qh"], c["kh"], c["vh"], c["scale"]
    do = to_numpy(dout).transpose(0, 2, 1, 3)  # [B, H, Sq, Dv]
    dropped = probs if c["drop_scale"] is None else probs * c["drop_scale"]
    dv = np.einsum("bhqk,bhqd->bhkd", dropped, do)
    dp = np.einsum("bhqd,bhkd->bhqk", do, vh)
    if c["drop_scale"] is not None:
        dp = dp * c["drop_scale"]
    out = np.einsum("bhqk,bhkd->bhqd", dropped, vh)
    delta = (do * out).sum(axis=-1, keepdims=True)
    if d_lse is not None:
        delta = delta - to_numpy(d_lse)[..., None]
    ds = probs * (dp - delta)
    if c["d_capped"] is not None:
        ds = ds * c["d_capped"]
    dq = scale * np.einsum("bhqk,bhkd->bqhd", ds, kh)
    dk = scale * np.einsum("bhqk,bhqd->bhkd", ds, qh)
    return dq, _sum_groups(dk, c["heads_kv"], c["group"]), _sum_groups(dv, c["heads_kv"], c["group"])


def standard_attention(q, k, v, *, dtype=None, **kwargs):
    """Plain softmax attention in a low precision `dtype` (default: the inputs' dtype): every stage
    (scores, softmax, product) is rounded to `dtype`, products accumulate in float32 as TF's CPU kernels
    do. The baseline whose error bounds the kernels' fp16/bf16 error (the tests' error criterion: at most 2x its error, see test_flash_attention.py). Same keyword arguments
    as reference_attention; rows with nothing visible give 0. Returns float32 values of `dtype`."""
    dtype = dtype or to_numpy(q, None).dtype

    def rnd(x):
        return np.asarray(x, np.float32).astype(dtype).astype(np.float32)

    q32, k32, v32 = (rnd(to_numpy(x, np.float32)) for x in (q, k, v))
    batch, seqlen_q, heads, head_dim = q32.shape
    seqlen_k, heads_kv = k32.shape[1], k32.shape[2]
    group = heads // heads_kv
    scale = kwargs.pop("scale", None)
    scale = np.float32(1.0 / np.sqrt(head_dim) if scale is None else scale)
    keep_mask = kwargs.pop("keep_mask", None)
    rate = kwargs.pop("dropout_rate", 0.0)
    softcap = kwargs.pop("softcap", None)
    mask = element_mask(batch, heads, seqlen_q, seqlen_k, **kwargs)
    qh = q32.transpose(0, 2, 1, 3)
    kh = np.repeat(k32.transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v32.transpose(0, 2, 1, 3), group, axis=1)
    scores = rnd(np.einsum("bhqd,bhkd->bhqk", qh, kh) * scale)
    if softcap:
        scores = rnd(np.float32(softcap) * np.tanh(scores / np.float32(softcap)))
    scores = np.where(mask, scores, -np.inf)
    empty = ~mask.any(axis=-1, keepdims=True)
    row_max = np.where(empty, 0, scores.max(axis=-1, keepdims=True))
    with np.errstate(under="ignore"):
        e = rnd(np.where(mask, np.exp(scores - row_max), 0))
    probs = rnd(e / np.where(empty, 1, e.sum(axis=-1, keepdims=True)))
    if keep_mask is not None:
        probs = rnd(np.where(to_numpy(keep_mask, bool), probs * np.float32(philox_ref.keep_scale(rate)), 0))
    return rnd(np.einsum("bhqk,bhkd->bqhd", probs, vh))
