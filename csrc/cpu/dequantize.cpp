// dequantize on the CPU: packed INT-n codes to a float matrix W = s * q.
//
// The forward and backward passes of nn.QuantLinear call this on blocks of
// rows small enough to stay in cache, then run the GEMM on the block, so the
// whole float weight never exists at once. Rows go to threads in runs; the
// widths that pack whole fields into a byte (2, 4, 8 bits) are read a byte at
// a time, which the compiler vectorises, and 3 bits through the fields of
// quant_fields.h.
#include <algorithm>
#include <vector>

#include "frugal/quant.h"
#include "kernels.h"
#include "parallel.h"
#include "quant_fields.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// The n codes of one row, 8 / Bits fields in each byte, as fp32: s * q with
// q = field - qmax, the spec's product (not s * field - s * qmax, which rounds
// differently).
template <int Bits>
inline void dequantize_bytes(const uint8_t* __restrict__ bytes, int64_t n, float scale, int qmax,
                             float* __restrict__ w) {
  constexpr int per_byte = 8 / Bits;
  constexpr unsigned mask = (1u << Bits) - 1;
  const int64_t whole = n / per_byte;
  for (int64_t j = 0; j < whole; ++j) {
    const unsigned b = bytes[j];
    for (int f = 0; f < per_byte; ++f) {
      w[j * per_byte + f] = scale * float(int((b >> (f * Bits)) & mask) - qmax);
    }
  }
  for (int64_t c = whole * per_byte; c < n; ++c) {
    const unsigned b = bytes[c / per_byte];
    w[c] = scale * float(int((b >> ((c % per_byte) * Bits)) & mask) - qmax);
  }
}

inline void dequantize_row(const uint8_t* bytes, int bits, int64_t cols, float scale, float* w) {
  const int qmax = quant_qmax(bits);
  switch (bits) {
    case 2: dequantize_bytes<2>(bytes, cols, scale, qmax, w); return;
    case 4: dequantize_bytes<4>(bytes, cols, scale, qmax, w); return;
    case 8: dequantize_bytes<8>(bytes, cols, scale, qmax, w); return;
    default: break;
  }
  alignas(64) uint8_t fields[kFieldRoom];
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const int64_t n = std::min(kBlock, cols - c0);
    unpack_fields(bytes + c0 * bits / 8, bits, n, fields);
    dequantize_fields(fields, n, qmax, scale, w + c0);
  }
}

template <typename T>
void run(const uint8_t* codes, const float* scales, int64_t scale_count, int64_t rows,
         int64_t cols, int bits, T* out, int num_threads) {
  const int64_t row_bytes = quant_packed_cols(cols, bits);
  const int64_t per_run = std::max<int64_t>(1, kChunk / std::max<int64_t>(cols, 1));
  const int64_t runs = (rows + per_run - 1) / per_run;
  const int threads = rows * cols < kMinParallelElements ? 1 : std::max(1, num_threads);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (int64_t j = 0; j < runs; ++j) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : size_t(cols));
    for (int64_t r = j * per_run; r < std::min(rows, (j + 1) * per_run); ++r) {
      const float scale = scales[scale_count == 1 ? 0 : r];
      T* dst = out + r * cols;
      if constexpr (std::is_same_v<T, float>) {
        dequantize_row(codes + r * row_bytes, bits, cols, scale, dst);
      } else {
        dequantize_row(codes + r * row_bytes, bits, cols, scale, buffer.data());
        for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(buffer[c]);
      }
    }
  }
  (void)threads;
}

}  // namespace

void dequantize(const uint8_t* codes, const float* scales, int64_t scale_count, int64_t rows,
                int64_t cols, int bits, void* out, DType dtype, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    run<T>(codes, scales, scale_count, rows, cols, bits, static_cast<T*>(out), num_threads);
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
