"""Which CUDA kernel family runs, read from the library's launch counts (tf_flash.cuda_kernel_counts):
the Hopper kernels (sm_90a: TMA, wgmma, warp-specialized) on an sm_90 GPU for the inputs they take, the
sm_80 family for the rest (block masks finer than the Hopper tiles, attn_mask with segment ids, head dims 32
and 96; in the backward also segment ids with a block mask) and on every other GPU
(cc/kernels/cuda/family.h).
Each case also checks the result against float64 attention, so that a family that ran is also a family
that is right."""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from tf_flash import cuda_kernel_counts
import philox_ref
from reference import reference_attention, reference_attention_grad

pytestmark = pytest.mark.gpu


def _hopper_expected():
    """True when the forward must take the Hopper family: an sm_90 GPU, a library with sm_90a code."""
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    archs = tf_flash.build_info().get("cuda_archs", "").split(",")
    return details.get("compute_capability", (0, 0))[0] == 9 and "90a" in archs


def _run(rng, dtype, head_dim, **kwargs):
    b, s, h = 2, 300, 4  # 300: not a multiple of any tile
    q, k, v = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(3))
    before = cuda_kernel_counts()
    with tf.device("/GPU:0"):
        out = tf_flash.flash_attention(*(tf.constant(x, dtype) for x in (q, k, v)), **kwargs)
    after = cuda_kernel_counts()
    ran = {family: after[family] - before[family] for family in after}
    return out, (q, k, v), ran


def _forward_backward(tensors, dout, **kwargs):
    """flash_attention on the GPU and the gradients of sum(out * dout): (outputs, [dq, dk, dv], launches
    per kernel family during both)."""
    before = cuda_kernel_counts()
    with tf.device("/GPU:0"), tf.GradientTape() as tape:
        tape.watch(tensors)
        outputs = tf_flash.flash_attention(*tensors, **kwargs)
        out = outputs[0] if kwargs.get("return_lse") else outputs
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * dout)
    grads = tape.gradient(loss, tensors)
    after = cuda_kernel_counts()
    return outputs, grads, {family: after[family] - before[family] for family in after}


def _assert_matches_float64(q, k, v, dout, out, lse, grads, dtype, ref_kw, seed=None):
    """out, lse and grads (of sum(out * dout)) against float64 attention of the rounded inputs q, k, v with
    ref_kw (flash_attention's keyword arguments); with dropout, the Philox reference's keep mask of the op's
    seed (ref_kw's, else `seed`)."""
    ref_kw = _assert_output_matches_float64(q, k, v, out, lse, dtype, ref_kw, seed)
    _assert_gradients_close(grads, reference_attention_grad(q, k, v, dout, **ref_kw), dtype)


def _assert_output_matches_float64(q, k, v, out, lse, dtype, ref_kw, seed=None):
    """out and lse as _assert_matches_float64 checks them; returns the reference's keyword arguments."""
    ref_kw = dict(ref_kw)
    ref_kw.pop("deterministic", None)  # how dQ is summed, not what it is
    seed = ref_kw.pop("seed", seed)
    if ref_kw.get("dropout_rate"):
        (b, sq, h, _), sk = q.shape, k.shape[1]
        ref_kw["keep_mask"] = philox_ref.keep_mask(seed[0], seed[1], b, h, sq, sk, ref_kw["dropout_rate"])
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kw)
    tol = 2e-2 if dtype == tf.float16 else 6e-2
    np.testing.assert_allclose(tf.cast(out, tf.float64).numpy(), ref_out, atol=tol, rtol=0)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], ref_lse[finite], atol=1e-2)
    return ref_kw


def _assert_gradients_close(grads, ref_grads, dtype):
    tol = 1e-2 if dtype == tf.float16 else 3e-2
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        err = np.linalg.norm(tf.cast(g, tf.float64).numpy() - r)
        assert err <= tol * np.linalg.norm(r), (name, err, np.linalg.norm(r))


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_family_and_result(dtype, head_dim, causal, rng):
    out, (q, k, v), ran = _run(rng, dtype, head_dim, causal=causal)
    if _hopper_expected():
        assert ran["forward_sm90"] == 1 and ran["forward_sm80"] == 0, ran
    else:
        assert ran["forward_sm90"] == 0 and ran["forward_sm80"] == 1, ran
    ref, _ = reference_attention(q, k, v, causal=causal)
    tol = 2e-2 if dtype == tf.float16 else 6e-2
    np.testing.assert_allclose(tf.cast(out, tf.float64).numpy(), ref, atol=tol, rtol=0)


# The Hopper forward's schedules (cc/kernels/cuda/fwd_launch_sm90.h): persistent CTAs, each running several query
# tiles in turn, and a CTA per tile under a causal mask over more than 4k keys. Shapes with more query tiles than an
# H100 has SMs (132), lengths leaving tiles without work, d256's output through Q's buffer, Dv < D (the TMA store's
# columns), GQA with dropout and soft-capping (the general variant).
_SCHEDULE_CASES = [
    dict(head_dim=128),
    dict(head_dim=64),  # three consumers, 192-row tiles
    dict(head_dim=256),
    dict(head_dim=128, causal=True, q_lengths=[1100, 700, 37, 0], kv_lengths=[1100, 1000, 5, 900]),
    # A CTA's first tiles without work (the last query tiles go first), whose epilogues use Q's buffer at d256.
    dict(head_dim=256, q_lengths=[1100, 200, 37, 0], kv_lengths=[1100, 1000, 5, 900]),
    dict(head_dim=64, window=(70, 20)),
    dict(head_dim=128, value_dim=64, heads_kv=2, dropout_rate=0.1, seed=[3, 4], softcap=8.0),
    # A CTA per tile, heaviest first, in groups of (batch, head) pairs whose K and V fit in L2: three consumers,
    # lengths leaving tiles without work; one head, for the float64 reference's time at 4200^2.
    dict(head_dim=64, causal=True, batch=2, seqlen=4200, heads=1, q_lengths=[4200, 3001], kv_lengths=[4150, 4200]),
]


def _schedule_case(i):
    """(q, k, v as float32 of bf16 values, flash_attention kwargs) of _SCHEDULE_CASES[i] (b4 s1100 h8 unless it
    says)."""
    case = dict(_SCHEDULE_CASES[i])
    d, dv, hkv = case.pop("head_dim"), case.pop("value_dim", None), case.pop("heads_kv", None)
    b, s, h = case.pop("batch", 4), case.pop("seqlen", 1100), case.pop("heads", 8)
    rng = np.random.default_rng(1000 + i)
    shapes = [(b, s, h, d), (b, s, hkv or h, d), (b, s, hkv or h, dv or d)]
    q, k, v = (tf.cast(tf.constant(rng.standard_normal(x), tf.bfloat16), tf.float32).numpy() for x in shapes)
    return q, k, v, case


@pytest.mark.parametrize("case", range(len(_SCHEDULE_CASES)))
def test_forward_schedules(case):
    """Each schedule's tiles, those without work included, against float64; one Hopper launch per call."""
    q, k, v, kwargs = _schedule_case(case)
    before = cuda_kernel_counts()
    with tf.device("/GPU:0"):
        out, lse = tf_flash.flash_attention(*(tf.constant(x, tf.bfloat16) for x in (q, k, v)), return_lse=True,
                                            **kwargs)
    after = cuda_kernel_counts()
    if _hopper_expected():
        assert after["forward_sm90"] - before["forward_sm90"] == 1, (before, after)
    _assert_output_matches_float64(q, k, v, out, lse, tf.bfloat16, kwargs)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [dict(dropout_rate=0.2), dict(softcap=5.0),
                                      dict(dropout_rate=0.3, softcap=3.0, causal=True, kv_lengths=[300, 170])])
def test_dropout_and_softcap_forward_family_and_gradients(dtype, head_dim, features, rng):
    """Dropout and soft-capping run in the Hopper forward and backward; the dropout draws of every kernel must
    be the CPU kernels': output, lse and gradients against float64 attention with the Philox reference's keep
    mask."""
    b, s, h, hkv = 2, 300, 4, 2
    q, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32) for _ in range(2))
    tq, tk, tv = (tf.constant(x, dtype) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))  # the reference sees the rounded inputs
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, seed=[11, 2], return_lse=True, **features)
    family = "forward_sm90" if _hopper_expected() else "forward_sm80"
    assert ran[family] == 1, ran
    backward = "backward_sm90" if _hopper_expected() else "backward_sm80"
    assert ran[backward] == 1, ran
    _assert_matches_float64(q, k, v, dout, out, lse, grads, dtype, features, seed=[11, 2])


def _attention_mask(kind, rng, b, h, s):
    """Masks of each kind the Hopper forward packs (packed_mask.h), broadcast as users pass them."""
    if kind == "random":  # [S, S], every tile masked in part
        return rng.random((s, s)) < 0.8
    if kind == "documents":  # [B, 1, S, S] block-diagonal: tiles hidden, shown in full and masked in part
        ends = np.array([[70, 200, s], [150, 151, s]])
        doc = np.stack([np.searchsorted(e, np.arange(s), side="right") for e in ends])
        return (doc[:, :, None] == doc[:, None, :])[:, None]
    if kind == "keys":  # [B, 1, 1, S] padding with holes (not a prefix)
        return (rng.random((b, 1, 1, s)) < 0.8) & (np.arange(s) < np.array([[s], [230]]))[:, None, None]
    return rng.random((b, h, s, s)) < 0.7  # "heads": [B, H, S, S]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["random", "documents", "keys", "heads"])
@pytest.mark.parametrize("features", [dict(), dict(causal=True, kv_lengths=[300, 230]),
                                      dict(dropout_rate=0.2, softcap=4.0, seed=[3, 4]),
                                      dict(causal=True, deterministic=True)])
def test_attention_mask_family_output_and_gradients(head_dim, kind, features, rng):
    """attn_mask runs in the Hopper kernels (packed to a bit per entry first) at head dims 64, 128 and 256.
    Output, lse and gradients against float64, with causal, lengths, dropout, soft-capping, the deterministic dQ
    and GQA at odd lengths."""
    b, s, h, hkv = 2, 300, 4, 2
    q, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32) for _ in range(2))
    mask = _attention_mask(kind, rng, b, h, s)
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, attention_mask=mask, return_lse=True, **features)
    forward = "forward_sm90" if _hopper_expected() else "forward_sm80"
    backward = "backward_sm90" if _hopper_expected() else "backward_sm80"
    assert ran[forward] == 1 and ran[backward] == 1, ran
    _assert_matches_float64(q, k, v, dout, out, lse, grads, tf.bfloat16, dict(features, attention_mask=mask))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_mask_keeps_hidden_nan_out(head_dim, rng):
    """Keys the mask hides from every query may hold NaN (the Hopper forward zeroes such value rows where V
    is not finite): output and gradients stay finite and right."""
    b, s, h = 2, 300, 4
    q, k, v, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(4))
    mask = rng.random((b, 1, s, s)) < 0.7
    hidden = np.arange(s) % 5 == 3
    mask[..., hidden] = False
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, hidden], v_nan[:, hidden] = np.nan, np.nan
    tk, tv = (tf.constant(x, tf.bfloat16) for x in (k_nan, v_nan))
    (out, _), grads, ran = _forward_backward([tq, tk, tv], dout, attention_mask=mask, return_lse=True)
    assert ran["forward_sm90" if _hopper_expected() else "forward_sm80"] == 1, ran
    assert ran["backward_sm90" if _hopper_expected() else "backward_sm80"] == 1, ran
    ref_out, _ = reference_attention(q, k, v, attention_mask=mask)
    np.testing.assert_allclose(tf.cast(out, tf.float64).numpy(), ref_out, atol=6e-2, rtol=0)
    grads = [tf.cast(g, tf.float64).numpy() for g in grads]
    assert all(np.isfinite(g).all() for g in grads)
    _assert_gradients_close(grads, reference_attention_grad(q, k, v, dout, attention_mask=mask), tf.bfloat16)


def _document_ids(rng, b, s):
    """Packed documents (ids 0, 2, 4, ... increasing along each row) of random lengths, none a multiple of 128, so
    that documents begin and end inside every tile size: row 0 holds 2-6 documents, row 1 one over several tiles
    (key tiles shown in full) and then 1-4 more."""
    rows = []
    for row in range(b):
        while True:
            first = 0 if row == 0 else int(rng.integers(s // 2, 3 * s // 4))
            docs = int(rng.integers(2, 7)) if row == 0 else int(rng.integers(1, 5))
            cuts = np.sort(rng.choice(np.arange(first + 1, s), size=docs - 1, replace=False))
            cuts = np.concatenate([[first], cuts]) if first else cuts
            lengths = np.diff(np.concatenate([[0], cuts, [s]]))
            if (lengths % 128 != 0).all() and (lengths > 0).all():
                break
        rows.append(2 * np.searchsorted(cuts, np.arange(s), side="right"))
    return np.stack(rows).astype(np.int32)


def _interleaved_ids(rng, b, s):
    """Documents whose ids do not increase along the row (stretches of 20-150 positions labelled 0-3 at random), so
    that the tile loops span every tile and the tiles whose id ranges do not meet are skipped by the bounds alone."""
    rows = []
    for _ in range(b):
        lengths = rng.integers(20, 150, size=s // 20)
        labels = rng.integers(0, 4, size=lengths.size)
        rows.append(np.repeat(labels, lengths)[:s])
    return np.stack(rows).astype(np.int32)


def _segment_backward(deterministic):
    """The backward family with segment ids: sm_80 for the deterministic dQ (family.cu)."""
    return "backward_sm80" if deterministic else "backward_sm90"


def _assert_families(ran, backward="backward_sm90"):
    """The Hopper forward and `backward` on an sm_90 GPU with sm_90a code, the sm_80 family elsewhere."""
    hopper = _hopper_expected()
    forward = "forward_sm90" if hopper else "forward_sm80"
    backward = backward if hopper else "backward_sm80"
    assert ran[forward] == 1 and ran[backward] == 1, ran


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(causal=True, kv_lengths=[700, 530]),
                                      dict(dropout_rate=0.2, softcap=4.0, seed=[3, 4]),
                                      dict(deterministic=True, q_lengths=[650, 700])])
def test_segment_ids_family_output_and_gradients(dtype, head_dim, features, rng):
    """Segment ids (packed documents) run in the Hopper forward (the tile table over each query tile's documents:
    key tiles hidden, shown in full and masked by the ids) and in the Hopper backward (each key tile's query tiles
    narrowed to its documents, their table: skipped, shown in full, masked by the ids). Output, lse and gradients
    against float64, with causal, lengths, dropout (the same Philox draws as every kernel) and soft-capping, the
    deterministic dQ, GQA, at a length that is no multiple of a tile."""
    b, s, h, hkv = 2, 700, 4, 2
    q, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32) for _ in range(2))
    ids = _document_ids(rng, b, s)
    tq, tk, tv = (tf.constant(x, dtype) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, segment_ids=tf.constant(ids), return_lse=True,
                                               **features)
    _assert_families(ran, _segment_backward(features.get("deterministic", False)))
    _assert_matches_float64(q, k, v, dout, out, lse, grads, dtype, dict(features, segment_ids=ids))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [dict(), dict(causal=True, deterministic=True),
                                      dict(dropout_rate=0.1, softcap=6.0, seed=[5, 6])])
def test_interleaved_segment_ids_family_output_and_gradients(head_dim, features, rng):
    """Ids that do not increase along the row, different for queries and keys (cross attention, sq != sk): no
    binary search narrows the loops, so the Hopper kernels skip by the bounds' ranges tile by tile (the backward's
    producer and its consumers' table must skip the same query tiles) and mask the rest by the ids."""
    b, sq, sk, h, hkv = 2, 450, 777, 4, 1
    q, dout = (rng.standard_normal((b, sq, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, head_dim)).astype(np.float32) for _ in range(2))
    q_ids, kv_ids = _interleaved_ids(rng, b, sq), _interleaved_ids(rng, b, sk)
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    (out, lse), grads, ran = _forward_backward(
        [tq, tk, tv], dout, segment_ids=(tf.constant(q_ids), tf.constant(kv_ids)), return_lse=True, **features)
    _assert_families(ran, _segment_backward(features.get("deterministic", False)))
    _assert_matches_float64(q, k, v, dout, out, lse, grads, tf.bfloat16, dict(features, segment_ids=(q_ids, kv_ids)))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("ids", ["documents", "interleaved"])
def test_segment_ids_deterministic_backward_bit_identical(head_dim, ids, rng):
    """The deterministic dQ with segment ids (the sm_80 backward on every GPU: family.cu), many (batch, kv head)
    units: bit-identical runs, the gradients of float64 attention."""
    b, sq, sk, h, hkv = 4, 300, 1100, 32, 16
    q, dout = (rng.standard_normal((b, sq, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, head_dim)).astype(np.float32) for _ in range(2))
    if ids == "documents":  # three documents, their queries and keys in proportion
        q_ids = np.broadcast_to(np.searchsorted([110, 190], np.arange(sq), side="right"), (b, sq)).astype(np.int32)
        kv_ids = np.broadcast_to(np.searchsorted([400, 700], np.arange(sk), side="right"), (b, sk)).astype(np.int32)
    else:
        q_ids, kv_ids = _interleaved_ids(rng, b, sq), _interleaved_ids(rng, b, sk)
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    seg = (tf.constant(q_ids), tf.constant(kv_ids))
    runs = []
    for _ in range(3):
        _, grads, ran = _forward_backward([tq, tk, tv], dout, segment_ids=seg, causal=True, deterministic=True)
        _assert_families(ran, _segment_backward(True))
        runs.append([tf.cast(g, tf.float32).numpy() for g in grads])
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            np.testing.assert_array_equal(a, c)
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    want = reference_attention_grad(q, k, v, dout, segment_ids=(q_ids, kv_ids), causal=True)
    _assert_gradients_close(runs[0], want, tf.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_keep_unseen_nan_out(head_dim, causal, rng):
    """Keys of a document no query has (the key ids' own stretches at the end of a document: one covers a whole
    key tile, hidden, the others share tiles with seen keys, masked by the ids) and keys past kv_lengths hold NaN:
    the Hopper forward zeroes the value rows no row of a tile sees, so output, lse and gradients stay finite and
    right."""
    b, s, h = 2, 700, 4
    q, k, v, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(4))
    doc = np.stack([np.searchsorted(e, np.arange(s), side="right") for e in ([260, 530], [333, 350])])
    q_ids = (2 * doc).astype(np.int32)
    kv_ids = q_ids.copy()
    kv_ids[0, 95:260] += 1  # seen by no query (ids stay sorted: the bounds' fast path)
    kv_ids[1, 300:333] += 1
    kv_ids[1, 420:431] += 1
    kv_lengths = [700, 600]
    unseen = (kv_ids % 2 == 1) | (np.arange(s)[None] >= np.array(kv_lengths)[:, None])
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[unseen], v_nan[unseen] = np.nan, np.nan
    tk, tv = (tf.constant(x, tf.bfloat16) for x in (k_nan, v_nan))
    ref_kw = dict(segment_ids=(q_ids, kv_ids), kv_lengths=kv_lengths, causal=causal)
    (out, lse), grads, ran = _forward_backward(
        [tq, tk, tv], dout, segment_ids=(tf.constant(q_ids), tf.constant(kv_ids)), kv_lengths=kv_lengths,
        causal=causal, return_lse=True)
    _assert_families(ran)
    assert np.isfinite(out.numpy().astype(np.float32)).all()
    _assert_output_matches_float64(q, k, v, out, lse, tf.bfloat16, ref_kw)
    grads = [tf.cast(g, tf.float64).numpy() for g in grads]
    assert all(np.isfinite(g).all() for g in grads)
    _assert_gradients_close(grads, reference_attention_grad(q, k, v, dout, **ref_kw), tf.bfloat16)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_keep_unseen_query_nan_out_of_the_hopper_backward(dtype, head_dim, causal, rng):
    """Queries of a document no key has hold NaN in Q and in the output gradient, keys no query sees NaN in K and
    V: the Hopper backward zeroes, in the tiles where documents border, the Q and dO rows no key of the tile sees
    (besides the keys no query sees), so 0 x NaN reaches no gradient. The sm_80 backward zeroes keys only."""
    if not _hopper_expected():
        pytest.skip("the sm_80 backward does not zero the Q and dO rows no key sees")
    b, s, h, hkv = 2, 700, 4, 2
    q, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32) for _ in range(2))
    doc = np.stack([np.searchsorted(e, np.arange(s), side="right") for e in ([260, 530], [333, 350])])
    q_ids = (2 * doc).astype(np.int32)
    kv_ids = q_ids.copy()
    kv_ids[0, 95:260] += 1  # keys no query sees at the ends of documents (ids stay sorted)
    kv_ids[1, 680:] += 1
    q_ids[0, 660:] += 1  # queries no key sees: ids 5 and 3, which no key has
    q_ids[1, 345:350] += 1
    unseen_keys, unseen_queries = kv_ids % 2 == 1, q_ids % 2 == 1
    tq, tk, tv = (tf.constant(x, dtype) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    q_nan, k_nan, v_nan, dout_nan = q.copy(), k.copy(), v.copy(), dout.copy()
    q_nan[unseen_queries], dout_nan[unseen_queries] = np.nan, np.nan
    k_nan[unseen_keys], v_nan[unseen_keys] = np.nan, np.nan
    tq, tk, tv = (tf.constant(x, dtype) for x in (q_nan, k_nan, v_nan))
    ref_kw = dict(segment_ids=(q_ids, kv_ids), causal=causal)
    (out, lse), grads, ran = _forward_backward(
        [tq, tk, tv], dout_nan, segment_ids=(tf.constant(q_ids), tf.constant(kv_ids)), causal=causal,
        return_lse=True)
    _assert_families(ran)
    assert np.isfinite(out.numpy().astype(np.float32)).all()
    _assert_output_matches_float64(q, k, v, out, lse, dtype, ref_kw)
    grads = [tf.cast(g, tf.float64).numpy() for g in grads]
    assert all(np.isfinite(g).all() for g in grads)
    _assert_gradients_close(grads, reference_attention_grad(q, k, v, dout, **ref_kw), dtype)


def test_segment_ids_with_attention_mask_run_sm80(rng):
    """attn_mask and segment ids in one call: the sm_80 forward reads both (each is a Hopper variant of its own)."""
    b, s, h, d = 2, 300, 4, 64
    q, k, v, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))
    ids = _document_ids(rng, b, s)
    mask = rng.random((b, 1, s, s)) < 0.8
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, segment_ids=tf.constant(ids), attention_mask=mask,
                                               return_lse=True)
    assert ran["forward_sm80"] == 1 and ran["forward_sm90"] == 0, ran
    assert ran["backward_sm80"] == 1 and ran["backward_sm90"] == 0, ran
    _assert_matches_float64(q, k, v, dout, out, lse, grads, tf.bfloat16, dict(segment_ids=ids, attention_mask=mask))


def test_segment_ids_with_block_mask_backward_runs_sm80(rng):
    """Segment ids with a block mask of whole tiles: the Hopper backward's table holds the documents' coverage
    only, so the sm_80 backward reads both."""
    b, s, h, d = 2, 300, 4, 64
    q, k, v, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))
    ids = _document_ids(rng, b, s)
    block_mask = rng.random((b, h, 3, 3)) < 0.7
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    kw = dict(block_mask=block_mask, block_size=128)
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, segment_ids=tf.constant(ids), return_lse=True,
                                               **kw)
    assert ran["backward_sm80"] == 1 and ran["backward_sm90"] == 0, ran
    _assert_matches_float64(q, k, v, dout, out, lse, grads, tf.bfloat16, dict(kw, segment_ids=ids))


def test_head_dim_32_runs_sm80(rng):
    _, _, ran = _run(rng, tf.float16, 32)
    assert ran["forward_sm80"] == 1 and ran["forward_sm90"] == 0, ran


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [dict(causal=True), dict(), dict(window=(70, 20)), dict(dropout_rate=0.1, seed=5),
                                      dict(deterministic=True)])
def test_backward_family_and_gradients(dtype, head_dim, features, rng):
    """On sm_90 the backward takes the Hopper dK/dV kernel at head dims 64, 128 and 256 (dropout and the
    deterministic dQ included), elsewhere the sm_80 one; gradients against float64 either way (GQA, odd
    lengths)."""
    b, sq, sk, h, hkv = 2, 200, 333, 4, 2
    q, dout = (rng.standard_normal((b, sq, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, head_dim)).astype(np.float32) for _ in range(2))
    tq, tk, tv = (tf.constant(x, dtype) for x in (q, k, v))
    _, grads, ran = _forward_backward([tq, tk, tv], dout, **features)
    hopper = _hopper_expected()
    family = "backward_sm90" if hopper else "backward_sm80"
    assert ran[family] == 1, (features, ran)
    if "dropout_rate" in features:
        return  # dropout gradients: test_dropout_and_softcap_forward_family_and_gradients, test_dropout.py
    masks = {key: val for key, val in features.items() if key in ("causal", "window")}
    _assert_gradients_close(grads, reference_attention_grad(q, k, v, dout, **masks), dtype)


def _hopper_takes_block_size(direction, head_dim, block_size):
    """Whether the Hopper kernel of `direction` takes blocks of block_size = (bq, bk): blocks that hold whole
    tiles (forward: 128 query rows x 128 keys, 64 at head dim 256; backward: 64 x 128, 64 x 64 at head dim
    256), so that each tile is shown or skipped whole."""
    bq, bk = block_size
    if direction == "forward":
        return bq % 128 == 0 and bk % (64 if head_dim == 256 else 128) == 0
    return bq % 64 == 0 and bk % (64 if head_dim == 256 else 128) == 0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 128), (128, 64), (256, 384)])
@pytest.mark.parametrize("features", [dict(), dict(causal=True, kv_lengths=[300, 230]),
                                      dict(dropout_rate=0.2, softcap=4.0, seed=[3, 4])])
def test_block_mask_family_output_and_gradients(head_dim, block_size, features, rng):
    """Block masks whose blocks hold whole Hopper tiles run in the Hopper kernels, which skip the tiles of
    False blocks; finer blocks in the sm_80 ones (element-wise check). Output, lse and gradients against
    float64 either way, with causal, lengths, dropout and soft-capping (GQA, odd lengths)."""
    b, s, h, hkv = 2, 300, 4, 2
    q, dout = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32) for _ in range(2))
    blocks = tuple((s + n - 1) // n for n in block_size)
    block_mask = rng.random((b, h) + blocks) < 0.6
    block_mask[..., 0, :] = True  # the first query block sees every key block, the others as drawn
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    (out, lse), grads, ran = _forward_backward([tq, tk, tv], dout, block_mask=block_mask, block_size=block_size,
                                               return_lse=True, **features)
    hopper = _hopper_expected()
    forward = "forward_sm90" if hopper and _hopper_takes_block_size("forward", head_dim, block_size) else "forward_sm80"
    backward = ("backward_sm90" if hopper and _hopper_takes_block_size("backward", head_dim, block_size)
                else "backward_sm80")
    assert ran[forward] == 1 and ran[backward] == 1, ran
    _assert_matches_float64(q, k, v, dout, out, lse, grads, tf.bfloat16,
                            dict(features, block_mask=block_mask, block_size=block_size))


def test_xla_front_door_reaches_the_same_family(rng):
    """jit_compile: the XLA custom call launches the kernels through the same entry point. The first call counts:
    this forward may be recorded into XLA's CUDA graphs, whose replays launch without the op's host code."""
    q, k, v = (tf.constant(rng.standard_normal((2, 256, 2, 128)), tf.bfloat16) for _ in range(3))
    attend = tf.function(lambda q, k, v: tf_flash.flash_attention(q, k, v, causal=True), jit_compile=True)
    before = cuda_kernel_counts()
    with tf.device("/GPU:0"):
        attend(q, k, v).numpy()
    after = cuda_kernel_counts()
    family, other = ("forward_sm90", "forward_sm80") if _hopper_expected() else ("forward_sm80", "forward_sm90")
    assert after[family] - before[family] >= 1 and after[other] == before[other], (before, after)


def test_xla_front_door_packs_attention_masks(rng):
    """jit_compile with attention_mask: the custom call's workspace (XLA's scratch) holds the packed mask."""
    q, k, v = (rng.standard_normal((2, 300, 2, 128)).astype(np.float32) for _ in range(3))
    mask = rng.random((2, 1, 300, 300)) < 0.7
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    attend = tf.function(lambda q, k, v, m: tf_flash.flash_attention(q, k, v, attention_mask=m), jit_compile=True)
    with tf.device("/GPU:0"):
        attend(tq, tk, tv, mask)  # compiles
        before = cuda_kernel_counts()
        out = attend(tq, tk, tv, mask).numpy()
    after = cuda_kernel_counts()
    family = "forward_sm90" if _hopper_expected() else "forward_sm80"
    assert after[family] - before[family] == 1, (before, after)
    q, k, v = (tf.cast(x, tf.float64).numpy() for x in (tq, tk, tv))
    ref, _ = reference_attention(q, k, v, attention_mask=mask)
    np.testing.assert_allclose(tf.cast(out, tf.float64).numpy(), ref, atol=6e-2, rtol=0)
