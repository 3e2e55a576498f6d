// dqt_update_ on the GPU: the launch parameter, the block body in phases
// separated by barriers, and the host planning, shared by dqt_update.cu and
// the emulator.
//
// The codes of a weight [R, C] are packed row by row (frugal/quant.h), so a
// byte may hold fields of several columns. Eight consecutive fields of a row
// fill `bits` whole bytes, and the unit of work of a thread is such a group:
// it owns its bytes, so no two threads ever write parts of one byte. Each row
// is seen with its length padded to a whole number of groups (the `pitch`,
// C rounded up to a multiple of 8); a block owns a chunk of these padded
// positions, kDqtTilesPerBlock tiles of one group per thread, and threads in
// the padding do nothing.
//
// As in frugal_step_, the block first finds the state-full members of all
// its tiles (frugal_tile.h, on the tile's range of real positions), then per
// tile enters them in a shared-memory table (the member's ordinal at its
// padded position, -1 elsewhere) and, after a barrier, each thread updates its
// group: unpack and dequantize the eight fields, AdamW on the members and the
// state-free rule on the others (update_rules.h), stochastic rounding with the
// counter-based uniforms of (seed, rng_step, element index), pack and store.
// The rules and the rounding are the CPU kernel's, so the codes and the
// moments are equal bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "fragment.cuh"
#include "frugal/frugal_tile.h"
#include "frugal/quant.h"
#include "frugal_step.cuh"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

constexpr int kDqtThreads = 256;
constexpr int kDqtGroup = 8;  // fields per group: they fill `bits` whole bytes
constexpr int64_t kDqtTile = int64_t(kDqtThreads) * kDqtGroup;  // padded positions
constexpr int kDqtTilesPerBlock = 8;
constexpr int64_t kDqtChunk = kDqtTile * kDqtTilesPerBlock;
static_assert(kDqtGroup == kIlp, "a group's gradients move as one fragment");

// 20 tensors x 93 bytes + 320 blocks x 5 bytes: about 3.5 KB.
struct DqtMeta : LaunchMap<20, 320> {
  uint8_t* codes[kMaxTensors];
  const float* scales[kMaxTensors];
  const void* grads[kMaxTensors];
  float* exp_avgs[kMaxTensors];
  float* exp_avg_sqs[kMaxTensors];
  const void* indices[kMaxTensors];
  int64_t rows[kMaxTensors];         // R of the weight
  int64_t cols[kMaxTensors];         // C of the weight
  int64_t subset_cols[kMaxTensors];  // C of the subset's [rows, cols] view (1: flat)
  int64_t k[kMaxTensors];
  uint32_t seeds[kMaxTensors];
  bool scale_per_row[kMaxTensors];
};

// The code width travels as a value, not a template parameter: it only sets
// shifts and masks, and 4 widths would quadruple the 18 instances.
struct DqtArgs {
  FrugalArgs frugal;
  int bits;
  uint32_t rng_step;
};

static_assert(sizeof(DqtMeta) + sizeof(DqtArgs) <= kMaxParamBytes,
              "dqt_update_ kernel parameters exceed 4 KB");

inline DqtArgs dqt_args(const SubsetBatch& sub, const DqtHyper& h, const DeviceScalars& d) {
  return DqtArgs{frugal_args(sub, h.frugal, d), h.bits, h.rng_step};
}

// A weight's padded length: R rows of a whole number of groups.
FK_HOST_DEVICE int64_t dqt_pitch(int64_t cols) {
  return (cols + kDqtGroup - 1) / kDqtGroup * kDqtGroup;
}

// A block's shared memory (8.3 KB).
struct DqtShared {
  TileMembers tiles[kDqtTilesPerBlock];
  // Per padded position of the current tile: q - q_begin of its member, or -1.
  int32_t ordinal[kDqtTile];
};

template <typename T, typename Index, StateFree Mode>
struct DqtBlock {
  uint8_t* codes;
  const float* scales;
  const T* g;
  float* m;
  float* v;
  const Index* idx;
  SubsetShape shape;
  int64_t cols;         // C
  int64_t pitch;        // C rounded up to whole groups
  int64_t packed_cols;  // bytes of a packed row
  bool scale_per_row;
  int64_t begin;  // the chunk's first padded position
  int64_t end;
  int tiles;
  int bits;
  uint32_t key;
  FrugalScalars s;

  FK_HOST_DEVICE DqtBlock(const DqtMeta& meta, const DqtArgs& args, int block) {
    const BlockRange r = meta.range(block, kDqtChunk);
    codes = meta.codes[r.slot];
    scales = meta.scales[r.slot];
    g = static_cast<const T*>(meta.grads[r.slot]);
    m = meta.exp_avgs[r.slot];
    v = meta.exp_avg_sqs[r.slot];
    idx = static_cast<const Index*>(meta.indices[r.slot]);
    cols = meta.cols[r.slot];
    pitch = dqt_pitch(cols);
    shape = SubsetShape{args.frugal.kind, meta.rows[r.slot] * cols / meta.subset_cols[r.slot],
                        meta.subset_cols[r.slot], meta.k[r.slot]};
    bits = args.bits;
    packed_cols = quant_packed_cols(cols, bits);
    scale_per_row = meta.scale_per_row[r.slot];
    begin = r.begin;
    end = r.end;
    // A skipped step (GradScaler's found_inf) is a block without tiles.
    tiles = skipped(args.frugal.device) ? 0 : int((end - begin + kDqtTile - 1) / kDqtTile);
    key = rng_key(meta.seeds[r.slot], args.rng_step);
    s = resolve(args.frugal);
  }

  // The block's program; run(phase) as for FrugalBlock.
  template <typename Run>
  FK_HOST_DEVICE void run_phases(DqtShared& sh, int nthreads, Run&& run) const {
    run([&](int tid) { find_members(sh, tid, nthreads); });
    for (int t = 0; t < tiles; ++t) {
      run([&](int tid) { mark(sh, t, tid, nthreads); });
      run([&](int tid) { apply(sh, t, tid, nthreads); });
    }
  }

  FK_HOST_DEVICE int64_t tile_begin(int t) const { return begin + t * kDqtTile; }
  FK_HOST_DEVICE int64_t tile_end(int t) const {
    return tile_begin(t) + kDqtTile < end ? tile_begin(t) + kDqtTile : end;
  }

  // The padded position of a real one (an element's index in [R, C]).
  FK_HOST_DEVICE int64_t padded(int64_t position) const {
    if (pitch == cols) return position;  // C a multiple of 8: no division
    return position + (position / cols) * (pitch - cols);
  }

  // The real positions [a, b) of tile t's padded ones. A tile starts on a
  // group, whose first column is below C (the padding is under 8 long), and
  // its last real position is its last one or the end of its last row.
  FK_HOST_DEVICE void real_range(int t, int64_t& a, int64_t& b) const {
    const int64_t first = tile_begin(t), last = tile_end(t) - 1;
    const int64_t r0 = first / pitch, r1 = last / pitch;
    const int64_t c1 = last - r1 * pitch;
    a = r0 * cols + (first - r0 * pitch);
    b = r1 * cols + (c1 < cols ? c1 + 1 : cols);
  }

  // Members of every tile of the chunk; an empty table.
  FK_HOST_DEVICE void find_members(DqtShared& sh, int tid, int nthreads) const {
    for (int t = tid; t < tiles; t += nthreads) {
      int64_t a, b;
      real_range(t, a, b);
      sh.tiles[t] = tile_members(shape, idx, a, b, uniform_guess(shape, a / shape.cols));
    }
    for (int i = tid; i < kDqtTile; i += nthreads) sh.ordinal[i] = -1;
  }

  // Enters the members of tile t into the table, at their padded positions.
  FK_HOST_DEVICE void mark(DqtShared& sh, int t, int tid, int nthreads) const {
    const int64_t a = tile_begin(t);
    for_members(shape, idx, sh.tiles[t], tid, nthreads, [&](int64_t position, int32_t ordinal) {
      sh.ordinal[padded(position) - a] = ordinal;
    });
  }

  // Updates the groups of tile t (one per thread and round) and leaves the
  // table empty again.
  FK_HOST_DEVICE void apply(DqtShared& sh, int t, int tid, int nthreads) const {
    const TileMembers& tm = sh.tiles[t];
    float* tm_m = m + tm.slot_base + tm.q_begin;
    float* tm_v = v + tm.slot_base + tm.q_begin;
    const int qmax = quant_qmax(bits);
    const uint32_t mask = (1u << bits) - 1;
    for (int64_t first = tile_begin(t) + int64_t(tid) * kDqtGroup; first < tile_end(t);
         first += int64_t(nthreads) * kDqtGroup) {
      const int64_t r = first / pitch;
      const int64_t c0 = first - r * pitch;
      const int n = cols - c0 < kDqtGroup ? int(cols - c0) : kDqtGroup;  // real fields
      uint8_t* bytes = codes + r * packed_cols + c0 / kDqtGroup * bits;
      const int n_bytes = (n * bits + 7) / 8;
      uint64_t word = 0;
      // Unrolled with guards rather than bounded by n, here and below, so that
      // the group's values stay in registers.
      FK_UNROLL
      for (int i = 0; i < kDqtGroup; ++i) {
        if (i < n_bytes) word |= uint64_t(bytes[i]) << (8 * i);
      }
      const float scale = scales[scale_per_row ? r : 0];
      const int64_t position = r * cols + c0;
      // The eight gradients as one fragment: 16-byte loads where aligned.
      const Fragment f{0, 1, n, n == kDqtGroup && aligned16(g + position)};
      float fg[kDqtGroup] = {};
      load(g + position, f, fg);
      int32_t* ordinal = sh.ordinal + (first - tile_begin(t));
      uint64_t out = 0;
      FK_UNROLL
      for (int j = 0; j < kDqtGroup; ++j) {
        if (j >= n) continue;
        float w = scale * float(int((word >> (j * bits)) & mask) - qmax);
        const int32_t ord = ordinal[j];
        ordinal[j] = -1;
        if (ord >= 0) {
          float mj = tm_m[ord], vj = tm_v[ord];
          w = adamw_update(w, fg[j], mj, vj, s.adamw);
          tm_m[ord] = mj;
          tm_v[ord] = vj;
        } else {
          w = state_free_update<Mode>(w, fg[j], s.state_free);
        }
        const float u = rng_uniform(key, uint32_t(position + j));
        out |= uint64_t(round_to_field(w / scale, u, qmax)) << (j * bits);
      }
      // The fields past n are zero: a row's padding bits stay zero.
      FK_UNROLL
      for (int i = 0; i < kDqtGroup; ++i) {
        if (i < n_bytes) bytes[i] = uint8_t(out >> (8 * i));
      }
    }
  }
};

template <typename Launch>
int64_t plan_dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
                        const int64_t* padded_numel, Launch&& launch) {
  return plan_launches<DqtMeta>(
      t.count, padded_numel, kDqtChunk,
      [&](DqtMeta& meta, int slot, int64_t i) {
        meta.codes[slot] = static_cast<uint8_t*>(t.params[i]);
        meta.scales[slot] = q.scales[i];
        meta.grads[slot] = t.grads[i];
        meta.exp_avgs[slot] = t.exp_avgs[i];
        meta.exp_avg_sqs[slot] = t.exp_avg_sqs[i];
        meta.indices[slot] = sub.indices[i];
        meta.rows[slot] = q.rows[i];
        meta.cols[slot] = q.cols[i];
        meta.subset_cols[slot] = sub.cols[i];
        meta.k[slot] = sub.k[i];
        meta.seeds[slot] = q.seeds[i];
        meta.scale_per_row[slot] = q.scale_count[i] != 1;
      },
      launch);
}

// The padded lengths the planner cuts into chunks, one per weight.
inline std::vector<int64_t> dqt_padded_numels(const QuantBatch& q, int64_t count) {
  std::vector<int64_t> padded(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) padded[size_t(i)] = q.rows[i] * dqt_pitch(q.cols[i]);
  return padded;
}

}  // namespace cuda
}  // namespace frugal
