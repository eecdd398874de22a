// tensorstep's native autograd node: one C++ autograd Function for every generated CPU kernel.
//
// A Python autograd.Function costs tens of microseconds per call (Function.apply, and the
// engine calling back into Python for backward), more than the kernels themselves at small
// batches. This node does the same bookkeeping in C++. It is generic, not generated: the
// kernels arrive as function addresses with the C ABI of codegen/abi.py, registered once
// per loaded spec. Built once per PyTorch install (runtime/native.py), never per variant.
//
// Scope: CPU, gradients to u and the start state. The Python side routes everything else
// (dt gradients, forward mode, functorch transforms, torch.compile) to the Python Functions.
// Double backward (create_graph) calls the op tensorstep_native::adjoint_graph, implemented
// in Python by the differentiable AdjointFunction, so higher derivatives stay exact.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <deque>
#include <mutex>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The kernels take typed pointers (float*/double*); every pointer is passed alike by the
// C calling convention, so calling through void pointers is ABI-identical.
using P = const void*;
using W = void*;
using Forward4 = void (*)(int64_t, P, P, P, P, P, P, P, W, W, W, W);
using Forward5 = void (*)(int64_t, P, P, P, P, P, P, P, W, W, W, W, W);
using Adjoint4 = void (*)(int64_t, P, P, P, P, P, W, W, W, W, W);
using Adjoint5 = void (*)(int64_t, P, P, P, P, P, P, W, W, W, W, W);

struct Kernels {
  int64_t forward, adjoint, outputs;        // addresses; K = order + 1 outputs
  std::vector<int64_t> output_tail, action_tail;  // shapes after the batch dimension
  int64_t dof;
  int64_t n_dt;  // dt values the kernels read: 1 (uniform) or H (per step)
  bool indexed;  // the kernels read start rows through start_index
  at::ScalarType dtype;
};

std::mutex registry_mutex;
std::deque<Kernels> registry;  // append-only; a deque never moves its elements, so references stay valid

const Kernels& kernels(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()), "tensorstep: unknown kernel handle ", handle);
  return registry[handle];
}

int64_t register_kernels(int64_t forward, int64_t adjoint, int64_t outputs, std::vector<int64_t> output_tail,
                         std::vector<int64_t> action_tail, int64_t dof, int64_t n_dt, bool indexed,
                         at::ScalarType dtype) {
  TORCH_CHECK(outputs == 4 || outputs == 5, "tensorstep: kernels have 4 or 5 outputs, got ", outputs);
  std::lock_guard<std::mutex> guard(registry_mutex);
  registry.push_back(
      Kernels{forward, adjoint, outputs, std::move(output_tail), std::move(action_tail), dof, n_dt, indexed, dtype});
  return static_cast<int64_t>(registry.size()) - 1;
}

P ptr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

std::vector<int64_t> with_batch(int64_t batch, const std::vector<int64_t>& tail) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), tail.begin(), tail.end());
  return shape;
}

void run_forward(const Kernels& k, int64_t B, const Tensor& u, const Tensor& p0, const Tensor& v0, const Tensor& a0,
                 const Tensor& j0, const Tensor& idx, const Tensor& dt, variable_list& ys) {
  if (k.outputs == 4) {
    reinterpret_cast<Forward4>(k.forward)(B, ptr(u), ptr(p0), ptr(v0), ptr(a0), ptr(j0), ptr(idx), ptr(dt),
                                          ys[0].data_ptr(), ys[1].data_ptr(), ys[2].data_ptr(), ys[3].data_ptr());
  } else {
    reinterpret_cast<Forward5>(k.forward)(B, ptr(u), ptr(p0), ptr(v0), ptr(a0), ptr(j0), ptr(idx), ptr(dt),
                                          ys[0].data_ptr(), ys[1].data_ptr(), ys[2].data_ptr(), ys[3].data_ptr(),
                                          ys[4].data_ptr());
  }
}

void run_adjoint(const Kernels& k, int64_t B, const variable_list& g, const Tensor& dt, const Tensor& gu,
                 const variable_list& gs) {
  if (k.outputs == 4) {
    reinterpret_cast<Adjoint4>(k.adjoint)(B, ptr(g[0]), ptr(g[1]), ptr(g[2]), ptr(g[3]), ptr(dt), gu.data_ptr(),
                                          const_cast<W>(ptr(gs[0])), const_cast<W>(ptr(gs[1])),
                                          const_cast<W>(ptr(gs[2])), const_cast<W>(ptr(gs[3])));
  } else {
    reinterpret_cast<Adjoint5>(k.adjoint)(B, ptr(g[0]), ptr(g[1]), ptr(g[2]), ptr(g[3]), ptr(g[4]), ptr(dt),
                                          gu.data_ptr(), const_cast<W>(ptr(gs[0])), const_cast<W>(ptr(gs[1])),
                                          const_cast<W>(ptr(gs[2])), const_cast<W>(ptr(gs[3])));
  }
}

// Forward arguments, in order: u, p0, v0, a0, j0, idx, dt, handle. Gradients are returned per
// argument; needs_input_grad counts only the tensors passed (absent j0/idx have no edge).
enum Argument { U = 0, P0 = 1, J0 = 4, DT = 6, N_ARGUMENTS = 8 };

struct NativeStep : public torch::autograd::Function<NativeStep> {
  static variable_list forward(AutogradContext* ctx, const Tensor& u, const Tensor& p0, const Tensor& v0,
                               const Tensor& a0, const std::optional<Tensor>& j0_, const std::optional<Tensor>& idx_,
                               const Tensor& dt, int64_t handle) {
    const Tensor j0 = j0_.value_or(Tensor());
    const Tensor idx = idx_.value_or(Tensor());
    const Kernels& k = kernels(handle);
    const int64_t B = u.size(0);
    variable_list ys;
    ys.reserve(k.outputs);
    const auto shape = with_batch(B, k.output_tail);
    for (int64_t i = 0; i < k.outputs; ++i) ys.push_back(at::empty(shape, u.options()));
    run_forward(k, B, u, p0, v0, a0, j0, idx, dt, ys);
    ctx->set_materialize_grads(false);  // unused outputs arrive as undefined: no zero tensors
    ctx->save_for_backward({idx, dt});
    ctx->saved_data["handle"] = handle;
    ctx->saved_data["batch"] = B;
    ctx->saved_data["rows"] = p0.size(0);
    ctx->saved_data["has_j0"] = j0.defined();
    ctx->saved_data["dt_edge"] = static_cast<int64_t>(DT - !j0.defined() - !idx.defined());
    return ys;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(N_ARGUMENTS);
    const bool has_j0 = ctx->saved_data["has_j0"].toBool();
    TORCH_CHECK(!ctx->needs_input_grad(ctx->saved_data["dt_edge"].toInt()),
                "tensorstep: internal error: dt gradients take the Python path");
    // u, p0, v0, a0 are edges 0..3; j0, when passed, edge 4
    bool need[5];
    for (int i = 0; i < 5; ++i) need[i] = (i < J0 || has_j0) && ctx->needs_input_grad(i);
    bool any_grad = false;
    for (const auto& g : grads) any_grad = any_grad || g.defined();
    if (!any_grad || !(need[0] || need[1] || need[2] || need[3] || need[4])) return out;

    const auto saved = ctx->get_saved_variables();
    const Tensor& idx = saved[0];
    const Tensor& dt = saved[1];
    const int64_t handle = ctx->saved_data["handle"].toInt();
    const int64_t B = ctx->saved_data["batch"].toInt();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const Kernels& k = kernels(handle);

    variable_list per_batch;  // gu, then the per-batch start gradients
    if (at::GradMode::is_enabled()) {
      // create_graph: the differentiable adjoint (Python AdjointFunction: backward, jvp, vmap)
      static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::adjoint_graph", "");
      c10::List<std::optional<Tensor>> gl;
      for (const auto& g : grads) gl.push_back(g.defined() ? std::optional<Tensor>(g) : std::nullopt);
      torch::jit::Stack stack{c10::IValue(handle), c10::IValue(gl), c10::IValue(dt), c10::IValue(B)};
      op.callBoxed(stack);
      per_batch = stack[0].toTensorVector();
    } else {
      variable_list g;
      for (const auto& x : grads) g.push_back(x.defined() ? x.contiguous() : Tensor());
      const Tensor& like = *std::find_if(g.begin(), g.end(), [](const Tensor& t) { return t.defined(); });
      per_batch.push_back(at::empty(with_batch(B, k.action_tail), like.options()));  // always written
      for (int m = 0; m < 4; ++m) {
        per_batch.push_back(need[P0 + m] ? at::empty({B, k.dof}, like.options()) : Tensor());
      }
      run_adjoint(k, B, g, dt, per_batch[0], variable_list(per_batch.begin() + 1, per_batch.end()));
    }

    if (need[U]) out[U] = per_batch[0];
    for (int m = 0; m < 4; ++m) {
      if (!need[P0 + m]) continue;
      const Tensor& g = per_batch[1 + m];
      // several batch elements may share a start row: sum theirs
      out[P0 + m] = idx.defined() ? at::zeros({rows, k.dof}, g.options()).index_add(0, idx, g) : g;
    }
    return out;
  }
};

std::vector<Tensor> step(int64_t handle, const Tensor& u, const Tensor& p0, const Tensor& v0, const Tensor& a0,
                         const std::optional<Tensor>& j0, const std::optional<Tensor>& idx, const Tensor& dt) {
  return NativeStep::apply(u, p0, v0, a0, j0, idx, dt, handle);
}

// A dense, contiguous CPU tensor of this dtype: what the kernels can read through a raw pointer.
bool dense_cpu(const Tensor& t, at::ScalarType dtype) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == dtype &&
         t.is_contiguous();
}

// What runtime/validate.py accepts for one input, checked without leaving C++: a dense,
// contiguous CPU tensor of the kernel's dtype and exactly this shape.
bool conforms(const Kernels& k, const Tensor& t, at::IntArrayRef shape) {
  return dense_cpu(t, k.dtype) && t.sizes() == shape;
}

// start_index as runtime/validate.py's check_index accepts it without converting it: int64, one
// entry per trajectory, each naming one of the start tensors' rows.
bool index_conforms(const Tensor& idx, int64_t B, int64_t rows) {
  if (!dense_cpu(idx, at::kLong) || idx.dim() != 1 || idx.size(0) != B) return false;
  const int64_t* x = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    if (x[i] < 0 || x[i] >= rows) return false;
  }
  return true;
}

// u and the start state (start rows: one per trajectory, or any number ≥ 1 picked by start_index).
bool inputs_conform(const Kernels& k, const Tensor& u, const Tensor& p0, const Tensor& v0, const Tensor& a0,
                    const std::optional<Tensor>& j0, const std::optional<Tensor>& idx) {
  if (!u.defined() || u.dim() != 3 || u.size(0) == 0 || k.indexed != idx.has_value()) return false;
  const int64_t B = u.size(0);
  int64_t rows = B;
  if (k.indexed) {
    if (!p0.defined() || p0.dim() != 2 || p0.size(0) == 0) return false;
    rows = p0.size(0);
    if (!index_conforms(*idx, B, rows)) return false;
  }
  const std::array<int64_t, 2> start{rows, k.dof};
  return conforms(k, u, with_batch(B, k.action_tail)) && conforms(k, p0, start) && conforms(k, v0, start) &&
         conforms(k, a0, start) && (!j0.has_value() || conforms(k, *j0, start));
}

template <typename T>
bool finite_and_positive(const Tensor& dt) {
  const T* x = dt.const_data_ptr<T>();
  for (int64_t i = 0; i < dt.numel(); ++i) {
    if (!(std::isfinite(x[i]) && x[i] > 0)) return false;
  }
  return true;
}

// dt as runtime/validate.py's dt_tensor accepts it without converting it: n_dt finite, positive
// values of the kernel's dtype in a contiguous CPU tensor of at most one dimension, with nothing
// to differentiate (dt gradients take the Python path).
bool dt_conforms(const Kernels& k, const Tensor& dt) {
  if (!dense_cpu(dt, k.dtype) || dt.dim() > 1 || dt.numel() != k.n_dt ||
      (at::GradMode::is_enabled() && dt.requires_grad())) {
    return false;
  }
  return k.dtype == at::kFloat ? finite_and_positive<float>(dt) : finite_and_positive<double>(dt);
}

// A call checked here rather than in Python, whose checks cost several microseconds per call
// (tens with a dt tensor or a start_index, whose values are read). Anything unexpected returns
// an empty list, and the caller runs the Python checks, which name the problem.
std::vector<Tensor> checked_step(int64_t handle, const Tensor& u, const Tensor& p0, const Tensor& v0,
                                 const Tensor& a0, const std::optional<Tensor>& j0, const std::optional<Tensor>& idx,
                                 const Tensor& dt) {
  const Kernels& k = kernels(handle);
  if (!inputs_conform(k, u, p0, v0, a0, j0, idx) || !dt_conforms(k, dt)) return {};
  return NativeStep::apply(u, p0, v0, a0, j0, idx, dt, handle);
}

bool overlap(const Tensor& a, const Tensor& b) {  // both contiguous CPU tensors
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// out=: a plain call written into caller-owned outputs, with the rules of runtime/validate.py's
// check_out (nothing to differentiate, outputs disjoint from each other and from the inputs).
// False when anything is off: the caller then runs the Python checks, which name the problem.
bool checked_step_out(int64_t handle, const Tensor& u, const Tensor& p0, const Tensor& v0, const Tensor& a0,
                      const std::optional<Tensor>& j0, const std::optional<Tensor>& idx, const Tensor& dt,
                      at::TensorList out) {
  const Kernels& k = kernels(handle);
  if (!inputs_conform(k, u, p0, v0, a0, j0, idx) || !dt_conforms(k, dt) ||
      static_cast<int64_t>(out.size()) != k.outputs) {
    return false;
  }
  const bool grad = at::GradMode::is_enabled();
  std::vector<Tensor> inputs{u, p0, v0, a0, dt};
  if (j0.has_value()) inputs.push_back(*j0);
  if (idx.has_value()) inputs.push_back(*idx);
  for (const auto& x : inputs) {
    if (grad && x.requires_grad()) return false;
  }
  const auto shape = with_batch(u.size(0), k.output_tail);
  for (size_t i = 0; i < out.size(); ++i) {
    const Tensor& y = out[i];
    if (!conforms(k, y, shape) || (grad && y.requires_grad()) || y.is_inference()) return false;
    for (const auto& x : inputs) {
      if (overlap(x, y)) return false;
    }
    for (size_t j = 0; j < i; ++j) {
      if (overlap(out[j], y)) return false;
    }
  }
  variable_list ys(out.begin(), out.end());
  run_forward(k, u.size(0), u, p0, v0, a0, j0.value_or(Tensor()), idx.value_or(Tensor()), dt, ys);
  for (const auto& y : out) y.unsafeGetTensorImpl()->bump_version();  // written in place
  return true;
}

}  // namespace

TORCH_LIBRARY(tensorstep_native, m) {
  m.def("register_kernels(int forward, int adjoint, int outputs, int[] output_tail, int[] action_tail, int dof, "
        "int n_dt, bool indexed, ScalarType dtype) -> int",
        &register_kernels);
  m.def("step(int handle, Tensor u, Tensor p0, Tensor v0, Tensor a0, Tensor? j0, Tensor? idx, Tensor dt) -> Tensor[]");
  m.def("checked_step(int handle, Tensor u, Tensor p0, Tensor v0, Tensor a0, Tensor? j0, Tensor? idx, "
        "Tensor dt) -> Tensor[]");
  m.def("checked_step_out(int handle, Tensor u, Tensor p0, Tensor v0, Tensor a0, Tensor? j0, Tensor? idx, "
        "Tensor dt, Tensor(a!)[] out) -> bool");
  // implemented in Python (runtime/native.py): the create_graph adjoint
  m.def("adjoint_graph(int handle, Tensor?[] grads, Tensor dt, int batch) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tensorstep_native, CompositeImplicitAutograd, m) {
  m.impl("step", &step);
  m.impl("checked_step", &checked_step);
  m.impl("checked_step_out", &checked_step_out);
}
