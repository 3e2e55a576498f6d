// frugal_step_ on the GPU: the launch parameter, the block body in phases
// separated by barriers, and the host planning, shared by frugal_step.cu and
// the emulator.
//
// A block owns a chunk of kFrugalTilesPerBlock tiles of one tensor. First its
// threads find the state-full members of all its tiles at once, one tile per
// thread (frugal_tile.h: two searches each), so the dependent loads of the
// searches are paid once per block, in parallel, not once per tile. Then, per
// tile, the threads enumerate the tile's members into a shared-memory table
// (the member's ordinal at its position, -1 elsewhere), and after a barrier
// stream the tile: one read of p and g and one write of p per coordinate,
// plus m and v for the members.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fragment.cuh"
#include "frugal/frugal_tile.h"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

constexpr int kFrugalThreads = 256;
constexpr int64_t kFrugalTile = kFrugalThreads * kIlp;  // one round per tile
constexpr int kFrugalTilesPerBlock = 8;
constexpr int64_t kFrugalChunk = kFrugalTile * kFrugalTilesPerBlock;

// 24 tensors x 72 bytes + 320 blocks x 5 bytes: about 3.3 KB.
struct FrugalMeta : LaunchMap<24, 320> {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  float* exp_avgs[kMaxTensors];
  float* exp_avg_sqs[kMaxTensors];
  const void* indices[kMaxTensors];
  int64_t rows[kMaxTensors];
  int64_t cols[kMaxTensors];
  int64_t k[kMaxTensors];
};

struct FrugalArgs {
  FrugalScalars scalars;
  AdamWHyper hyper;
  double state_free_scale;
  DeviceScalars device;
  SubsetKind kind;
};

static_assert(sizeof(FrugalMeta) + sizeof(FrugalArgs) <= kMaxParamBytes,
              "frugal_step_ kernel parameters exceed 4 KB");

inline FrugalArgs frugal_args(const SubsetBatch& sub, const FrugalHyper& h, const DeviceScalars& d) {
  return FrugalArgs{frugal_scalars(h), h.adamw, h.state_free_scale, d, sub.kind};
}

FK_HOST_DEVICE FrugalScalars resolve(const FrugalArgs& a) {
  if (!on_device(a.device)) return a.scalars;
  return frugal_scalars(
      FrugalHyper{resolve_hyper(a.hyper, a.device), a.state_free_scale, a.scalars.mode});
}

// A block's shared memory (8.3 KB).
struct FrugalShared {
  TileMembers tiles[kFrugalTilesPerBlock];
  // Per position of the current tile: q - q_begin of its member, or -1. The
  // ordinal, not the slot, so that it fits 32 bits in any tensor.
  int32_t ordinal[kFrugalTile];
};

// Calls fn(position, q - q_begin) for the members q = q_begin + tid,
// q_begin + tid + nthreads, ... of a tile (one thread's share of them);
// (outer, inner) of q advances by a precomputed step instead of a 64-bit
// division per member.
template <typename Index, typename Fn>
FK_HOST_DEVICE void for_members(const SubsetShape& shape, const Index* idx, const TileMembers& tm,
                                int tid, int nthreads, Fn&& fn) {
  int64_t q = tm.q_begin + tid;
  if (q >= tm.q_end) return;
  const int64_t len = tm.inner_len;
  int64_t outer = q / len;
  int64_t inner = q - outer * len;
  const int64_t step_outer = nthreads / len;
  const int64_t step_inner = nthreads - step_outer * len;
  for (; q < tm.q_end; q += nthreads) {
    fn(member_position(shape, idx, tm, outer, inner), int32_t(q - tm.q_begin));
    outer += step_outer;
    inner += step_inner;
    if (inner >= len) {
      inner -= len;
      ++outer;
    }
  }
}

// Members = false leaves the members' params as they are and reads no moment:
// frugal_step_int8_'s first launch, whose second updates the members block by
// block of their 8-bit moments (frugal_step_int8.cuh).
template <typename T, typename Index, StateFree Mode, bool Members = true>
struct FrugalBlock {
  T* p;
  const T* g;
  float* m;
  float* v;
  const Index* idx;
  SubsetShape shape;
  int64_t begin;  // the chunk's first position in the tensor
  int64_t end;
  int tiles;
  bool aligned;
  FrugalScalars s;

  FK_HOST_DEVICE FrugalBlock(const FrugalMeta& meta, const FrugalArgs& args, int block) {
    const BlockRange r = meta.range(block, kFrugalChunk);
    p = static_cast<T*>(meta.params[r.slot]);
    g = static_cast<const T*>(meta.grads[r.slot]);
    m = meta.exp_avgs[r.slot];
    v = meta.exp_avg_sqs[r.slot];
    idx = static_cast<const Index*>(meta.indices[r.slot]);
    shape = SubsetShape{args.kind, meta.rows[r.slot], meta.cols[r.slot], meta.k[r.slot]};
    begin = r.begin;
    end = r.end;
    // A skipped step (GradScaler's found_inf) is a block without tiles.
    tiles = skipped(args.device) ? 0 : int((end - begin + kFrugalTile - 1) / kFrugalTile);
    // m and v are indexed per member, never as vectors.
    aligned = aligned16(p) && aligned16(g);
    s = resolve(args);
  }

  // The block's program. run(phase) calls phase(tid) for every thread of the
  // block and returns once all have (on the GPU: the call, then a barrier).
  template <typename Run>
  FK_HOST_DEVICE void run_phases(FrugalShared& sh, int nthreads, Run&& run) const {
    run([&](int tid) { find_members(sh, tid, nthreads); });
    for (int t = 0; t < tiles; ++t) {
      run([&](int tid) { mark(sh, t, tid, nthreads); });
      run([&](int tid) { apply(sh, t, tid, nthreads); });
    }
  }

  FK_HOST_DEVICE int64_t tile_begin(int t) const { return begin + t * kFrugalTile; }
  FK_HOST_DEVICE int64_t tile_end(int t) const {
    return tile_begin(t) + kFrugalTile < end ? tile_begin(t) + kFrugalTile : end;
  }

  // Members of every tile of the chunk; an empty table.
  FK_HOST_DEVICE void find_members(FrugalShared& sh, int tid, int nthreads) const {
    for (int t = tid; t < tiles; t += nthreads) {
      const int64_t a = tile_begin(t);
      sh.tiles[t] = tile_members(shape, idx, a, tile_end(t), uniform_guess(shape, a / shape.cols));
    }
    for (int i = tid; i < kFrugalTile; i += nthreads) sh.ordinal[i] = -1;
  }

  // Enters the members of tile t into the table.
  FK_HOST_DEVICE void mark(FrugalShared& sh, int t, int tid, int nthreads) const {
    const int64_t a = tile_begin(t);
    for_members(shape, idx, sh.tiles[t], tid, nthreads,
                [&](int64_t position, int32_t ordinal) { sh.ordinal[position - a] = ordinal; });
  }

  // Updates every position of tile t and leaves the table empty again.
  FK_HOST_DEVICE void apply(FrugalShared& sh, int t, int tid, int nthreads) const {
    const int64_t a = tile_begin(t);
    const int64_t n = tile_end(t) - a;
    const TileMembers& tm = sh.tiles[t];
    float* tm_m = Members ? m + tm.slot_base + tm.q_begin : nullptr;
    float* tm_v = Members ? v + tm.slot_base + tm.q_begin : nullptr;
    T* tp = p + a;
    const T* tg = g + a;
    for (int64_t round = 0; round < n; round += round_size(nthreads)) {
      const Fragment f = fragment(round, n, aligned, tid, nthreads);
      float fp[kIlp] = {}, fg[kIlp] = {}, fm[kIlp] = {}, fv[kIlp] = {};
      int32_t ord[kIlp];
      load(tp, f, fp);
      load(tg, f, fg);
      FK_UNROLL
      for (int j = 0; j < kIlp; ++j) {
        ord[j] = -1;
        if (j < f.count) {
          const int64_t i = f.offset + j * f.stride;
          ord[j] = sh.ordinal[i];
          sh.ordinal[i] = -1;
        }
        if (Members && ord[j] >= 0) {
          fm[j] = tm_m[ord[j]];
          fv[j] = tm_v[ord[j]];
        }
      }
      FK_UNROLL
      for (int j = 0; j < kIlp; ++j) {
        if (ord[j] < 0) {
          fp[j] = state_free_update<Mode>(fp[j], fg[j], s.state_free);
        } else if (Members) {
          fp[j] = adamw_update(fp[j], fg[j], fm[j], fv[j], s.adamw);
        }
      }
      store(tp, f, fp);
      FK_UNROLL
      for (int j = 0; j < kIlp; ++j) {
        if (Members && ord[j] >= 0) {
          tm_m[ord[j]] = fm[j];
          tm_v[ord[j]] = fv[j];
        }
      }
    }
  }
};

template <typename Launch>
int64_t plan_frugal_step(const TensorBatch& t, const SubsetBatch& sub, Launch&& launch) {
  return plan_launches<FrugalMeta>(
      t.count, t.numel, kFrugalChunk,
      [&](FrugalMeta& meta, int slot, int64_t i) {
        meta.params[slot] = t.params[i];
        meta.grads[slot] = t.grads[i];
        meta.exp_avgs[slot] = t.exp_avgs[i];
        meta.exp_avg_sqs[slot] = t.exp_avg_sqs[i];
        meta.indices[slot] = sub.indices[i];
        meta.rows[slot] = sub.rows[i];
        meta.cols[slot] = sub.cols[i];
        meta.k[slot] = sub.k[i];
      },
      launch);
}

// Run fn(T{}, Index{}, Mode{}) with the types of one call (Mode an
// integral_constant of StateFree).
template <typename Fn>
void with_frugal_types(DType dtype, bool index_is_int32, StateFree mode, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) {
    auto with_mode = [&](auto index) {
      using S = StateFree;
      switch (mode) {
        case S::kSign: fn(tag, index, std::integral_constant<S, S::kSign>{}); break;
        case S::kSgd: fn(tag, index, std::integral_constant<S, S::kSgd>{}); break;
        case S::kNone: fn(tag, index, std::integral_constant<S, S::kNone>{}); break;
      }
    };
    if (index_is_int32) {
      with_mode(int32_t{});
    } else {
      with_mode(int64_t{});
    }
  });
}

}  // namespace cuda
}  // namespace frugal
