// The Hopper forward's tile scheduler: which query tile (with the key tiles its rows see) each CTA runs in
// each wave. FwdScheduleSm90 is the static schedule the launcher makes (make_fwd_schedule); FwdTileSchedulerSm90
// reads it on the device for one CTA.
#pragma once

#include <cstdint>
#include <limits>

#include <cuda_runtime.h>

#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace cuda {

// Which query tiles each CTA of the Hopper forward runs. Tiles go in the order (group of heads, query tile from
// the last down, (batch, head) in the group): the last query tiles are the heaviest under a causal mask, and a
// group holds the heads of one kv head or (make_fwd_schedule) those whose K and V fit in L2 together, which the
// CTAs running at one time then share. CTA c
// of `ctas` takes tile c of each wave of `ctas` tiles, counted from the wave's end in odd waves, so that heavy
// and light tiles even out over the CTAs: a static schedule, with no counter to reset before each launch. With
// a CTA per tile (ctas == tiles) it is the launch order. Split-KV (FlashFwdParams::num_splits) repeats the
// order once per run of key tiles, run after run.
struct FwdScheduleSm90 {
  int m_blocks = 1;     // query tiles per (batch, head)
  int num_heads = 1;
  int group_pairs = 1;  // (batch, head) pairs per group
  int splits = 1;       // runs of key tiles per query tile
  int64_t tiles = 0;    // m_blocks x batch x heads x splits
  struct Tile {
    int m_block, h, b, split;
  };
  __host__ __device__ int64_t index(int64_t wave, int cta, int ctas) const {
    return wave * ctas + (wave % 2 == 0 ? cta : ctas - 1 - cta);
  }
  __host__ __device__ Tile tile(int64_t i) const {
    const int64_t per_split = tiles / splits;
    const int split = int(i / per_split);
    i -= split * per_split;
    const int64_t group_tiles = int64_t(group_pairs) * m_blocks;
    const int64_t group = i / group_tiles, r = i - group * group_tiles;
    const int64_t pairs_left = per_split / m_blocks - group * group_pairs;
    const int64_t pairs_here = pairs_left < group_pairs ? pairs_left : group_pairs;
    const int64_t m_rank = r / pairs_here;
    const int64_t pair = group * group_pairs + (r - m_rank * pairs_here);
    return Tile{int(m_blocks - 1 - m_rank), int(pair % num_heads), int(pair / num_heads), split};
  }
};

// A query tile and the key tiles some valid row of it sees (the same rule as the sm_80 family), those of run
// `split` under split-KV.
struct FwdTileWork {
  int m_block, h, b, h_kv, split;
  int64_t q_len, kv_len, m0;
  QueryTileKeys keys;
};

// This CTA's tiles of `schedule`, wave after wave. kOneTilePerCta: the launcher gives each CTA one tile (the
// attn_mask variant always has a tile table, made once per CTA), so the loops over the waves carry nothing over.
template <class Traits, bool kOneTilePerCta>
struct FwdTileSchedulerSm90 {
  static constexpr int kMaxWaves = kOneTilePerCta ? 1 : std::numeric_limits<int>::max();
  const FwdScheduleSm90& schedule;
  const FlashFwdParams& p;
  const int cta, ctas;

  __device__ __forceinline__ FwdTileSchedulerSm90(const FwdScheduleSm90& schedule, const FlashFwdParams& p)
      : schedule(schedule), p(p), cta(int(blockIdx.x)), ctas(int(gridDim.x)) {}

  // The tile of `wave` into w; false once this CTA has no more tiles.
  __device__ __forceinline__ bool tile_work(int wave, FwdTileWork& w) const {
    const int64_t i = schedule.index(wave, cta, ctas);
    if (i >= schedule.tiles) return false;
    const FwdScheduleSm90::Tile t = schedule.tile(i);
    w.m_block = t.m_block;
    w.h = t.h;
    w.b = t.b;
    w.h_kv = t.h / (p.num_heads / p.num_heads_kv);
    w.q_len = valid_q_len(p, t.b);
    w.kv_len = valid_kv_len(p, t.b);
    w.m0 = int64_t(t.m_block) * Traits::kBlockM;
    w.keys = query_tile_keys(p, w.m0, Traits::kBlockM, Traits::kBlockN, w.q_len, w.kv_len);
    w.split = t.split;
    narrow_to_split(p.num_splits, t.split, w.keys.tile_begin, w.keys.tile_end);
    return true;
  }
  // The loops' condition: wave `wave` runs a tile (into w).
  __device__ __forceinline__ bool next(int wave, FwdTileWork& w) const {
    return wave < kMaxWaves && tile_work(wave, w);
  }
};

}  // namespace cuda
}  // namespace tf_flash
