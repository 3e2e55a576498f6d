// The per-coordinate update rules, written once for the CPU and CUDA kernels.
// Every rule works in fp32; the order of operations follows
// torch.optim.AdamW(foreach=False) so that results agree to rounding.
#pragma once

#include <cmath>

#include "frugal/common.h"

namespace frugal {

// Hyper-parameters of one AdamW call as the caller gives them.
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double step;  // count after this update, from 1, as torch's state["step"]
  bool maximize;
  // GradScaler's scale, divided out of the gradients as they are read (1: none),
  // and its found_inf: non-zero leaves everything untouched.
  double grad_scale;
  double found_inf;
};

// What the inner loop needs, derived once per call in double precision (as
// torch does in Python) and rounded to fp32 once.
struct AdamWScalars {
  float decay;        // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;    // lr / (1 - beta1^step)
  float bc2_sqrt;     // sqrt(1 - beta2^step)
  float eps;
  float inv_grad_scale;  // 1 / grad_scale, as GradScaler's unscale_ multiplies
  bool maximize;
};

// GradScaler computes its inverse scale in double and rounds it to fp32 once.
FK_HOST_DEVICE float inverse_scale(double grad_scale) { return float(1.0 / grad_scale); }

FK_HOST_DEVICE AdamWScalars adamw_scalars(const AdamWHyper& h) {
  AdamWScalars s;
  s.decay = float(1.0 - h.lr * h.weight_decay);
  s.beta1 = float(h.beta1);
  s.one_minus_beta1 = float(1.0 - h.beta1);
  s.beta2 = float(h.beta2);
  s.one_minus_beta2 = float(1.0 - h.beta2);
  s.step_size = float(h.lr / (1.0 - pow(h.beta1, h.step)));
  s.bc2_sqrt = float(sqrt(1.0 - pow(h.beta2, h.step)));
  s.eps = float(h.eps);
  s.inv_grad_scale = inverse_scale(h.grad_scale);
  s.maximize = h.maximize;
  return s;
}

// One AdamW coordinate: decoupled decay, moment updates, bias-corrected step.
// m and v are updated in place, and root_v is set to sqrt(v) of the new v (8-bit
// moments store a root of it); the new parameter value is returned.
FK_HOST_DEVICE float adamw_update(float p, float g, float& m, float& v, const AdamWScalars& s,
                                  float& root_v) {
  g = g * s.inv_grad_scale;
  if (s.maximize) g = -g;
  p = p * s.decay;
  // torch's lerp(m, g, w) with w = 1 - beta1 < 0.5
  m = m + s.one_minus_beta1 * (g - m);
  v = v * s.beta2 + s.one_minus_beta2 * (g * g);
  root_v = sqrtf(v);
  const float denom = root_v / s.bc2_sqrt + s.eps;
  return p - s.step_size * (m / denom);
}

FK_HOST_DEVICE float adamw_update(float p, float g, float& m, float& v, const AdamWScalars& s) {
  float root_v;
  return adamw_update(p, g, m, v, s, root_v);
}

// What the state-free coordinates of a FRUGAL step do.
enum class StateFree : int { kSign = 0, kSgd = 1, kNone = 2 };

// Hyper-parameters of one sign_sgd_ call.
struct SignSgdHyper {
  double lr;
  double weight_decay;
  double scale;  // the step is lr * scale
  double grad_scale;  // as AdamWHyper's
  double found_inf;
};

// Hyper-parameters of one frugal_step_ call: AdamW's for the state-full
// coordinates (maximize stays false: the op has none) and the rule of the
// others, whose step is lr * state_free_scale.
struct FrugalHyper {
  AdamWHyper adamw;
  double state_free_scale;
  StateFree state_free;
};

// Hyper-parameters of one lowrank_step_ call (the state-free rule of the residual).
struct LowrankHyper {
  double lr;
  double weight_decay;
  double state_free_scale;
  StateFree state_free;
  double grad_scale;  // as AdamWHyper's
  double found_inf;
};

struct SignScalars {
  float decay;           // 1 - lr * weight_decay
  float step;            // lr * scale
  float inv_grad_scale;  // as AdamWScalars'
};

FK_HOST_DEVICE SignScalars sign_scalars(double lr, double weight_decay, double scale,
                                        double grad_scale) {
  return SignScalars{float(1.0 - lr * weight_decay), float(lr * scale), inverse_scale(grad_scale)};
}

FK_HOST_DEVICE float sign_of(float g) {
  return g > 0.f ? 1.f : (g < 0.f ? -1.f : 0.f);
}

// A state-free coordinate given its unscaled gradient: decay, then a step
// along -sign(g), -g, or none.
template <StateFree Mode>
FK_HOST_DEVICE float state_free_rule(float p, float g, const SignScalars& s) {
  p = p * s.decay;
  if (Mode == StateFree::kSign) return p - s.step * sign_of(g);
  if (Mode == StateFree::kSgd) return p - s.step * g;
  return p;
}

// The same from the gradient as stored (scaled by a GradScaler, or not).
template <StateFree Mode>
FK_HOST_DEVICE float state_free_update(float p, float g, const SignScalars& s) {
  return state_free_rule<Mode>(p, g * s.inv_grad_scale, s);
}

// The weight update of a low-rank FRUGAL step, once the back-projections are
// known: `up_update` = P(AdamW update in the subspace) and `up_grad` =
// P(P^T g) of the unscaled gradient, so that g - up_grad is the residual the
// state-free rule sees.
template <StateFree Mode>
FK_HOST_DEVICE float lowrank_update(float p, float g, float up_update, float up_grad,
                                    const SignScalars& s) {
  return state_free_rule<Mode>(p, g * s.inv_grad_scale - up_grad, s) + up_update;
}


// Hyper-parameters of one sgd_ call: torch.optim.SGD's, plus whether this
// call creates the momentum buffers (torch's first step sets them to the
// gradient, without dampening).
struct SgdHyper {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
  bool first_step;
  double grad_scale;  // as AdamWHyper's
  double found_inf;
};

struct SgdScalars {
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  float inv_grad_scale;  // as AdamWScalars'
  bool use_momentum;  // momentum != 0: the buffers exist and are updated
  bool nesterov;
  bool maximize;
  bool first_step;
};

FK_HOST_DEVICE SgdScalars sgd_scalars(const SgdHyper& h) {
  return SgdScalars{float(h.lr), float(h.momentum), float(1.0 - h.dampening),
                    float(h.weight_decay), inverse_scale(h.grad_scale), h.momentum != 0.0,
                    h.nesterov, h.maximize, h.first_step};
}

// One SGD coordinate in the order of torch.optim.SGD(foreach=False): the
// sign for maximize, coupled (L2) weight decay into the gradient, the
// momentum buffer, the Nesterov look-ahead. buf is updated in place when
// momentum is on; the new parameter value is returned.
FK_HOST_DEVICE float sgd_update(float p, float g, float& buf, const SgdScalars& s) {
  g = g * s.inv_grad_scale;
  if (s.maximize) g = -g;
  if (s.weight_decay != 0.f) g = g + s.weight_decay * p;
  if (s.use_momentum) {
    buf = s.first_step ? g : buf * s.momentum + s.one_minus_dampening * g;
    g = s.nesterov ? g + s.momentum * buf : buf;
  }
  return p - s.lr * g;
}

}  // namespace frugal
