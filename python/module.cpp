// frugal_kernels._C: the thin binding. Tensors arrive as raw addresses and
// sizes, already validated by frugal_kernels.ops; this file only converts
// Python values into the kernels' argument structs and releases the GIL.
//
// Every entry point takes the same three things: the tensors (a TensorBatch,
// with a SubsetBatch or the back-projections where the op has them), the op's
// hyper-parameter struct, and the backend's own scalars (the CPU's thread
// count; the CUDA kernels' DeviceScalars and stream). A hyper-parameter is
// named once here, where its struct is bound; frugal_kernels.ops builds the
// struct from its record of the same name.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../csrc/cpu/kernels.h"
#include "../csrc/cuda/kernels.h"

namespace py = pybind11;
using namespace frugal;

namespace {

using Addresses = std::vector<uintptr_t>;
using Sizes = std::vector<int64_t>;

template <typename P>
std::vector<P> as_pointers(const Addresses& addresses) {
  std::vector<P> out;
  out.reserve(addresses.size());
  for (uintptr_t a : addresses) out.push_back(reinterpret_cast<P>(a));
  return out;
}

void check_count(const std::string& what, size_t got, size_t want) {
  if (got != want) {
    throw py::value_error(what + ": " + std::to_string(got) + " entries for " +
                          std::to_string(want) + " tensors");
  }
}

// The field a path of member pointers leads to: member(h, &FrugalHyper::adamw,
// &AdamWHyper::lr) is h.adamw.lr.
template <typename T, typename M>
auto& member(T& t, M m) {
  return t.*m;
}
template <typename T, typename M, typename... Ms>
auto& member(T& t, M m, Ms... ms) {
  return member(t.*m, ms...);
}

// The codes an enum of the kernels has (csrc/include/frugal).
bool valid_code(StateFree, int code) { return code >= 0 && code <= int(StateFree::kNone); }
bool valid_code(SubsetKind, int code) { return code >= 0 && code <= int(SubsetKind::kColumns); }

// A plain struct as a Python class built from keywords only, every field
// required, read-only afterwards: a missing, unknown or mistyped
// hyper-parameter is a TypeError, never a silent zero. Enums travel as their
// int codes (frugal_kernels._layout holds the Python side of each code).
template <typename T>
class Record {
 public:
  Record(py::module_& m, const char* name)
      : cls_(m, name), fields_(std::make_shared<std::vector<Field>>()) {
    // The constructor and repr read fields_ when called, so they see every
    // field declared after this.
    const auto fields = fields_;
    const std::string type = name;
    cls_.def(py::init([fields, type](const py::kwargs& kw) {
      T value{};
      for (const Field& f : *fields) {
        if (!kw.contains(f.name)) {
          throw py::type_error(type + "() is missing the keyword argument '" + f.name + "'");
        }
        try {
          f.set(value, kw[f.name.c_str()]);
        } catch (const py::cast_error&) {
          throw py::type_error(type + "(): " + f.name + " cannot be " +
                               std::string(py::repr(kw[f.name.c_str()])));
        }
      }
      for (const auto& item : kw) {
        const std::string key = py::str(item.first);
        bool known = false;
        for (const Field& f : *fields) known = known || f.name == key;
        if (!known) throw py::type_error(type + "() got an unexpected keyword argument '" + key + "'");
      }
      return value;
    }));
    cls_.def("__repr__", [fields, type](const T& value) {
      std::string out = type + "(";
      for (size_t i = 0; i < fields->size(); ++i) {
        const Field& f = (*fields)[i];
        out += (i ? ", " : "") + f.name + "=" + std::string(py::repr(f.get(value)));
      }
      return out + ")";
    });
  }

  template <typename... Path>
  Record& field(const char* name, Path... path) {
    using D = std::decay_t<decltype(member(std::declval<T&>(), path...))>;
    Field f{name,
            [=](T& t, py::handle v) {
              if constexpr (std::is_enum_v<D>) {
                const int code = v.cast<int>();
                if (!valid_code(D{}, code)) throw py::cast_error();
                member(t, path...) = D(code);
              } else {
                member(t, path...) = v.cast<D>();
              }
            },
            [=](const T& t) -> py::object {
              if constexpr (std::is_enum_v<D>) {
                return py::int_(int(member(t, path...)));
              } else {
                return py::cast(member(t, path...));
              }
            }};
    cls_.def_property_readonly(name, f.get);
    fields_->push_back(std::move(f));
    return *this;
  }

 private:
  struct Field {
    std::string name;
    std::function<void(T&, py::handle)> set;
    std::function<py::object(const T&)> get;
  };

  py::class_<T> cls_;
  std::shared_ptr<std::vector<Field>> fields_;
};

// AdamW's hyper-parameters but maximize, reached through `path` (none for
// AdamWHyper itself): frugal_step_ shares them.
template <typename T, typename... Path>
Record<T>& adamw_fields(Record<T>& r, Path... path) {
  return r.field("lr", path..., &AdamWHyper::lr)
      .field("beta1", path..., &AdamWHyper::beta1)
      .field("beta2", path..., &AdamWHyper::beta2)
      .field("eps", path..., &AdamWHyper::eps)
      .field("weight_decay", path..., &AdamWHyper::weight_decay)
      .field("step", path..., &AdamWHyper::step)
      .field("grad_scale", path..., &AdamWHyper::grad_scale)
      .field("found_inf", path..., &AdamWHyper::found_inf);
}

// The tensors of one call: same-dtype tensors by address and size. Owns the
// pointer arrays the kernels' TensorBatch points into.
struct Batch {
  DType dtype;
  Sizes numel;
  std::vector<void*> params;
  std::vector<const void*> grads;
  std::vector<float*> exp_avgs;
  std::vector<float*> exp_avg_sqs;

  Batch(int dtype_code, Sizes n, const Addresses& p, const Addresses& g, const Addresses& m,
        const Addresses& v)
      : dtype(DType(dtype_code)), numel(std::move(n)), params(as_pointers<void*>(p)),
        grads(as_pointers<const void*>(g)), exp_avgs(as_pointers<float*>(m)),
        exp_avg_sqs(as_pointers<float*>(v)) {
    if (dtype_code < 0 || dtype_code > int(DType::kFloat16)) {
      throw py::value_error("TensorBatch: unknown dtype code " + std::to_string(dtype_code));
    }
    check_count("TensorBatch params", params.size(), numel.size());
    check_count("TensorBatch grads", grads.size(), numel.size());
    // sgd_'s momentum buffers travel as exp_avgs alone; AdamW's moments come in pairs.
    if (!exp_avgs.empty()) check_count("TensorBatch exp_avgs", exp_avgs.size(), numel.size());
    if (!exp_avg_sqs.empty()) {
      check_count("TensorBatch exp_avg_sqs", exp_avg_sqs.size(), numel.size());
    }
  }

  TensorBatch view() const {
    return TensorBatch{int64_t(numel.size()), params.data(), grads.data(),
                            exp_avgs.data(), exp_avg_sqs.data(), numel.data()};
  }

  // The view for an op that updates the moments, which must then be given
  // (empty lists would hand the kernel null pointers).
  TensorBatch view_with_moments() const {
    check_count("TensorBatch exp_avgs", exp_avgs.size(), numel.size());
    check_count("TensorBatch exp_avg_sqs", exp_avg_sqs.size(), numel.size());
    return view();
  }
};

// The state-full subsets of a frugal_step_ call, one per tensor of its batch.
struct Subsets {
  SubsetKind kind;
  bool index_is_int32;
  std::vector<const void*> indices;
  Sizes rows, cols, k;

  Subsets(int kind_code, bool int32, const Addresses& idx, Sizes r, Sizes c, Sizes kk)
      : kind(SubsetKind(kind_code)), index_is_int32(int32),
        indices(as_pointers<const void*>(idx)), rows(std::move(r)), cols(std::move(c)),
        k(std::move(kk)) {
    if (!valid_code(kind, kind_code)) {
      throw py::value_error("SubsetBatch: unknown subset kind code " + std::to_string(kind_code));
    }
    check_count("SubsetBatch rows", rows.size(), indices.size());
    check_count("SubsetBatch cols", cols.size(), indices.size());
    check_count("SubsetBatch k", k.size(), indices.size());
  }

  SubsetBatch view(const Batch& b) const {
    check_count("SubsetBatch indices", indices.size(), b.numel.size());
    return SubsetBatch{kind, index_is_int32, indices.data(), rows.data(), cols.data(),
                            k.data()};
  }
};

// The projections of a lowrank_adamw_step_ call, one per tensor of its batch.
struct Projections {
  std::vector<const float*> projections;
  Sizes rows, cols, rank, sides;

  Projections(const Addresses& proj, Sizes r, Sizes c, Sizes k, Sizes sd)
      : projections(as_pointers<const float*>(proj)), rows(std::move(r)), cols(std::move(c)),
        rank(std::move(k)), sides(std::move(sd)) {
    check_count("LowrankBatch rows", rows.size(), projections.size());
    check_count("LowrankBatch cols", cols.size(), projections.size());
    check_count("LowrankBatch rank", rank.size(), projections.size());
    check_count("LowrankBatch sides", sides.size(), projections.size());
    for (int64_t side : sides) {
      if (side != 0 && side != 1) throw py::value_error("LowrankBatch: a side is 0 or 1");
    }
  }

  LowrankBatch view(const Batch& b) const {
    check_count("LowrankBatch projections", projections.size(), b.numel.size());
    return LowrankBatch{projections.data(), rows.data(), cols.data(), rank.data(),
                             sides.data()};
  }
};

// The quantization of the weights of a dqt_update_ call, one entry per tensor.
struct Quant {
  std::vector<const float*> scales;
  Sizes scale_count, rows, cols;
  std::vector<uint32_t> seeds;

  Quant(const Addresses& sc, Sizes count, Sizes r, Sizes c, const std::vector<uint32_t>& sd)
      : scales(as_pointers<const float*>(sc)), scale_count(std::move(count)), rows(std::move(r)),
        cols(std::move(c)), seeds(sd) {
    check_count("QuantBatch scale_count", scale_count.size(), scales.size());
    check_count("QuantBatch rows", rows.size(), scales.size());
    check_count("QuantBatch cols", cols.size(), scales.size());
    check_count("QuantBatch seeds", seeds.size(), scales.size());
  }

  QuantBatch view(const Batch& b) const {
    check_count("QuantBatch scales", scales.size(), b.numel.size());
    return QuantBatch{scales.data(), scale_count.data(), rows.data(), cols.data(),
                           seeds.data()};
  }
};

// The 8-bit moments of an adamw_int8_ call, one entry per tensor: codes and block
// scales of each moment, and each tensor seen as [rows, cols].
struct Moments8 {
  std::vector<int8_t*> exp_avgs;
  std::vector<float*> exp_avg_scales;
  std::vector<uint8_t*> exp_avg_sqs;
  std::vector<float*> exp_avg_sq_scales;
  Sizes rows, cols;

  Moments8(const Addresses& m, const Addresses& ms, const Addresses& v, const Addresses& vs,
           Sizes r, Sizes c)
      : exp_avgs(as_pointers<int8_t*>(m)), exp_avg_scales(as_pointers<float*>(ms)),
        exp_avg_sqs(as_pointers<uint8_t*>(v)), exp_avg_sq_scales(as_pointers<float*>(vs)),
        rows(std::move(r)), cols(std::move(c)) {
    check_count("Moments8Batch exp_avg_scales", exp_avg_scales.size(), exp_avgs.size());
    check_count("Moments8Batch exp_avg_sqs", exp_avg_sqs.size(), exp_avgs.size());
    check_count("Moments8Batch exp_avg_sq_scales", exp_avg_sq_scales.size(), exp_avgs.size());
    check_count("Moments8Batch rows", rows.size(), exp_avgs.size());
    check_count("Moments8Batch cols", cols.size(), exp_avgs.size());
  }

  Moments8Batch view(const Batch& b) const {
    check_count("Moments8Batch exp_avgs", exp_avgs.size(), b.numel.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] * cols[i] != b.numel[i]) {
        throw py::value_error("Moments8Batch: rows * cols is not the tensor's size");
      }
    }
    return batch();
  }

  // The moments of a frugal_step_int8_ call: each holds the coordinates of its
  // tensor's subset (k rows or k columns of the tensor's [R, C] matrix).
  Moments8Batch view(const Batch& b, const Subsets& s) const {
    check_count("Moments8Batch exp_avgs", exp_avgs.size(), b.numel.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t size = s.kind == SubsetKind::kRows ? s.k[i] * s.cols[i] : s.rows[i] * s.k[i];
      if (rows[i] * cols[i] != size) {
        throw py::value_error("Moments8Batch: rows * cols is not the size of the subset's state");
      }
    }
    return batch();
  }

 private:
  Moments8Batch batch() const {
    return Moments8Batch{exp_avgs.data(), exp_avg_scales.data(), exp_avg_sqs.data(),
                         exp_avg_sq_scales.data(), rows.data(), cols.data()};
  }
};

py::dict as_dict(const cuda::LaunchLimits& l) {
  py::dict d;
  d["threads"] = l.threads;
  d["chunk"] = l.chunk;
  if (l.tile != 0) d["tile"] = l.tile;
  d["max_tensors"] = l.max_tensors;
  d["max_blocks"] = l.max_blocks;
  return d;
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
  m.def("cuda_limits", [] {
    py::dict d;
    d["adamw"] = as_dict(cuda::adamw_limits());
    d["adamw_int8"] = as_dict(cuda::adamw_int8_limits());
    d["sign_sgd"] = as_dict(cuda::sign_sgd_limits());
    d["frugal_step"] = as_dict(cuda::frugal_step_limits());
    d["frugal_step_int8"] = as_dict(cuda::frugal_step_int8_limits());
    d["dqt_update"] = as_dict(cuda::dqt_update_limits());
    d["grad_norm"] = as_dict(cuda::grad_norm_limits());
    return d;
  }, "The launch constants of the CUDA kernels (the emulated ones too, so in every build).");

  // ------------------------------------------------------------ arguments

  py::class_<Batch>(m, "TensorBatch")
      .def(py::init<int, Sizes, const Addresses&, const Addresses&, const Addresses&,
                    const Addresses&>(),
           py::kw_only(), py::arg("dtype"), py::arg("numel"), py::arg("params"), py::arg("grads"),
           py::arg("exp_avgs") = Addresses{}, py::arg("exp_avg_sqs") = Addresses{});
  py::class_<Subsets>(m, "SubsetBatch")
      .def(py::init<int, bool, const Addresses&, Sizes, Sizes, Sizes>(), py::kw_only(),
           py::arg("kind"), py::arg("index_is_int32"), py::arg("indices"), py::arg("rows"),
           py::arg("cols"), py::arg("k"));
  py::class_<Projections>(m, "LowrankBatch")
      .def(py::init<const Addresses&, Sizes, Sizes, Sizes, Sizes>(), py::kw_only(),
           py::arg("projections"), py::arg("rows"), py::arg("cols"), py::arg("rank"),
           py::arg("sides"));
  py::class_<Quant>(m, "QuantBatch")
      .def(py::init<const Addresses&, Sizes, Sizes, Sizes, const std::vector<uint32_t>&>(),
           py::kw_only(), py::arg("scales"), py::arg("scale_count"), py::arg("rows"),
           py::arg("cols"), py::arg("seeds"));
  py::class_<Moments8>(m, "Moments8Batch")
      .def(py::init<const Addresses&, const Addresses&, const Addresses&, const Addresses&, Sizes,
                    Sizes>(),
           py::kw_only(), py::arg("exp_avgs"), py::arg("exp_avg_scales"), py::arg("exp_avg_sqs"),
           py::arg("exp_avg_sq_scales"), py::arg("rows"), py::arg("cols"));
  // lr / step: addresses of float32 values the kernel reads (device memory
  // for the real kernels, host memory for the emulated ones); 0: use the
  // value in the hyper-parameter struct.
  py::class_<cuda::DeviceScalars>(m, "DeviceScalars")
      .def(py::init([](uintptr_t lr, uintptr_t step, uintptr_t grad_scale, uintptr_t found_inf) {
             return cuda::DeviceScalars{reinterpret_cast<const float*>(lr),
                                        reinterpret_cast<const float*>(step),
                                        reinterpret_cast<const float*>(grad_scale),
                                        reinterpret_cast<const float*>(found_inf)};
           }),
           py::kw_only(), py::arg("lr") = 0, py::arg("step") = 0, py::arg("grad_scale") = 0,
           py::arg("found_inf") = 0);

  Record<AdamWHyper> adamw_hyper(m, "AdamWHyper");
  adamw_fields(adamw_hyper).field("maximize", &AdamWHyper::maximize);
  Record<SignSgdHyper>(m, "SignSgdHyper")
      .field("lr", &SignSgdHyper::lr)
      .field("weight_decay", &SignSgdHyper::weight_decay)
      .field("scale", &SignSgdHyper::scale)
      .field("grad_scale", &SignSgdHyper::grad_scale)
      .field("found_inf", &SignSgdHyper::found_inf);
  Record<SgdHyper>(m, "SgdHyper")
      .field("lr", &SgdHyper::lr)
      .field("momentum", &SgdHyper::momentum)
      .field("dampening", &SgdHyper::dampening)
      .field("weight_decay", &SgdHyper::weight_decay)
      .field("nesterov", &SgdHyper::nesterov)
      .field("maximize", &SgdHyper::maximize)
      .field("first_step", &SgdHyper::first_step)
      .field("grad_scale", &SgdHyper::grad_scale)
      .field("found_inf", &SgdHyper::found_inf);
  Record<FrugalHyper> frugal_hyper(m, "FrugalHyper");
  adamw_fields(frugal_hyper, &FrugalHyper::adamw)
      .field("state_free", &FrugalHyper::state_free)
      .field("state_free_scale", &FrugalHyper::state_free_scale);
  Record<DqtHyper> dqt_hyper(m, "DqtHyper");
  adamw_fields(dqt_hyper, &DqtHyper::frugal, &FrugalHyper::adamw)
      .field("state_free", &DqtHyper::frugal, &FrugalHyper::state_free)
      .field("state_free_scale", &DqtHyper::frugal, &FrugalHyper::state_free_scale)
      .field("bits", &DqtHyper::bits)
      .field("rng_step", &DqtHyper::rng_step);
  Record<LowrankHyper>(m, "LowrankHyper")
      .field("lr", &LowrankHyper::lr)
      .field("weight_decay", &LowrankHyper::weight_decay)
      .field("state_free", &LowrankHyper::state_free)
      .field("state_free_scale", &LowrankHyper::state_free_scale)
      .field("grad_scale", &LowrankHyper::grad_scale)
      .field("found_inf", &LowrankHyper::found_inf);

  // ------------------------------------------------------------------ cpu

  m.def("adamw_cpu", [](const Batch& b, const AdamWHyper& h, int num_threads) {
    const TensorBatch t = b.view_with_moments();
    py::gil_scoped_release nogil;
    cpu::adamw(t, b.dtype, h, num_threads);
  });
  m.def("adamw_int8_cpu", [](const Batch& b, const Moments8& q, const AdamWHyper& h,
                             int num_threads) {
    const TensorBatch t = b.view();
    const Moments8Batch mq = q.view(b);
    py::gil_scoped_release nogil;
    cpu::adamw_int8(t, mq, b.dtype, h, num_threads);
  });
  m.def("sign_sgd_cpu", [](const Batch& b, const SignSgdHyper& h, int num_threads) {
    const TensorBatch t = b.view();
    py::gil_scoped_release nogil;
    cpu::sign_sgd(t, b.dtype, h, num_threads);
  });
  m.def("sgd_cpu", [](const Batch& b, const SgdHyper& h, int num_threads) {
    // The momentum buffers, in the exp_avgs slot, are needed only with momentum.
    if (h.momentum != 0.0) check_count("TensorBatch exp_avgs", b.exp_avgs.size(), b.numel.size());
    const TensorBatch t = b.view();
    py::gil_scoped_release nogil;
    cpu::sgd(t, b.dtype, h, num_threads);
  });
  m.def("frugal_step_cpu",
        [](const Batch& b, const Subsets& s, const FrugalHyper& h, int num_threads) {
          const TensorBatch t = b.view_with_moments();
          const SubsetBatch sub = s.view(b);
          py::gil_scoped_release nogil;
          cpu::frugal_step(t, sub, b.dtype, h, num_threads);
        });
  m.def("frugal_step_int8_cpu", [](const Batch& b, const Subsets& s, const Moments8& q,
                                   const FrugalHyper& h, int num_threads) {
    const TensorBatch t = b.view();
    const SubsetBatch sub = s.view(b);
    const Moments8Batch mq = q.view(b, s);
    py::gil_scoped_release nogil;
    cpu::frugal_step_int8(t, sub, mq, b.dtype, h, num_threads);
  });
  // up_updates / up_grads: the fp32 back-projections, one per tensor.
  m.def("lowrank_step_cpu", [](const Batch& b, const Addresses& up_updates,
                               const Addresses& up_grads, const LowrankHyper& h, int num_threads) {
    const TensorBatch t = b.view();
    check_count("lowrank_step_cpu up_updates", up_updates.size(), b.numel.size());
    check_count("lowrank_step_cpu up_grads", up_grads.size(), b.numel.size());
    const auto uu = as_pointers<const float*>(up_updates);
    const auto ug = as_pointers<const float*>(up_grads);
    py::gil_scoped_release nogil;
    cpu::lowrank_step(t, uu.data(), ug.data(), b.dtype, h, num_threads);
  });
  m.def("lowrank_adamw_step_cpu", [](const Batch& b, const Projections& l, const FrugalHyper& h,
                                     int num_threads) {
    const TensorBatch t = b.view_with_moments();
    const LowrankBatch lb = l.view(b);
    py::gil_scoped_release nogil;
    cpu::lowrank_adamw_step(t, lb, b.dtype, h, num_threads);
  });

  // The batch's params are the packed codes and its dtype the gradients'.
  m.def("dqt_update_cpu", [](const Batch& b, const Subsets& s, const Quant& q, const DqtHyper& h,
                             int num_threads) {
    const TensorBatch t = b.view_with_moments();
    const SubsetBatch sub = s.view(b);
    const QuantBatch quant = q.view(b);
    py::gil_scoped_release nogil;
    cpu::dqt_update(t, sub, quant, b.dtype, h, num_threads);
  });

  // One weight's packed codes to floats W = s * q; `out` holds rows * cols
  // values of dtype_code.
  // grads: addresses of gradients of one dtype; returns the sum of their squares, or the
  // largest magnitude with max_norm, in double (non-finite when an element is).
  m.def("grad_norm_cpu", [](const Addresses& grads, const Sizes& numel, int dtype_code,
                            bool max_norm, int num_threads) {
    check_count("grad_norm_cpu numel", numel.size(), grads.size());
    const auto g = as_pointers<const void*>(grads);
    py::gil_scoped_release nogil;
    return cpu::grad_norm(g.data(), numel.data(), int64_t(g.size()), DType(dtype_code), max_norm,
                          num_threads);
  }, py::arg("grads"), py::arg("numel"), py::arg("dtype"), py::arg("max_norm"),
     py::arg("num_threads"));
  m.def("dequantize_cpu", [](uintptr_t codes, uintptr_t scales, int64_t scale_count, int64_t rows,
                             int64_t cols, int bits, uintptr_t out, int dtype_code,
                             int num_threads) {
    py::gil_scoped_release nogil;
    cpu::dequantize(reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scales),
                    scale_count, rows, cols, bits, reinterpret_cast<void*>(out), DType(dtype_code),
                    num_threads);
  }, py::arg("codes"), py::arg("scales"), py::arg("scale_count"), py::arg("rows"),
     py::arg("cols"), py::arg("bits"), py::arg("out"), py::arg("dtype"),
     py::arg("num_threads"));

  // --------------------------------------------------------- cuda_emulated
  // The CUDA kernels run on the host, for tests: the arguments of the *_cuda
  // functions without the stream, DeviceScalars holding host addresses. Each
  // returns the number of launches made.

  m.def("adamw_cuda_emulated",
        [](const Batch& b, const AdamWHyper& h, const cuda::DeviceScalars& d) {
          const TensorBatch t = b.view_with_moments();
          py::gil_scoped_release nogil;
          return cuda_emulated::adamw(t, b.dtype, h, d);
        });
  m.def("adamw_int8_cuda_emulated", [](const Batch& b, const Moments8& q, const AdamWHyper& h,
                                        const cuda::DeviceScalars& d) {
    const TensorBatch t = b.view();
    const Moments8Batch mq = q.view(b);
    py::gil_scoped_release nogil;
    return cuda_emulated::adamw_int8(t, mq, b.dtype, h, d);
  });
  m.def("sign_sgd_cuda_emulated",
        [](const Batch& b, const SignSgdHyper& h, const cuda::DeviceScalars& d) {
          const TensorBatch t = b.view();
          py::gil_scoped_release nogil;
          return cuda_emulated::sign_sgd(t, b.dtype, h, d);
        });
  m.def("frugal_step_cuda_emulated",
        [](const Batch& b, const Subsets& s, const FrugalHyper& h, const cuda::DeviceScalars& d) {
          const TensorBatch t = b.view_with_moments();
          const SubsetBatch sub = s.view(b);
          py::gil_scoped_release nogil;
          return cuda_emulated::frugal_step(t, sub, b.dtype, h, d);
        });
  m.def("frugal_step_int8_cuda_emulated", [](const Batch& b, const Subsets& s, const Moments8& q,
                                              const FrugalHyper& h,
                                              const cuda::DeviceScalars& d) {
    const TensorBatch t = b.view();
    const SubsetBatch sub = s.view(b);
    const Moments8Batch mq = q.view(b, s);
    py::gil_scoped_release nogil;
    return cuda_emulated::frugal_step_int8(t, sub, mq, b.dtype, h, d);
  });
  m.def("dqt_update_cuda_emulated", [](const Batch& b, const Subsets& s, const Quant& q,
                                        const DqtHyper& h, const cuda::DeviceScalars& d) {
    const TensorBatch t = b.view_with_moments();
    const SubsetBatch sub = s.view(b);
    const QuantBatch quant = q.view(b);
    py::gil_scoped_release nogil;
    return cuda_emulated::dqt_update(t, sub, quant, b.dtype, h, d);
  });
  m.def("grad_norm_cuda_emulated", [](const Addresses& grads, const Sizes& numel, int dtype_code,
                                       bool max_norm, uintptr_t partials, int64_t capacity) {
    check_count("grad_norm_cuda numel", numel.size(), grads.size());
    const auto g = as_pointers<const void*>(grads);
    py::gil_scoped_release nogil;
    return cuda_emulated::grad_norm(g.data(), numel.data(), int64_t(g.size()), DType(dtype_code),
                                    max_norm, reinterpret_cast<double*>(partials), capacity);
  });
  m.def("grad_norm_finish_cuda_emulated", [](uintptr_t partials, int64_t count, bool max_norm,
                                              uintptr_t norm, uintptr_t found_inf) {
    py::gil_scoped_release nogil;
    cuda_emulated::grad_norm_finish(reinterpret_cast<const double*>(partials), count, max_norm,
                                    reinterpret_cast<float*>(norm),
                                    reinterpret_cast<float*>(found_inf));
  });

#ifdef FK_WITH_CUDA
  // ----------------------------------------------------------------- cuda

  m.def("adamw_cuda", [](const Batch& b, const AdamWHyper& h, const cuda::DeviceScalars& d,
                         uintptr_t stream) {
    const TensorBatch t = b.view_with_moments();
    py::gil_scoped_release nogil;
    cuda::adamw(t, b.dtype, h, d, stream);
  });
  m.def("adamw_int8_cuda", [](const Batch& b, const Moments8& q, const AdamWHyper& h,
                              const cuda::DeviceScalars& d, uintptr_t stream) {
    const TensorBatch t = b.view();
    const Moments8Batch mq = q.view(b);
    py::gil_scoped_release nogil;
    cuda::adamw_int8(t, mq, b.dtype, h, d, stream);
  });
  m.def("sign_sgd_cuda", [](const Batch& b, const SignSgdHyper& h, const cuda::DeviceScalars& d,
                            uintptr_t stream) {
    const TensorBatch t = b.view();
    py::gil_scoped_release nogil;
    cuda::sign_sgd(t, b.dtype, h, d, stream);
  });
  m.def("frugal_step_cuda", [](const Batch& b, const Subsets& s, const FrugalHyper& h,
                               const cuda::DeviceScalars& d, uintptr_t stream) {
    const TensorBatch t = b.view_with_moments();
    const SubsetBatch sub = s.view(b);
    py::gil_scoped_release nogil;
    cuda::frugal_step(t, sub, b.dtype, h, d, stream);
  });
  m.def("frugal_step_int8_cuda", [](const Batch& b, const Subsets& s, const Moments8& q,
                                     const FrugalHyper& h, const cuda::DeviceScalars& d,
                                     uintptr_t stream) {
    const TensorBatch t = b.view();
    const SubsetBatch sub = s.view(b);
    const Moments8Batch mq = q.view(b, s);
    py::gil_scoped_release nogil;
    cuda::frugal_step_int8(t, sub, mq, b.dtype, h, d, stream);
  });
  m.def("dqt_update_cuda", [](const Batch& b, const Subsets& s, const Quant& q, const DqtHyper& h,
                              const cuda::DeviceScalars& d, uintptr_t stream) {
    const TensorBatch t = b.view_with_moments();
    const SubsetBatch sub = s.view(b);
    const QuantBatch quant = q.view(b);
    py::gil_scoped_release nogil;
    cuda::dqt_update(t, sub, quant, b.dtype, h, d, stream);
  });
  // grads: addresses of gradients of one dtype; partials: a device buffer of
  // `capacity` doubles, one per chunk of each gradient is written.
  m.def("grad_norm_cuda", [](const Addresses& grads, const Sizes& numel, int dtype_code,
                             bool max_norm, uintptr_t partials, int64_t capacity,
                             uintptr_t stream) {
    check_count("grad_norm_cuda numel", numel.size(), grads.size());
    const auto g = as_pointers<const void*>(grads);
    py::gil_scoped_release nogil;
    cuda::grad_norm(g.data(), numel.data(), int64_t(g.size()), DType(dtype_code), max_norm,
                           reinterpret_cast<double*>(partials), capacity, stream);
  });
  // The partials of one or more grad_norm_cuda calls to the norm and found_inf
  // (device float32 addresses).
  m.def("grad_norm_finish_cuda", [](uintptr_t partials, int64_t count, bool max_norm,
                                    uintptr_t norm, uintptr_t found_inf, uintptr_t stream) {
    py::gil_scoped_release nogil;
    cuda::grad_norm_finish(reinterpret_cast<const double*>(partials), count, max_norm,
                           reinterpret_cast<float*>(norm), reinterpret_cast<float*>(found_inf),
                           stream);
  });
#endif
}
