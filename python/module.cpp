// frugal_kernels._C: the thin binding. Tensors arrive as raw addresses and
// sizes, already validated by frugal_kernels.ops; this file only converts
// Python values into the kernels' argument structs and releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../csrc/cpu/kernels.h"
#include "../csrc/cuda/kernels.h"

namespace py = pybind11;
using namespace frugal;

namespace {

using Addresses = std::vector<uintptr_t>;
using Sizes = std::vector<int64_t>;

// Owns the pointer arrays a TensorBatch / SubsetBatch point into.
struct Batch {
  std::vector<void*> params;
  std::vector<const void*> grads;
  std::vector<float*> exp_avgs;
  std::vector<float*> exp_avg_sqs;
  Sizes numel;

  Batch(const Addresses& p, const Addresses& g, const Addresses& m, const Addresses& v, Sizes n)
      : numel(std::move(n)) {
    for (uintptr_t a : p) params.push_back(reinterpret_cast<void*>(a));
    for (uintptr_t a : g) grads.push_back(reinterpret_cast<const void*>(a));
    for (uintptr_t a : m) exp_avgs.push_back(reinterpret_cast<float*>(a));
    for (uintptr_t a : v) exp_avg_sqs.push_back(reinterpret_cast<float*>(a));
  }

  cpu::TensorBatch view() const {
    return cpu::TensorBatch{int64_t(numel.size()), params.data(), grads.data(),
                            exp_avgs.data(), exp_avg_sqs.data(), numel.data()};
  }
};

struct Subsets {
  std::vector<const void*> indices;
  Sizes rows, cols, k;
  SubsetKind kind;
  bool int32;

  Subsets(const Addresses& idx, Sizes r, Sizes c, Sizes kk, int kind_code, bool index_is_int32)
      : rows(std::move(r)), cols(std::move(c)), k(std::move(kk)),
        kind(SubsetKind(kind_code)), int32(index_is_int32) {
    for (uintptr_t a : idx) indices.push_back(reinterpret_cast<const void*>(a));
  }

  cpu::SubsetBatch view() const {
    return cpu::SubsetBatch{kind, int32, indices.data(), rows.data(), cols.data(), k.data()};
  }
};

AdamWHyper hyper(double lr, double beta1, double beta2, double eps, double wd, double step,
                 bool maximize) {
  return AdamWHyper{lr, beta1, beta2, eps, wd, step, maximize};
}

cuda::DeviceScalars device_scalars(uintptr_t lr_ptr, uintptr_t step_ptr) {
  return cuda::DeviceScalars{reinterpret_cast<const float*>(lr_ptr),
                             reinterpret_cast<const float*>(step_ptr)};
}

py::dict build_info() {
  py::dict d;
  int n = 0;
  const char* const* names = cpu::isa_levels_built(&n);
  py::list levels;
  for (int i = 0; i < n; ++i) levels.append(names[i]);
  d["cpu_isa_levels"] = levels;
  d["openmp"] = cpu::openmp_enabled();
#ifdef FK_WITH_CUDA
  d["cuda"] = true;
  d["nvcc_version"] = std::string(cuda::nvcc_version());
  d["cuda_archs"] = std::string(cuda::archs());
#else
  d["cuda"] = false;
  d["nvcc_version"] = py::none();
  d["cuda_archs"] = py::none();
#endif
  d["compiler"] = std::string(FK_COMPILER_ID);
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "frugal_kernels compiled kernels (raw-pointer binding; use frugal_kernels.ops)";

  m.def("build_info", &build_info);
  m.def("cpu_isa_active", [] { return std::string(cpu::isa_level_active()); });
  m.def("cpu_select_isa", [](const std::string& name) { return cpu::select_isa_level(name.c_str()); });

  m.def("adamw_cpu",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, int dtype, double lr, double beta1, double beta2, double eps, double wd,
           double step, bool maximize, int num_threads) {
          const Batch b(p, g, em, ev, std::move(numel));
          py::gil_scoped_release nogil;
          cpu::adamw(b.view(), DType(dtype), hyper(lr, beta1, beta2, eps, wd, step, maximize),
                     num_threads);
        });

  m.def("sign_sgd_cpu",
        [](const Addresses& p, const Addresses& g, Sizes numel, int dtype, double lr, double wd,
           double scale, int num_threads) {
          const Batch b(p, g, {}, {}, std::move(numel));
          py::gil_scoped_release nogil;
          cpu::sign_sgd(b.view(), DType(dtype), lr, wd, scale, num_threads);
        });

  m.def("frugal_step_cpu",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, const Addresses& idx, Sizes rows, Sizes cols, Sizes k, int kind,
           bool index_is_int32, int dtype, double lr, double beta1, double beta2, double eps,
           double wd, double step, double state_free_scale, int mode, int num_threads) {
          const Batch b(p, g, em, ev, std::move(numel));
          const Subsets s(idx, std::move(rows), std::move(cols), std::move(k), kind, index_is_int32);
          py::gil_scoped_release nogil;
          cpu::frugal_step(b.view(), s.view(), DType(dtype),
                           hyper(lr, beta1, beta2, eps, wd, step, false), state_free_scale,
                           StateFree(mode), num_threads);
        });

  m.def("lowrank_step_cpu",
        [](const Addresses& p, const Addresses& g, const Addresses& up_updates,
           const Addresses& up_grads, Sizes numel, int dtype, double lr, double wd, double scale,
           int mode, int num_threads) {
          const Batch b(p, g, {}, {}, std::move(numel));
          std::vector<const float*> uu, ug;
          for (uintptr_t a : up_updates) uu.push_back(reinterpret_cast<const float*>(a));
          for (uintptr_t a : up_grads) ug.push_back(reinterpret_cast<const float*>(a));
          py::gil_scoped_release nogil;
          cpu::lowrank_step(b.view(), uu.data(), ug.data(), DType(dtype), lr, wd, scale,
                            StateFree(mode), num_threads);
        });

  // The CUDA kernels emulated on the host, for tests: the arguments of the
  // *_cuda functions without the stream; lr_ptr / step_ptr are host
  // addresses of float32 values (0: use lr / step). Each returns the number
  // of launches made.
  m.def("adamw_cuda_emulated",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, int dtype, double lr, double beta1, double beta2, double eps, double wd,
           double step, bool maximize, uintptr_t lr_ptr, uintptr_t step_ptr) {
          const Batch b(p, g, em, ev, std::move(numel));
          py::gil_scoped_release nogil;
          return cuda_emulated::adamw(b.view(), DType(dtype),
                                      hyper(lr, beta1, beta2, eps, wd, step, maximize),
                                      device_scalars(lr_ptr, step_ptr));
        });

  m.def("sign_sgd_cuda_emulated",
        [](const Addresses& p, const Addresses& g, Sizes numel, int dtype, double lr, double wd,
           double scale, uintptr_t lr_ptr) {
          const Batch b(p, g, {}, {}, std::move(numel));
          py::gil_scoped_release nogil;
          return cuda_emulated::sign_sgd(b.view(), DType(dtype), lr, wd, scale,
                                         device_scalars(lr_ptr, 0));
        });

  m.def("frugal_step_cuda_emulated",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, const Addresses& idx, Sizes rows, Sizes cols, Sizes k, int kind,
           bool index_is_int32, int dtype, double lr, double beta1, double beta2, double eps,
           double wd, double step, double state_free_scale, int mode, uintptr_t lr_ptr,
           uintptr_t step_ptr) {
          const Batch b(p, g, em, ev, std::move(numel));
          const Subsets s(idx, std::move(rows), std::move(cols), std::move(k), kind, index_is_int32);
          py::gil_scoped_release nogil;
          return cuda_emulated::frugal_step(b.view(), s.view(), DType(dtype),
                                            hyper(lr, beta1, beta2, eps, wd, step, false),
                                            state_free_scale, StateFree(mode),
                                            device_scalars(lr_ptr, step_ptr));
        });

#ifdef FK_WITH_CUDA
  m.def("adamw_cuda",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, int dtype, double lr, double beta1, double beta2, double eps, double wd,
           double step, bool maximize, uintptr_t lr_ptr, uintptr_t step_ptr, uintptr_t stream) {
          const Batch b(p, g, em, ev, std::move(numel));
          py::gil_scoped_release nogil;
          cuda::adamw(b.view(), DType(dtype), hyper(lr, beta1, beta2, eps, wd, step, maximize),
                      device_scalars(lr_ptr, step_ptr), stream);
        });

  m.def("sign_sgd_cuda",
        [](const Addresses& p, const Addresses& g, Sizes numel, int dtype, double lr, double wd,
           double scale, uintptr_t lr_ptr, uintptr_t stream) {
          const Batch b(p, g, {}, {}, std::move(numel));
          py::gil_scoped_release nogil;
          cuda::sign_sgd(b.view(), DType(dtype), lr, wd, scale, device_scalars(lr_ptr, 0), stream);
        });

  m.def("frugal_step_cuda",
        [](const Addresses& p, const Addresses& g, const Addresses& em, const Addresses& ev,
           Sizes numel, const Addresses& idx, Sizes rows, Sizes cols, Sizes k, int kind,
           bool index_is_int32, int dtype, double lr, double beta1, double beta2, double eps,
           double wd, double step, double state_free_scale, int mode, uintptr_t lr_ptr,
           uintptr_t step_ptr, uintptr_t stream) {
          const Batch b(p, g, em, ev, std::move(numel));
          const Subsets s(idx, std::move(rows), std::move(cols), std::move(k), kind, index_is_int32);
          py::gil_scoped_release nogil;
          cuda::frugal_step(b.view(), s.view(), DType(dtype),
                            hyper(lr, beta1, beta2, eps, wd, step, false), state_free_scale,
                            StateFree(mode), device_scalars(lr_ptr, step_ptr), stream);
        });
#endif
}
