// adamw_int8_ on the GPU: the launch parameter, the warp program in phases
// separated by barriers, and the host planning, shared by adamw_int8.cu and the
// emulator. The warp program (moments8_warp) serves frugal_step_int8.cuh too.
//
// One warp per moment block (frugal/moments8.h): a block is kMomentBlock = 256
// elements, which is 32 lanes x kIlp, so a warp holds a whole block in registers
// with the 16-byte accesses of the other kernels, and the block's two maxima are
// a reduction within the warp, behind __syncwarp, never a barrier of the thread
// block: the warps of a thread block share nothing and never wait for one
// another. (A thread block per moment block would hold one element a thread and
// pay a block-wide barrier per level of its reduction for every 256 elements.)
//
// Per block, three steps: every lane dequantizes its elements, takes the AdamW
// update (the parameter is written at once: it moves with the fp32 moments) and
// keeps the updated m and v^(1/4) in registers with the maxima of its elements;
// a tree over the lanes (shared memory) gives the block's maxima; every lane
// quantizes its elements with the block's scales. The planner's units are moment
// blocks: a thread block owns kAdamWInt8Chunk of them, its warps taking every
// kMoments8Warps-th.
#pragma once

#include <cstdint>
#include <cstring>
#if !defined(__CUDA_ARCH__)
#include <stdexcept>
#endif
#include <vector>

#include "fragment.cuh"
#include "frugal/moments8.h"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

constexpr int kWarp = 32;
// The thread blocks of both kernels on 8-bit moments (adamw_int8_, frugal_step_int8_'s
// member blocks): 8 warps.
constexpr int kMoments8Threads = 256;
constexpr int kMoments8Warps = kMoments8Threads / kWarp;
// Moment blocks a thread block owns: 8 per warp, 16384 elements (adamw_'s chunk)
// when the rows are at least a block long.
constexpr int64_t kAdamWInt8Chunk = 64;

static_assert(kWarp * kIlp == kMomentBlock, "a warp's round must be one moment block");

// 32 tensors x 64 bytes + 320 blocks x 5 bytes: about 3.6 KB. numel counts
// moment blocks (rows x blocks per row), the planner's units.
struct AdamWInt8Meta : LaunchMap<32, 320> {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  int8_t* exp_avgs[kMaxTensors];
  float* exp_avg_scales[kMaxTensors];
  uint8_t* exp_avg_sqs[kMaxTensors];
  float* exp_avg_sq_scales[kMaxTensors];
  int64_t cols[kMaxTensors];
};

static_assert(sizeof(AdamWInt8Meta) + sizeof(AdamWArgs) <= kMaxParamBytes,
              "adamw_int8_ kernel parameters exceed 4 KB");

// A warp's partial maxima, as bit patterns (moments8.h: a non-negative float
// orders as its bits, a NaN above every number).
struct Int8WarpShared {
  uint32_t m_bits[kWarp];
  uint32_t w_bits[kWarp];
};

// A thread block's shared memory (2 KB).
struct Moments8Shared {
  Int8WarpShared warp[kMoments8Warps];
};

// What a lane keeps in registers from the update to the quantization of a block.
struct Int8Lane {
  float m[kIlp];
  float w[kIlp];
};

FK_HOST_DEVICE bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

// kIlp = 8 codes of a fragment; one 8-byte access when the fragment is a vector
// (the emulator insists on the alignment, as load16 does).
template <typename C>
FK_HOST_DEVICE void load_codes(const C* base, const Fragment& f, C (&out)[kIlp]) {
  if (f.vector) {
    const C* at = base + f.offset;
    uint64_t word;
#if defined(__CUDA_ARCH__)
    word = *reinterpret_cast<const uint64_t*>(at);
#else
    if (!aligned8(at)) {
      throw std::logic_error("emulated CUDA kernel: 8-byte load from a misaligned address");
    }
    std::memcpy(&word, at, sizeof(word));
#endif
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) out[j] = C(uint8_t(word >> (8 * j)));
    return;
  }
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) out[j] = base[f.offset + j * f.stride];
  }
}

template <typename C>
FK_HOST_DEVICE void store_codes(C* base, const Fragment& f, const C (&in)[kIlp]) {
  if (f.vector) {
    C* at = base + f.offset;
    uint64_t word = 0;
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) word |= uint64_t(uint8_t(in[j])) << (8 * j);
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint64_t*>(at) = word;
#else
    if (!aligned8(at)) {
      throw std::logic_error("emulated CUDA kernel: 8-byte store to a misaligned address");
    }
    std::memcpy(at, &word, sizeof(word));
#endif
    return;
  }
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) base[f.offset + j * f.stride] = in[j];
  }
}

// A moment block of n elements whose params lie in one contiguous run (every
// block of adamw_int8_, a member row's of frugal_step_int8_): its codes and
// scales, and the params and gradients as fragments, 16 bytes at a time where
// the addresses allow.
template <typename T>
struct MomentBlock8 {
  T* p;
  const T* g;
  int8_t* m;
  uint8_t* v;
  float* m_scale;
  float* v_scale;
  int64_t n;
  bool aligned;

  FK_HOST_DEVICE MomentBlock8(T* p_, const T* g_, int8_t* m_, uint8_t* v_, float* m_scale_,
                              float* v_scale_, int64_t n_)
      : p(p_), g(g_), m(m_), v(v_), m_scale(m_scale_), v_scale(v_scale_), n(n_) {
    // A row length that is not a multiple of 16 bytes moves later rows off the
    // vector path, block by block.
    aligned = aligned16(p) && aligned16(g) && aligned8(m) && aligned8(v);
  }

  FK_HOST_DEVICE void load_pg(const Fragment& f, float (&fp)[kIlp], float (&fg)[kIlp]) const {
    load(p, f, fp);
    load(g, f, fg);
  }
  FK_HOST_DEVICE void store_p(const Fragment& f, const float (&fp)[kIlp]) const { store(p, f, fp); }
};

// Where block b of a moment matrix of `cols` columns starts: its first element
// (row-major), and its length.
struct BlockPlace {
  int64_t first;
  int64_t n;
};

FK_HOST_DEVICE BlockPlace block_place(int64_t cols, int64_t b) {
  const int64_t per_row = (cols + kMomentBlock - 1) / kMomentBlock;
  const int64_t row = b / per_row;
  const int64_t c0 = (b - row * per_row) * kMomentBlock;
  return BlockPlace{row * cols + c0, cols - c0 < kMomentBlock ? cols - c0 : kMomentBlock};
}

FK_HOST_DEVICE uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Dequantize, update, write p; keep m and v^(1/4) and their lane maxima. Every
// lane reads the scales before any lane writes them (a later phase).
template <typename Block>
FK_HOST_DEVICE void moments8_update(const Block& mb, const AdamWScalars& s, Int8WarpShared& sh,
                                    int lane, Int8Lane& regs) {
  const Fragment f = fragment(0, mb.n, mb.aligned, lane, kWarp);
  float fp[kIlp] = {}, fg[kIlp] = {};
  int8_t cm[kIlp] = {};
  uint8_t cv[kIlp] = {};
  mb.load_pg(f, fp, fg);
  load_codes(mb.m, f, cm);
  load_codes(mb.v, f, cv);
  const float ms = *mb.m_scale, vs = *mb.v_scale;
  uint32_t m_bits = 0, w_bits = 0;
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) {
      float mj = first_moment(cm[j], ms);
      float vj = second_moment(cv[j], vs);
      float root_v;
      fp[j] = adamw_update(fp[j], fg[j], mj, vj, s, root_v);
      regs.m[j] = mj;
      regs.w[j] = sqrtf(root_v);
      m_bits = max_bits(m_bits, float_bits(fabsf(mj)));
      w_bits = max_bits(w_bits, float_bits(fabsf(regs.w[j])));
    }
  }
  mb.store_p(f, fp);
  sh.m_bits[lane] = m_bits;
  sh.w_bits[lane] = w_bits;
}

// The block's scales from its maxima (in lane 0's slots), and the codes of the
// lane's elements; lane 0 writes the scales.
template <typename Block>
FK_HOST_DEVICE void moments8_quantize(const Block& mb, const Int8WarpShared& sh, int lane,
                                      const Int8Lane& regs) {
  const Fragment f = fragment(0, mb.n, mb.aligned, lane, kWarp);
  const float ms = bits_float(sh.m_bits[0]) / 127.f, vs = bits_float(sh.w_bits[0]) / 255.f;
  const float m_inv = 1.f / ms, v_inv = 1.f / vs;
  int8_t cm[kIlp] = {};
  uint8_t cv[kIlp] = {};
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) {
      cm[j] = int8_t(moment_code(regs.m[j], ms, m_inv, -127.f, 127.f));
      cv[j] = uint8_t(moment_code(regs.w[j], vs, v_inv, 0.f, 255.f));
    }
  }
  store_codes(mb.m, f, cm);
  store_codes(mb.v, f, cv);
  if (lane == 0) {
    *mb.m_scale = ms;
    *mb.v_scale = vs;
  }
}

// The program of warp `warp` of a thread block that owns the moment blocks
// [begin, end) of one tensor: every kMoments8Warps-th block from begin + warp,
// at(b) giving block b. run(phase) calls phase(lane, regs) for the 32 lanes of
// the warp, each with its own Int8Lane, and returns once all have (on the GPU:
// the call, then __syncwarp).
template <typename At, typename Run>
FK_HOST_DEVICE void moments8_warp(Int8WarpShared& sh, int64_t begin, int64_t end, int warp,
                                  const AdamWScalars& s, At&& at, Run&& run) {
  for (int64_t b = begin + warp; b < end; b += kMoments8Warps) {
    const auto mb = at(b);
    run([&](int lane, Int8Lane& regs) { moments8_update(mb, s, sh, lane, regs); });
    for (int width = kWarp / 2; width > 0; width /= 2) {
      run([&](int lane, Int8Lane&) {
        if (lane < width) {
          sh.m_bits[lane] = max_bits(sh.m_bits[lane], sh.m_bits[lane + width]);
          sh.w_bits[lane] = max_bits(sh.w_bits[lane], sh.w_bits[lane + width]);
        }
      });
    }
    run([&](int lane, Int8Lane& regs) { moments8_quantize(mb, sh, lane, regs); });
  }
}

// adamw_int8_: the blocks of every tensor, row by row.
template <typename T>
struct AdamWInt8Warp {
  T* p;
  const T* g;
  int8_t* m;
  float* m_scales;
  uint8_t* v;
  float* v_scales;
  int64_t cols;
  int64_t begin;  // the thread block's moment blocks in its tensor
  int64_t end;
  int warp;
  bool skip;
  AdamWScalars s;

  FK_HOST_DEVICE AdamWInt8Warp(const AdamWInt8Meta& meta, const AdamWArgs& args, int block,
                               int warp_)
      : warp(warp_) {
    const BlockRange r = meta.range(block, kAdamWInt8Chunk);
    p = static_cast<T*>(meta.params[r.slot]);
    g = static_cast<const T*>(meta.grads[r.slot]);
    m = meta.exp_avgs[r.slot];
    m_scales = meta.exp_avg_scales[r.slot];
    v = meta.exp_avg_sqs[r.slot];
    v_scales = meta.exp_avg_sq_scales[r.slot];
    cols = meta.cols[r.slot];
    begin = r.begin;
    end = r.end;
    skip = skipped(args.device);
    s = resolve(args);
  }

  template <typename Run>
  FK_HOST_DEVICE void run_phases(Int8WarpShared& sh, Run&& run) const {
    if (skip) return;
    moments8_warp(sh, begin, end, warp, s, [&](int64_t b) {
      const BlockPlace at = block_place(cols, b);
      return MomentBlock8<T>(p + at.first, g + at.first, m + at.first, v + at.first,
                             m_scales + b, v_scales + b, at.n);
    }, run);
  }
};

// The planner's units of each tensor: its moment blocks.
inline std::vector<int64_t> moment_blocks(const Moments8Batch& q, int64_t count) {
  std::vector<int64_t> blocks(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    blocks[size_t(i)] = q.rows[i] * ((q.cols[i] + kMomentBlock - 1) / kMomentBlock);
  }
  return blocks;
}

// Host: plans the launches of one call; launch(meta, num_blocks). `blocks` is
// moment_blocks(q, t.count).
template <typename Launch>
int64_t plan_adamw_int8(const TensorBatch& t, const Moments8Batch& q, const int64_t* blocks,
                        Launch&& launch) {
  return plan_launches<AdamWInt8Meta>(
      t.count, blocks, kAdamWInt8Chunk,
      [&](AdamWInt8Meta& meta, int slot, int64_t i) {
        meta.params[slot] = t.params[i];
        meta.grads[slot] = t.grads[i];
        meta.exp_avgs[slot] = q.exp_avgs[i];
        meta.exp_avg_scales[slot] = q.exp_avg_scales[i];
        meta.exp_avg_sqs[slot] = q.exp_avg_sqs[i];
        meta.exp_avg_sq_scales[slot] = q.exp_avg_sq_scales[i];
        meta.cols[slot] = q.cols[i];
      },
      launch);
}

}  // namespace cuda
}  // namespace frugal
