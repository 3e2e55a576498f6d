// The launch planner of the multi-tensor CUDA kernels, shared by the real
// launches (*.cu) and their emulation (emulate.cpp). Host C++ only.
//
// One call of an op updates a list of tensors. Each tensor is cut into chunks
// of a fixed number of elements and each chunk is one thread block. A launch
// carries everything its blocks need in one struct passed by value as the
// kernel parameter (no device allocation, no host-to-device copy): a table of
// the tensors it touches and, per block, which tensor and which chunk of it.
// The struct has room for kMaxTensors tensors and kMaxBlocks blocks; the
// planner launches whenever either is full, so many small tensors share a few
// launches and a tensor of more than kMaxBlocks chunks spans several.
#pragma once

#include <cstddef>
#include <cstdint>

#include "frugal/common.h"

namespace frugal {
namespace cuda {

// CUDA's limit on the bytes of a kernel's parameters before 12.1; newer
// toolkits raise it only with newer drivers, so the structs stay under it.
constexpr size_t kMaxParamBytes = 4096;

// The elements [begin, end) of the tensor in table slot `slot` that a block owns.
struct BlockRange {
  int slot;
  int64_t begin;
  int64_t end;
};

// The part of a launch's parameter that the planner fills; each op's struct
// derives from it and adds its per-tensor pointers (filled by the op).
template <int MaxTensors, int MaxBlocks>
struct LaunchMap {
  static constexpr int kMaxTensors = MaxTensors;
  static constexpr int kMaxBlocks = MaxBlocks;
  static_assert(MaxTensors <= 256, "block_tensor holds a tensor slot in one byte");

  int64_t numel[MaxTensors];
  uint8_t block_tensor[MaxBlocks];  // slot in the tensor table
  int32_t block_chunk[MaxBlocks];   // chunk of that tensor

  FK_HOST_DEVICE BlockRange range(int block, int64_t chunk) const {
    const int slot = block_tensor[block];
    const int64_t begin = int64_t(block_chunk[block]) * chunk;
    const int64_t end = begin + chunk < numel[slot] ? begin + chunk : numel[slot];
    return BlockRange{slot, begin, end};
  }
};

// Packs the chunks of tensors [0, count) (numel[i] elements each; empty ones
// are skipped) into launches. fill(meta, slot, i) stores tensor i's pointers
// in table slot `slot`; launch(meta, num_blocks) runs one launch. A tensor
// cut by a full block table is entered again, in slot 0, for the next launch.
// Returns the number of launches.
template <typename Meta, typename Fill, typename Launch>
int64_t plan_launches(int64_t count, const int64_t* numel, int64_t chunk, Fill&& fill,
                      Launch&& launch) {
  Meta meta{};
  int tensors = 0;
  int blocks = 0;
  int64_t launches = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (numel[i] == 0) continue;
    const int64_t chunks = (numel[i] + chunk - 1) / chunk;
    int slot = tensors++;
    meta.numel[slot] = numel[i];
    fill(meta, slot, i);
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[blocks] = uint8_t(slot);
      meta.block_chunk[blocks] = int32_t(c);
      ++blocks;
      const bool last_chunk = c + 1 == chunks;
      if (blocks == Meta::kMaxBlocks || (last_chunk && tensors == Meta::kMaxTensors)) {
        launch(meta, blocks);
        ++launches;
        blocks = 0;
        tensors = 0;
        if (!last_chunk) {
          slot = tensors++;
          meta.numel[slot] = numel[i];
          fill(meta, slot, i);
        }
      }
    }
  }
  if (blocks > 0) {
    launch(meta, blocks);
    ++launches;
  }
  return launches;
}

}  // namespace cuda
}  // namespace frugal
