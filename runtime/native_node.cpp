// tensorstep's native autograd node: one C++ op and autograd node for every generated kernel (CPU;
// CUDA where TENSORSTEP_CUDA_NATIVE=1, see "CUDA launches" below).
//
// A Python autograd.Function costs tens of microseconds per call (Function.apply, and the
// engine calling back into Python for backward), more than the kernels themselves at small
// batches. This node does the same bookkeeping in C++. It is generic, not generated: each
// loaded spec registers its kernels' addresses together with its argument table (the rows of
// codegen/arguments.py, and the message templates), and everything below — the checks and
// their errors, the kernels' pointer lists, the output and gradient shapes, the summing of
// gradients onto indexed rows — follows those rows. Built once per PyTorch install
// (runtime/native.py), never per variant.
//
// Scope: CPU (and CUDA, opt-in), gradients to the tensor inputs, plain and fused steps (a fused step's adjoint reads
// the inputs; its cost parameters' values are checked in Python first). The Python side routes
// everything else (dt gradients, forward mode, functorch transforms) to the Python Functions.
// Under torch.compile, the graph's ops (runtime/ops.py) take this node's checks and kernels on
// CPU as well (their CPU and autograd kernels, below), so that a compiled call does not enter
// Python for a step (a fused step's compiled calls run its composite form).
// Double backward (create_graph) calls the op tensorstep_native::adjoint_graph, implemented
// in Python by the differentiable AdjointFunction, so higher derivatives stay exact (a fused
// step's, adjoint_graph_fused: its composite form).
//
// Built once per PyTorch install, most of its compile time is parsing PyTorch's headers, so it
// includes only what it uses: the autograd Node (not function.h and functions/utils.h, which
// add the engine's graph tasks and the whole autograd API), and the per-operator ATen headers
// (PyTorch's own AT_PER_OPERATOR_HEADERS: without it, the Node's headers include
// ATen/Functions.h, every operator's declarations, most of the parse).
#ifndef AT_PER_OPERATOR_HEADERS
#define AT_PER_OPERATOR_HEADERS
#endif
#include <ATen/EmptyTensor.h>
#include <ATen/ops/_assert_async.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // older PyTorch releases declare the Node in function.h
#include <torch/csrc/autograd/function.h>
#endif
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#if defined(__linux__)
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::variable_list;

// ---- calling a generated kernel: B, then one pointer per parameter --------------------------
// Every parameter after B is a pointer, and the C calling convention passes all pointers
// alike, so a kernel of n pointer parameters can be called as void(int64_t, void* x n).
using Caller = void (*)(int64_t, int64_t, void* const*);

template <size_t... I>
void call_with(int64_t address, int64_t B, void* const* a, std::index_sequence<I...>) {
  using Fn = void (*)(int64_t, decltype((void)I, static_cast<void*>(nullptr))...);
  reinterpret_cast<Fn>(address)(B, a[I]...);
}

template <size_t N>
void call_n(int64_t address, int64_t B, void* const* a) {
  call_with(address, B, a, std::make_index_sequence<N>{});
}

template <size_t... N>
constexpr std::array<Caller, sizeof...(N)> callers(std::index_sequence<N...>) {
  return {&call_n<N>...};
}

// (a plain table has at most 12 inputs and 4 outputs: 16 pointers; a fused one adds a few per cost
// term, and its adjoint reads the inputs too)
constexpr auto CALLERS = callers(std::make_index_sequence<64>{});

// A fused kernel's entry point that finds no form it can run writes nothing and cannot raise: the
// runtime's hook (runtime/unbuilt.py) keeps why in Python and sets this thread's flag, and the kernel's
// caller here raises it once the kernel has returned (the forward's, and the backward's, which no
// Python frame follows), through the op that takes Python's record (tensorstep_native::raise_unbuilt).
thread_local bool unbuilt = false;

void raise_unbuilt() {
  unbuilt = false;
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::raise_unbuilt", "");
  torch::jit::Stack stack;
  op.callBoxed(stack);  // raises Python's record of this thread
  TORCH_CHECK(false, "tensorstep: a kernel found no form it could run, so it wrote no output");
}

void call(int64_t address, int64_t B, std::vector<void*>& args) {
  TORCH_CHECK(args.size() < CALLERS.size(), "tensorstep: a kernel with ", args.size(), " parameters");
  CALLERS[args.size()](address, B, args.data());
  if (unbuilt) raise_unbuilt();
}

// ---- the argument table, as registered -------------------------------------------------------
enum Rule : int64_t { KERNEL_DTYPE = 0, INDEX = 1, STEP = 2 };
enum Presence : int64_t { REQUIRED = 0, OPTIONAL = 1, ABSENT = 2 };
// message templates, in the order runtime/native.py passes them
enum Message { MISSING, UNEXPECTED, LAYOUT, DIMS, SHAPE, DTYPE, INDEX_DTYPE, DEVICE, EMPTY, NO_ROWS, N_MESSAGES };

// A CUDA handle's launches (see "CUDA launches" below)
struct CudaRun {
  int64_t function, grid, block, shared;
  std::vector<int64_t> positions;  // of the launch's parameters after B, among the slots after B
};

struct CudaPlan {
  int64_t arguments = 0;
  std::vector<std::pair<int64_t, at::ScalarType>> temporaries;  // (elements, dtype)
  std::vector<int64_t> constants;
  std::vector<CudaRun> runs;
};

// the temporaries' dtypes, in the order of runtime/cuda_backend.py's TEMPORARY_DTYPES
constexpr std::array<at::ScalarType, 2> TEMPORARY_DTYPES{at::kFloat, at::kDouble};

struct CudaPlans {
  explicit CudaPlans(size_t limit) : limit(limit) {}
  std::mutex mutex;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const CudaPlan>> kept;  // (entry point, B) →
  std::deque<std::pair<int64_t, int64_t>> order;                               // oldest first
  size_t limit;
  int64_t asked = 0;  // how many times Python was asked (a test's count)
};

struct Row {
  std::string name, meaning;
  std::vector<int64_t> shape;  // sizes; a negative code -1-i stands for free symbol i (B, S, ...)
  int64_t rule, presence, index;  // index: position of the index row that picks this row's entries, or -1
  bool differentiable;
};

struct Kernels {
  int64_t forward, adjoint;
  std::vector<Row> rows;  // inputs in table order, dt last
  std::vector<int64_t> output_shape;  // the first output's
  int64_t outputs;
  std::vector<std::string> symbols, messages;
  at::ScalarType dtype;
  std::vector<std::vector<int64_t>> output_shapes;  // each output's
  // cost terms, or some states not written (runtime/costs.py): the adjoint reads the inputs and is
  // not linear; a create_graph backward goes through the composite form
  bool fused = false;
  // the rows a step may keep between calls (a fused step's cost parameters, see Slot below), and
  // the free symbols their shapes use
  std::vector<int64_t> kept_rows, kept_symbols;
  std::vector<bool> kept;  // per row: one of kept_rows
  // CUDA kernels (see "CUDA launches" below): the step's device, whose tensors alone are taken; the
  // launches of each (entry point, B) as Python works them out once; the launch and stream functions
  // (0: the driver's cuLaunchKernel, PyTorch's current stream)
  bool cuda = false;
  c10::Device device{c10::DeviceType::CPU};
  int64_t handle = -1;
  std::shared_ptr<CudaPlans> plans;
  int64_t launch = 0, stream = 0;
  // what keeps the CUDA kernels loaded (runtime/native.py: a tensor whose memory holds the backend that
  // loaded their modules), held weakly: by the step's launcher while it lives, and by each autograd node
  // until its backward ran (``hold``). Once it is gone, the modules may be unloaded: nothing launches.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> anchor;
};

// One entry per library of kernels registered (runtime/native.py reuses a library's handle), kept for
// the process as the library is: a graph may call a handle's kernels after its step was freed. (A CUDA
// handle's modules are freed with the last of its step and graphs instead: Kernels::anchor.)
std::mutex registry_mutex;
std::deque<Kernels> registry;  // append-only; a deque never moves its elements, so references stay valid

const Kernels& kernels(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()), "tensorstep: unknown kernel handle ", handle);
  return registry[handle];
}

int64_t register_kernels(int64_t forward, int64_t adjoint, std::vector<std::string> names,
                         std::vector<std::string> meanings, std::vector<int64_t> ranks, std::vector<int64_t> shapes,
                         std::vector<int64_t> rules, std::vector<int64_t> presences, std::vector<int64_t> indices,
                         std::vector<int64_t> differentiable, std::vector<int64_t> output_shapes,
                         std::vector<int64_t> output_ranks, std::vector<std::string> symbols,
                         std::vector<std::string> messages, at::ScalarType dtype, bool fused,
                         std::vector<int64_t> kept, bool cuda, const std::string& device, int64_t launch,
                         int64_t stream, int64_t plans_kept, const std::optional<Tensor>& anchor) {
  TORCH_CHECK(messages.size() == N_MESSAGES, "tensorstep: expected ", N_MESSAGES, " message templates");
  Kernels k{forward, adjoint, {}, {}, static_cast<int64_t>(output_ranks.size()), std::move(symbols),
            std::move(messages), dtype};
  for (size_t i = 0, at = 0; i < output_ranks.size(); at += output_ranks[i++]) {
    k.output_shapes.emplace_back(output_shapes.begin() + at, output_shapes.begin() + at + output_ranks[i]);
  }
  if (!k.output_shapes.empty()) k.output_shape = k.output_shapes[0];
  k.fused = fused;
  size_t at = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int64_t> shape(shapes.begin() + at, shapes.begin() + at + ranks[i]);
    at += ranks[i];
    k.kept.push_back(kept[i] != 0);
    if (kept[i]) {
      k.kept_rows.push_back(static_cast<int64_t>(i));
      for (auto s : shape) {
        if (s < 0 && std::find(k.kept_symbols.begin(), k.kept_symbols.end(), -1 - s) == k.kept_symbols.end()) {
          k.kept_symbols.push_back(-1 - s);
        }
      }
    }
    k.rows.push_back(Row{names[i], meanings[i], std::move(shape), rules[i], presences[i], indices[i],
                         differentiable[i] != 0});
  }
  k.cuda = cuda;
  k.device = c10::Device(device);
  k.launch = launch;
  k.stream = stream;
  if (cuda) k.plans = std::make_shared<CudaPlans>(static_cast<size_t>(std::max<int64_t>(plans_kept, 1)));
  if (anchor && anchor->defined()) k.anchor.emplace(anchor->storage().getWeakStorageImpl());
  std::lock_guard<std::mutex> guard(registry_mutex);
  k.handle = static_cast<int64_t>(registry.size());
  registry.push_back(std::move(k));
  return static_cast<int64_t>(registry.size()) - 1;
}

// ---- messages: the templates of codegen/arguments.py, formatted as Python formats them ---------
std::string format(const std::string& text, const std::map<std::string, std::string>& fields) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '{') {
      const size_t close = text.find('}', i);
      const auto found = fields.find(text.substr(i + 1, close - i - 1));
      if (close != std::string::npos && found != fields.end()) {
        out += found->second;
        i = close;
        continue;
      }
    }
    out += text[i];
  }
  return out;
}

std::string tuple_text(const std::vector<std::string>& items) {
  std::string out = "(";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + (items.size() == 1 ? ",)" : ")");
}

std::string shape_text(at::IntArrayRef shape) {
  std::vector<std::string> items;
  for (auto s : shape) items.push_back(std::to_string(s));
  return tuple_text(items);
}

std::string symbolic_text(const Kernels& k, const Row& row) {
  std::vector<std::string> items;
  for (auto s : row.shape) items.push_back(s >= 0 ? std::to_string(s) : k.symbols[-1 - s]);
  return tuple_text(items);
}

std::string dtype_text(at::ScalarType t) {  // as Python prints a torch.dtype
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string layout_text(at::Layout layout) {  // as Python prints a torch.layout
  std::ostringstream text;
  text << layout;
  std::string name = text.str();
  for (auto& c : name) c = static_cast<char>(std::tolower(c));
  return name == "sparse" ? "torch.sparse_coo" : "torch." + name;
}

std::string say(const Kernels& k, Message m, const Row& row, std::map<std::string, std::string> fields = {}) {
  fields["name"] = row.name;
  return format(k.messages[m], fields);
}

// A tensor shape on the stack: the containers below are filled on every call, and heap
// allocations were a noticeable part of a small call's cost.
using Sizes = c10::SmallVector<int64_t, 6>;

// ---- checks: the rules of runtime/validate.py, row by row -------------------------------------
// A structural problem (presence, layout, rank, shape, dtype, device) raises the table's message.
// A problem with values (dt entries, index entries) or with dt's form returns false: the caller
// then runs the Python checks, which say what is wrong.
struct KeptRow;
using KeptRows = std::shared_ptr<const std::vector<KeptRow>>;

struct Checked {
  std::vector<Tensor> inputs;  // contiguous, int64 indices, dt reshaped to the kernel's vector
  std::vector<int64_t> sizes;  // of the free symbols
  KeptRows kept;               // a slot's kept rows, when the call took them (their kernels' tensors are in inputs)
};

// What the kernels read for a checked tensor: contiguous, an index as int64, and a negated view
// (the negative bit set: its memory holds the values negated) materialised, as runtime/validate.py's
// check_argument makes it (differentiable; in the common case, one bit test).
Tensor kernel_input(const Tensor& t, bool index) {
  if (t.is_neg()) return kernel_input(t.resolve_neg(), index);
  return index ? t.to(at::kLong).contiguous() : t.contiguous();
}

bool check_row(const Kernels& k, const Row& row, const Tensor& t, std::vector<int64_t>& sizes, Tensor& out) {
  if (!t.defined()) {
    TORCH_CHECK_TYPE(row.presence != REQUIRED, say(k, MISSING, row, {{"expected", row.meaning}}));
    return true;
  }
  TORCH_CHECK_TYPE(row.presence != ABSENT, say(k, UNEXPECTED, row, {{"expected", row.meaning}}));
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, say(k, LAYOUT, row, {{"got", layout_text(t.layout())}}));
  if (row.rule == STEP) {  // a float dt of any form Python accepts; the rest is for Python to explain
    // a fixed count, or one per trajectory (shape (B,): B is bound by the rows before dt)
    const int64_t n = row.shape[0] >= 0 ? row.shape[0] : sizes[-1 - row.shape[0]];
    if (n < 0) return false;
    if (t.dim() > 1 || t.numel() != n || !t.is_floating_point() || t.device() != k.device) return false;
    // the kernel's vector as it is (a float dt's cached tensor), else reshaped and converted
    const bool ready = t.dim() == 1 && t.scalar_type() == k.dtype && t.is_contiguous() && !t.is_neg();
    out = ready ? t : kernel_input(t.reshape({n}).to(k.dtype), false);
    if (!out.device().is_cpu()) return true;  // a device's values are not read (no host synchronisation), as in Python
    const auto* x = out.const_data_ptr();
    for (int64_t i = 0; i < n; ++i) {
      const double v = k.dtype == at::kFloat ? static_cast<const float*>(x)[i] : static_cast<const double*>(x)[i];
      if (!(std::isfinite(v) && v > 0)) return false;
    }
    return true;
  }
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(row.shape.size()),
                    say(k, DIMS, row, {{"count", std::to_string(row.shape.size())},
                                       {"expected", symbolic_text(k, row)}, {"got", shape_text(t.sizes())}}));
  Sizes expected;
  for (size_t d = 0; d < row.shape.size(); ++d) {
    int64_t s = row.shape[d];
    if (s < 0) {
      int64_t& bound = sizes[-1 - s];
      if (bound < 0) {
        TORCH_CHECK_VALUE(t.size(d) > 0, say(k, s == -1 ? EMPTY : NO_ROWS, row, {{"got", shape_text(t.sizes())}}));
        bound = t.size(d);
      }
      s = bound;
    }
    expected.push_back(s);
  }
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected),
                    say(k, SHAPE, row, {{"expected", shape_text(expected)}, {"got", shape_text(t.sizes())}}));
  if (row.rule == INDEX) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt,
                     say(k, INDEX_DTYPE, row, {{"got", dtype_text(t.scalar_type())}}));
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == k.dtype,
                     say(k, DTYPE, row, {{"expected", dtype_text(k.dtype)}, {"got", dtype_text(t.scalar_type())}}));
  }
  TORCH_CHECK_VALUE(t.device() == k.device,
                    say(k, DEVICE, row, {{"expected", k.device.str()}, {"got", t.device().str()}}));
  out = kernel_input(t, row.rule == INDEX);
  return true;
}

// Every index entry names a row of the tables it picks from: read on the CPU; on a device, an
// asynchronous device-side assert (runtime/validate.py check_index_values: no host synchronisation).
bool indices_in_range(const Kernels& k, const std::vector<Tensor>& inputs) {
  for (size_t i = 0; i < k.rows.size(); ++i) {
    if (k.rows[i].rule != INDEX || !inputs[i].defined()) continue;
    int64_t rows = -1;
    for (size_t j = 0; j < k.rows.size() && rows < 0; ++j) {
      if (k.rows[j].index == static_cast<int64_t>(i) && inputs[j].defined()) rows = inputs[j].size(0);
    }
    if (!inputs[i].device().is_cpu()) {
      const Tensor& x = inputs[i];
      at::_assert_async(x.ge(0).logical_and_(x.lt(rows)).all(), k.rows[i].name + " out of range");
      continue;
    }
    const int64_t* x = inputs[i].const_data_ptr<int64_t>();
    for (int64_t b = 0; b < inputs[i].numel(); ++b) {
      if (x[b] < 0 || x[b] >= rows) return false;
    }
  }
  return true;
}

using Given = c10::List<std::optional<Tensor>>;

// ---- parameters kept between calls: a fused step's cost parameters --------------------------------
// Their values are checked in Python (runtime/costs.py), and an optimiser passes the same tensors on
// every call. Once a call's parameters passed every check, Python keeps them in the step's slot
// (``keep``): each with what can have changed since (runtime/validate.py's stamp: the tensor itself,
// kept alive here so that its address cannot be another's, its version, data pointer, shape,
// strides, dtype, negative bit and requires_grad) and the tensor the kernels read (a [D] weight's
// [B, D] rows, a missing row weight's default). A later call whose kept rows are all these tensors,
// unchanged, with the same sizes of the symbols their shapes use, checks its other rows only; any
// other call gets no result, and the Python path checks it (and keeps its parameters).
// Parameters a step holds (Step.set_costs) are kept with the holding's generation: a call that
// passes only the other rows and that generation (``held``) takes the kept rows, each its held
// tensor compared with its own stamp, so that no held tensor crosses from Python per call.
struct KeptRow {
  Tensor given;   // undefined: None was given
  Tensor kernel;  // what the kernels read
  int64_t version = 0;
  const void* data = nullptr;
  Sizes sizes, strides;
  bool requires_grad = false;
  at::ScalarType dtype = at::kFloat;
  bool neg = false;
};

struct Slot {
  int64_t handle = -1;
  int64_t held = -1;           // the generation of the step's held parameters these rows are (-1: a call's)
  std::vector<int64_t> sizes;  // of the free symbols, in the call that kept them
  // one per kept row (Kernels::kept_rows), never changed once made: a call's autograd node shares
  // them (its backward reads them) while a later keep replaces the slot's
  KeptRows rows;
};

std::mutex slots_mutex;
std::unordered_map<int64_t, Slot> slots;  // a step's slot, from new_slot to tensorstep_release_slot
int64_t next_slot = 0;

bool unchanged(const KeptRow& kept, const Tensor& t) {
  if (!t.defined() || !kept.given.defined()) return t.defined() == kept.given.defined();
  return t.unsafeGetTensorImpl() == kept.given.unsafeGetTensorImpl() && t._version() == kept.version &&
         t.const_data_ptr() == kept.data && t.sizes() == at::IntArrayRef(kept.sizes) &&
         t.strides() == at::IntArrayRef(kept.strides) && t.scalar_type() == kept.dtype && t.is_neg() == kept.neg &&
         t.requires_grad() == kept.requires_grad;
}

// The kept rows of a call: true when every one is its slot's tensor unchanged (c.inputs then hold
// what the kernels read), with the other rows' sizes of the symbols they use. With ``held`` (>= 0)
// the call passed no kept row: the slot's rows must be that generation of the held parameters,
// each its tensor as it was kept.
bool take_kept(const Kernels& k, int64_t handle, int64_t slot, const Given& given, Checked& c, int64_t held = -1) {
  std::lock_guard<std::mutex> guard(slots_mutex);
  const auto found = slots.find(slot);
  if (found == slots.end() || found->second.handle != handle) return false;
  const Slot& s = found->second;
  if (!s.rows || (held >= 0 && s.held != held)) return false;
  for (const auto symbol : k.kept_symbols) {
    if (s.sizes[symbol] < 0) continue;  // no kept tensor has it (every row with it was None)
    if (c.sizes[symbol] < 0) {
      c.sizes[symbol] = s.sizes[symbol];
    } else if (c.sizes[symbol] != s.sizes[symbol]) {
      return false;
    }
  }
  for (size_t r = 0; r < k.kept_rows.size(); ++r) {
    const int64_t i = k.kept_rows[r];
    const KeptRow& row = (*s.rows)[r];
    if (!unchanged(row, held >= 0 ? row.given : given.get(i).value_or(Tensor()))) return false;
    c.inputs[i] = row.kernel;
  }
  c.kept = s.rows;
  return true;
}

// The checks of a call, row by row; with a slot (>= 0), the kept rows are taken from it instead.
// With ``held`` (>= 0), ``given`` holds the rows that are not kept only (dt last), and the kept
// rows are the slot's held parameters of that generation.
bool check(const Kernels& k, const Given& given, Checked& c, int64_t handle = -1, int64_t slot = -1,
           int64_t held = -1) {
  const bool kept = slot >= 0 && !k.kept_rows.empty();
  const size_t expected = k.rows.size() - (held >= 0 ? k.kept_rows.size() : 0);
  TORCH_CHECK(held < 0 || kept, "tensorstep: held parameters need a fused step's slot");
  TORCH_CHECK(given.size() == expected, "tensorstep: expected ", expected, " arguments, got ", given.size());
  c.sizes.assign(k.symbols.size(), -1);
  c.inputs.assign(k.rows.size(), Tensor());
  for (size_t i = 0, r = 0, j = 0; i < k.rows.size(); ++i) {
    if (kept && r < k.kept_rows.size() && k.kept_rows[r] == static_cast<int64_t>(i)) {
      ++r;
      j += held < 0;
      continue;
    }
    const std::optional<Tensor> t = given.get(j++);
    if (!check_row(k, k.rows[i], t.value_or(Tensor()), c.sizes, c.inputs[i])) return false;
  }
  if (kept && !take_kept(k, handle, slot, given, c, held)) return false;
  return indices_in_range(k, c.inputs);
}

// keep(handle, slot, given, inputs, held): a call's cost parameters passed every check (in Python): the
// slot keeps each kept row's given tensor and what the kernels read (``inputs``, checked again here
// for their sizes); ``held`` (>= 0): they are the step's held parameters of that generation. An
// inference tensor has no version to compare: nothing is kept then.
void keep(int64_t handle, int64_t slot, const Given& given, const Given& inputs, int64_t held = -1) {
  const Kernels& k = kernels(handle);
  Checked c;
  Slot s{handle, held, {}, {}};
  std::vector<KeptRow> rows;
  bool ok = given.size() == k.rows.size() && check(k, inputs, c);
  for (size_t r = 0; ok && r < k.kept_rows.size(); ++r) {
    const Tensor t = given.get(k.kept_rows[r]).value_or(Tensor());
    if (t.defined() && t.is_inference()) {
      ok = false;
      break;
    }
    KeptRow row{t, c.inputs[k.kept_rows[r]]};
    if (t.defined()) {
      row.version = t._version();
      row.data = t.const_data_ptr();
      row.sizes = Sizes(t.sizes().begin(), t.sizes().end());
      row.strides = Sizes(t.strides().begin(), t.strides().end());
      row.requires_grad = t.requires_grad();
      row.dtype = t.scalar_type();
      row.neg = t.is_neg();
    }
    rows.push_back(std::move(row));
  }
  s.sizes = c.sizes;
  s.rows = std::make_shared<const std::vector<KeptRow>>(std::move(rows));
  std::lock_guard<std::mutex> guard(slots_mutex);
  const auto found = slots.find(slot);
  if (found == slots.end()) return;  // released
  if (ok) {
    found->second = std::move(s);
  } else {
    found->second = Slot{};
  }
}

Sizes resolve(const std::vector<int64_t>& shape, at::IntArrayRef sizes) {
  Sizes out;
  for (auto s : shape) out.push_back(s >= 0 ? s : sizes[-1 - s]);
  return out;
}

void* ptr(const Tensor& t) { return t.defined() ? const_cast<void*>(t.const_data_ptr()) : nullptr; }

// ---- new outputs: large ones in blocks of their own, kept for reuse ------------------------------
// A kernel's large output (from OutputBlocks::FROM bytes) is a mapping of its own, as glibc would
// make it above its mmap threshold, but placed on a huge-page boundary and advised MADV_HUGEPAGE
// as a whole from two huge pages on, so that every page of it comes in one fault (an unaligned
// block's ends fault in 4 KiB at a time), and kept when its last tensor dies for a later output
// that fits it, as PyTorch's CUDA caching allocator keeps device memory: a planner's loop then
// pays the system's page faults and zeroing once, not on every call. The tensors are ordinary
// (storage offset 0, storage size their own, resizable: a resize takes a new block and copies).
// Idle blocks are kept up to a cap (TENSORSTEP_OUTPUT_CACHE_MB, default 1024; 0 keeps none),
// the least recently freed given back first; tensorstep.empty_cache() gives back every idle one.
// Thread-safe (one mutex); a forked child gives back the idle blocks it inherited.
#if defined(__linux__)
// The transparent huge page size in bytes (0: none, or TENSORSTEP_HUGE_PAGES=0), read once.
size_t huge_page_size() {
#if defined(MADV_HUGEPAGE)
  static const size_t size = [] {
    const char* setting = std::getenv("TENSORSTEP_HUGE_PAGES");
    if (setting && std::string(setting) == "0") return size_t{0};
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    size_t n = 0;
    return file >> n ? n : size_t{0};
  }();
  return size;
#else
  return 0;
#endif
}

class OutputBlocks final : public c10::Allocator {
 public:
  static constexpr size_t FROM = size_t{1} << 20;
  static constexpr size_t DEFAULT_LIMIT_MB = 1024;

  // The one instance, never destroyed (tensors may be freed after static destructors have run).
  static OutputBlocks& get() {
    static OutputBlocks* const blocks = new OutputBlocks();
    return *blocks;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < FROM) return c10::GetAllocator(c10::DeviceType::CPU)->allocate(n);  // a resize to a small size
    const size_t size = rounded(n);
    Block* block = take(size);
    if (!block) block = new Block(map(size));
    return {block->base, block, &OutputBlocks::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  // Whether an output of n bytes is a block: from two huge pages on (every page of it huge), and
  // from FROM while blocks are kept (below two huge pages and with none kept, malloc's heap may
  // hold memory already mapped, a new block never does).
  bool takes(size_t n) const {
    const size_t huge = huge_page_size();
    return n >= FROM && ((huge && n >= 2 * huge) || limit_.load(std::memory_order_relaxed) > 0);
  }

  // Idle bytes and blocks, and the cap.
  std::array<int64_t, 3> info() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {static_cast<int64_t>(idle_bytes_), static_cast<int64_t>(by_age_.size()), static_cast<int64_t>(limit_.load())};
  }

  // A new cap (idle blocks beyond it given back); with 0, every idle block.
  void set_limit(size_t limit) { trim(limit, true); }

  // Every idle block given back; the cap stays.
  void empty() { trim(0, false); }

 private:
  struct Block {
    void* base;
    size_t size;
  };

  OutputBlocks() : limit_(limit_from_environment()) {
    pthread_atfork([] { get().mutex_.lock(); }, [] { get().mutex_.unlock(); }, [] {
      OutputBlocks& self = get();  // the child's only thread holds the lock (prepare)
      for (const auto& entry : self.by_age_) munmap(entry.second.base, entry.second.size);
      self.by_age_.clear();
      self.by_size_.clear();
      self.idle_bytes_ = 0;
      self.mutex_.unlock();
    });
  }

  static size_t limit_from_environment() {
    const char* setting = std::getenv("TENSORSTEP_OUTPUT_CACHE_MB");
    if (!setting || !*setting) return DEFAULT_LIMIT_MB << 20;
    char* end = nullptr;
    const long long mb = std::strtoll(setting, &end, 10);
    if (*end || mb < 0) {
      TORCH_WARN("tensorstep: TENSORSTEP_OUTPUT_CACHE_MB='", setting, "' is not a whole number of MiB (0 or more: ",
                 "0 keeps no idle output blocks); the default, ", DEFAULT_LIMIT_MB, " MiB, is used");
      return DEFAULT_LIMIT_MB << 20;
    }
    return static_cast<size_t>(mb) << 20;
  }

  // The idle blocks beyond limit bytes given back (the least recently freed first), the cap set to
  // limit where cap is true.
  void trim(size_t limit, bool cap) {
    std::vector<Block> gone;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (cap) limit_ = limit;
      evict(gone, limit);
    }
    for (const auto& b : gone) munmap(b.base, b.size);
  }

  // Whole huge pages from two on, else whole 4 KiB pages.
  static size_t rounded(size_t n) {
    const size_t huge = huge_page_size(), unit = huge && n >= 2 * huge ? huge : size_t{4096};
    return (n + unit - 1) / unit * unit;
  }

  static Block map(size_t size) {
    const size_t huge = huge_page_size(), extra = huge && size >= 2 * huge ? huge : 0;
    void* p = mmap(nullptr, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      get().empty();  // the idle blocks first, then once more
      p = mmap(nullptr, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "tensorstep: out of memory allocating an output of ", size, " bytes");
    if (!extra) return {p, size};
    const uintptr_t address = reinterpret_cast<uintptr_t>(p), start = (address + huge - 1) / huge * huge;
    if (start > address) munmap(p, start - address);  // the unaligned head and tail of the mapping
    if (address + extra > start) munmap(reinterpret_cast<void*>(start + size), address + extra - start);
#if defined(MADV_HUGEPAGE)
    madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);
#endif
    return {reinterpret_cast<void*>(start), size};
  }

  // An idle block of at least size bytes and at most an eighth more, taken out of the cache.
  Block* take(size_t size) {
    std::lock_guard<std::mutex> guard(mutex_);
    const auto found = by_size_.lower_bound(size);
    if (found == by_size_.end() || found->first > size + size / 8) return nullptr;
    const auto idle = by_age_.find(found->second);
    Block* block = new Block(idle->second);
    idle_bytes_ -= block->size;
    by_age_.erase(idle);
    by_size_.erase(found);
    return block;
  }

  // The last tensor on a block is gone: kept while the cap allows, else given back.
  static void release(void* context) {
    const Block block = *static_cast<Block*>(context);
    delete static_cast<Block*>(context);
    OutputBlocks& self = get();
    std::vector<Block> gone;
    {
      std::lock_guard<std::mutex> guard(self.mutex_);
      const size_t limit = self.limit_.load();
      if (block.size <= limit) {
        self.by_age_.emplace(++self.clock_, block);
        self.by_size_.emplace(block.size, self.clock_);
        self.idle_bytes_ += block.size;
        self.evict(gone, limit);
      } else {
        gone.push_back(block);
      }
    }
    for (const auto& b : gone) munmap(b.base, b.size);
  }

  // Takes the least recently freed idle blocks out until the rest fit in limit bytes (under the lock).
  void evict(std::vector<Block>& gone, size_t limit) {
    while (idle_bytes_ > limit) {
      const auto oldest = by_age_.begin();
      const auto range = by_size_.equal_range(oldest->second.size);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second == oldest->first) {
          by_size_.erase(it);
          break;
        }
      }
      idle_bytes_ -= oldest->second.size;
      gone.push_back(oldest->second);
      by_age_.erase(oldest);
    }
  }

  std::mutex mutex_;
  std::map<uint64_t, Block> by_age_;          // idle blocks by when they were freed
  std::multimap<size_t, uint64_t> by_size_;   // the same, by size
  uint64_t clock_ = 0;
  size_t idle_bytes_ = 0;
  std::atomic<size_t> limit_;
};
#endif

// A kernel's new output: from OutputBlocks::FROM bytes on the CPU, a block of OutputBlocks (above).
Tensor fresh(at::IntArrayRef shape, const at::TensorOptions& options) {
#if defined(__linux__)
  if (options.device().is_cpu()) {
    size_t n = options.dtype().itemsize();
    for (auto s : shape) n *= static_cast<size_t>(s);
    if (OutputBlocks::get().takes(n)) {
      return at::detail::empty_generic(shape, &OutputBlocks::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                       options.dtype().toScalarType(), std::nullopt);
    }
  }
#endif
  return at::empty(shape, options);
}

// runtime/memory.py's empty for a large CPU output.
Tensor empty_output(at::IntArrayRef shape, at::ScalarType dtype) { return fresh(shape, at::TensorOptions().dtype(dtype)); }

// runtime/memory.py's view of the cache: every idle block given back (release), a new cap in bytes
// (limit >= 0); then the idle bytes and blocks and the cap.
std::vector<int64_t> output_cache(int64_t limit, bool release) {
#if defined(__linux__)
  OutputBlocks& blocks = OutputBlocks::get();
  if (release) blocks.empty();
  if (limit >= 0) blocks.set_limit(static_cast<size_t>(limit));
  const auto info = blocks.info();
  return {info.begin(), info.end()};
#else
  return {0, 0, 0};
#endif
}

// ---- CUDA launches: what runtime/cuda_backend.py's Packed does, in C++ ---------------------------
// A handle whose kernels are CUDA (Kernels::cuda) runs an entry point as the launches of the build's
// launch plan (codegen/targets.py Launches): each launch's function handle, grid, block, shared bytes,
// and its parameters as pointers into one array of 8-byte slots (B, the call's arguments, its
// temporaries' addresses, the plan's integers), passed to cuLaunchKernel on PyTorch's current stream of
// the step's device. Python works a (entry point, B) pair's launches out once, on its first call
// (tensorstep_native::cuda_plan: runtime/cuda_backend.py CudaBackend.native_plan), and they are kept
// here, as Packed is kept. The temporaries come from at::empty on the device (the caching allocator,
// in stream order, as Python's). The launch and stream functions are the handle's (Kernels::launch,
// Kernels::stream: a test double's), else the driver's and PyTorch's current stream.
using LaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                             unsigned block_y, unsigned block_z, unsigned shared, void* stream, void** params,
                             void** extra);
using StreamOf = int64_t (*)(int64_t device);  // the raw handle of the current stream on a device

const char* const ENTRY_POINTS[] = {"forward", "adjoint"};
enum Entry : int64_t { FORWARD = 0, ADJOINT = 1 };

// Python's answer, as CudaBackend.native_plan flattens it: arguments, temporaries (count, then
// elements and dtype code each), constants (count, then each), launches (count, then function, grid,
// block, shared bytes, parameter count and positions each).
CudaPlan read_plan(const std::vector<int64_t>& v) {
  CudaPlan plan;
  size_t at = 0;
  auto next = [&]() {
    TORCH_CHECK(at < v.size(), "tensorstep: internal error: a truncated CUDA launch plan");
    return v[at++];
  };
  plan.arguments = next();
  for (int64_t n = next(); n > 0; --n) {
    const int64_t size = next(), code = next();
    TORCH_CHECK(code >= 0 && code < static_cast<int64_t>(TEMPORARY_DTYPES.size()),
                "tensorstep: a temporary's dtype code ", code);
    plan.temporaries.emplace_back(size, TEMPORARY_DTYPES[code]);
  }
  for (int64_t n = next(); n > 0; --n) plan.constants.push_back(next());
  const int64_t slots = plan.arguments + static_cast<int64_t>(plan.temporaries.size() + plan.constants.size());
  for (int64_t n = next(); n > 0; --n) {
    CudaRun run;
    run.function = next();
    run.grid = next();
    run.block = next();
    run.shared = next();
    for (int64_t m = next(); m > 0; --m) {
      run.positions.push_back(next());
      TORCH_CHECK(run.positions.back() >= 0 && run.positions.back() < slots,
                  "tensorstep: internal error: a launch parameter's position past the slots");
    }
    plan.runs.push_back(std::move(run));
  }
  TORCH_CHECK(at == v.size(), "tensorstep: internal error: a CUDA launch plan longer than its counts");
  return plan;
}

std::shared_ptr<const CudaPlan> plan_for(const Kernels& k, Entry entry, int64_t B) {
  CudaPlans& plans = *k.plans;
  const std::pair<int64_t, int64_t> key{entry, B};
  {
    std::lock_guard<std::mutex> guard(plans.mutex);
    const auto found = plans.kept.find(key);
    if (found != plans.kept.end()) return found->second;
    ++plans.asked;
  }
  // asked without the lock held: Python takes the GIL, which another thread may hold while it waits here
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::cuda_plan", "");
  torch::jit::Stack stack{c10::IValue(k.handle), c10::IValue(std::string(ENTRY_POINTS[entry])), c10::IValue(B)};
  op.callBoxed(stack);
  auto plan = std::make_shared<const CudaPlan>(read_plan(stack[0].toIntVector()));
  std::lock_guard<std::mutex> guard(plans.mutex);
  if (plans.kept.emplace(key, plan).second) {
    plans.order.push_back(key);
    if (plans.order.size() > plans.limit) {  // the oldest
      plans.kept.erase(plans.order.front());
      plans.order.pop_front();
    }
  }
  return plan;
}

// The driver's functions, found in libcuda.so.1 at first use (the node links no CUDA library: it is
// built against the CPU headers of any PyTorch): cuLaunchKernel, and what makes a device's primary
// context current on a thread where none is (as the runtime API does on its first call on a thread).
struct Driver {
  LaunchKernel launch = nullptr;
  int (*current)(void**) = nullptr;                // cuCtxGetCurrent
  int (*device)(int*, int) = nullptr;              // cuDeviceGet
  int (*retain)(void**, int) = nullptr;            // cuDevicePrimaryCtxRetain
  int (*make_current)(void*) = nullptr;            // cuCtxSetCurrent
};

const Driver& driver() {
#if defined(__linux__)
  static const Driver found = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib, "tensorstep: the CUDA driver (libcuda.so.1) could not be loaded: ", dlerror());
    Driver d;
    auto symbol = [&](const char* name) {
      void* f = dlsym(lib, name);
      TORCH_CHECK(f, "tensorstep: the CUDA driver has no ", name);
      return f;
    };
    d.launch = reinterpret_cast<LaunchKernel>(symbol("cuLaunchKernel"));
    d.current = reinterpret_cast<int (*)(void**)>(symbol("cuCtxGetCurrent"));
    d.device = reinterpret_cast<int (*)(int*, int)>(symbol("cuDeviceGet"));
    d.retain = reinterpret_cast<int (*)(void**, int)>(symbol("cuDevicePrimaryCtxRetain"));
    d.make_current = reinterpret_cast<int (*)(void*)>(symbol("cuCtxSetCurrent"));
    return d;
  }();
  return found;
#else
  TORCH_CHECK(false, "tensorstep: the native node launches CUDA kernels on Linux only");
#endif
}

void driver_check(int result, const char* what) {
  TORCH_CHECK(result == 0, "tensorstep: ", what, " failed with CUDA driver error ", result);
}

// A thread whose first CUDA work on a device is this launch (an autograd engine thread, say) may have
// no context current: the device's primary context, retained once per device for the process.
void make_context_current(const Driver& d, c10::DeviceIndex index) {
  void* context = nullptr;
  driver_check(d.current(&context), "cuCtxGetCurrent");
  if (context) return;
  static std::mutex mutex;
  static std::map<int, void*> primary;
  {
    std::lock_guard<std::mutex> guard(mutex);
    void*& found = primary[index];
    if (!found) {
      int device = 0;
      driver_check(d.device(&device, index), "cuDeviceGet");
      driver_check(d.retain(&found, device), "cuDevicePrimaryCtxRetain");
    }
    context = found;
  }
  driver_check(d.make_current(context), "cuCtxSetCurrent");
}

// The kernels' anchor (Kernels::anchor), held strongly while they are launched or a graph may launch
// them; an empty storage where the handle has none (C kernels: their libraries stay loaded).
c10::Storage hold(const Kernels& k) {
  if (!k.anchor) return {};
  c10::Storage held(k.anchor->lock());
  TORCH_CHECK(held, "tensorstep: the CUDA kernels of handle ", k.handle, " were freed with their step");
  return held;
}

void launch_cuda(const Kernels& k, Entry entry, int64_t B, const std::vector<void*>& args) {
  const c10::Storage held = hold(k);
  const std::shared_ptr<const CudaPlan> plan = plan_for(k, entry, B);
  TORCH_CHECK(static_cast<int64_t>(args.size()) == plan->arguments, "tensorstep: ", ENTRY_POINTS[entry], " takes ",
              plan->arguments, " arguments after B, given ", args.size());
  c10::OptionalDeviceGuard guard;
  if (k.device.is_cuda()) guard.reset_device(k.device);
  std::vector<Tensor> temporaries;  // kept until the launches are queued
  temporaries.reserve(plan->temporaries.size());
  for (const auto& [size, dtype] : plan->temporaries) {
    temporaries.push_back(at::empty({size}, at::TensorOptions().dtype(dtype).device(k.device)));
  }
  c10::SmallVector<int64_t, 64> slots;  // B, then the values the launches' positions index
  slots.push_back(B);
  for (void* a : args) slots.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(a)));
  for (const auto& t : temporaries) slots.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(ptr(t))));
  slots.append(plan->constants.begin(), plan->constants.end());
  LaunchKernel launch = reinterpret_cast<LaunchKernel>(k.launch);
  if (!launch) {
    const Driver& d = driver();
    make_context_current(d, k.device.index());
    launch = d.launch;
  }
  void* stream = k.stream
      ? reinterpret_cast<void*>(static_cast<intptr_t>(reinterpret_cast<StreamOf>(k.stream)(k.device.index())))
      : c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(k.device).native_handle();
  c10::SmallVector<void*, 32> params;
  for (const auto& run : plan->runs) {
    params.clear();
    params.push_back(&slots[0]);
    for (const auto p : run.positions) params.push_back(&slots[1 + p]);
    const int result = launch(reinterpret_cast<void*>(static_cast<intptr_t>(run.function)),
                              static_cast<unsigned>(run.grid), 1, 1, static_cast<unsigned>(run.block), 1, 1,
                              static_cast<unsigned>(run.shared), stream, params.data(), nullptr);
    TORCH_CHECK(result == 0, "tensorstep: cuLaunchKernel failed with CUDA driver error ", result, " (",
                ENTRY_POINTS[entry], ", B=", B, ")");
  }
}

// A CUDA handle's launches kept, and how many times Python was asked for them.
std::vector<int64_t> cuda_plans(int64_t handle) {
  const Kernels& k = kernels(handle);
  TORCH_CHECK(k.cuda, "tensorstep: handle ", handle, " runs no CUDA kernels");
  std::lock_guard<std::mutex> guard(k.plans->mutex);
  return {static_cast<int64_t>(k.plans->kept.size()), k.plans->asked};
}

// An entry point of a handle's kernels: the C kernel called by address, or the CUDA launches.
void run_entry(const Kernels& k, Entry entry, int64_t B, std::vector<void*>& args) {
  if (k.cuda) return launch_cuda(k, entry, B, args);
  call(entry == FORWARD ? k.forward : k.adjoint, B, args);
}

void run_forward(const Kernels& k, const std::vector<Tensor>& inputs, const std::vector<Tensor>& ys) {
  std::vector<void*> args;
  args.reserve(inputs.size() + ys.size());
  for (const auto& t : inputs) args.push_back(ptr(t));
  for (const auto& y : ys) args.push_back(ptr(y));
  run_entry(k, FORWARD, inputs[0].size(0), args);
}

// Every trajectory's adjoint is the same linear map: dt is one vector for the whole batch (not
// one duration per trajectory), and the outputs' first dimension is the batch.
bool batch_invariant(const Kernels& k) {
  for (auto s : k.rows.back().shape) {
    if (s < 0) return false;
  }
  return !k.output_shape.empty() && k.output_shape[0] == -1;
}

// The adjoint for B trajectories: per-trajectory gradients of the differentiable inputs in table
// order (the first, the actions', always written; the others where needed), from contiguous
// gradients of the outputs (undefined: zero).
template <typename Needs>
variable_list run_adjoint(const Kernels& k, const variable_list& grads, const Tensor& dt, int64_t B,
                          const Needs& needs, at::ArrayRef<Tensor> reads = {}) {
  std::vector<void*> args;
  args.reserve(reads.size() + grads.size() + 1 + k.rows.size());
  for (const auto& t : reads) args.push_back(ptr(t));  // a fused adjoint's inputs (all but dt)
  Tensor like;
  for (const auto& g : grads) {
    if (g.defined()) like = g;
    args.push_back(ptr(g));
  }
  args.push_back(ptr(dt));
  variable_list per_batch;
  per_batch.reserve(k.rows.size());
  const Sizes sizes(k.symbols.size(), B);
  for (size_t i = 0; i < k.rows.size(); ++i) {
    const Row& row = k.rows[i];
    if (!row.differentiable || row.rule != KERNEL_DTYPE) continue;
    per_batch.push_back(per_batch.empty() || needs(i) ? fresh(resolve(row.shape, sizes), like.options()) : Tensor());
    args.push_back(ptr(per_batch.back()));
  }
  run_entry(k, ADJOINT, B, args);
  return per_batch;
}

// ---- the autograd node ------------------------------------------------------------------------
// A plain autograd Node, as PyTorch's own ops have, rather than a torch::autograd::Function,
// whose machinery (a context with a map of saved data, output wrapping and checks) adds work to
// the forward and the backward of every call (docs/benchmarks-history.md, seventeenth session).

// The engine's pointer to a node: std::shared_ptr in older PyTorch, c10::intrusive_ptr since.
using NodePointer = decltype(torch::autograd::Edge::function);

template <typename N>
NodePointer make_node() {
  if constexpr (std::is_same_v<NodePointer, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>();
  } else {
    return c10::make_intrusive<N>();
  }
}

struct NativeStepBackward : public torch::autograd::Node {
  int64_t handle = -1;
  std::vector<int64_t> rows;       // leading size of each table input, 0 when absent
  std::vector<int64_t> positions;  // table position of each differentiable input given (= this node's output edge)
  std::vector<torch::autograd::SavedVariable> kept;  // indices (to sum gradients onto their rows) and dt
  std::vector<int64_t> kept_at;
  // a fused call's cost parameters as its slot kept them (shared, not saved one by one), each with
  // the version of the tensor given for it, compared again before the adjoint reads them
  KeptRows parameters;
  // the CUDA kernels' anchor (Kernels::anchor): their modules stay loaded until this backward ran,
  // however long the graph outlives its step
  c10::Storage anchor;

  std::string name() const override { return "NativeStepBackward"; }

  // A fused step's create_graph backward: its composite form, in Python (runtime/native.py
  // adjoint_graph_fused), which gives each differentiable input's gradient as a whole (an indexed
  // input's rows already summed).
  template <typename Needs>
  variable_list fused_graph(const Kernels& k, const std::vector<Tensor>& saved, const variable_list& grads,
                            const Needs& needs, const std::vector<int64_t>& edge, variable_list out) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::adjoint_graph_fused", "");
    c10::List<std::optional<Tensor>> xs, gl;
    for (size_t i = 0; i + 1 < saved.size(); ++i) xs.push_back(saved[i].defined() ? std::optional<Tensor>(saved[i]) : std::nullopt);
    for (const auto& g : grads) gl.push_back(g.defined() ? std::optional<Tensor>(g) : std::nullopt);
    torch::jit::Stack stack{c10::IValue(handle), c10::IValue(xs), c10::IValue(gl), c10::IValue(saved.back())};
    op.callBoxed(stack);
    const auto got = stack[0].toTensorVector();  // one per differentiable input, table order (empty: none)
    for (size_t i = 0, d = 0; i < k.rows.size(); ++i) {
      if (!k.rows[i].differentiable || k.rows[i].rule != KERNEL_DTYPE) continue;
      const Tensor& g = got[d++];
      if (needs(i) && g.numel()) out[edge[i]] = g;
    }
    return out;
  }

  void release_variables() override {
    for (auto& v : kept) v.reset_data();
    parameters.reset();
    anchor = c10::Storage();
  }

  variable_list apply(variable_list&& grads) override {
    const Kernels& k = kernels(handle);
    const size_t n = k.rows.size();
    variable_list out(positions.size());  // one per given input
    std::vector<int64_t> edge(n, -1);     // table position → output edge
    for (size_t j = 0; j < positions.size(); ++j) edge[positions[j]] = static_cast<int64_t>(j);
    auto needs = [&](size_t i) { return edge[i] >= 0 && task_should_compute_output(edge[i]); };
    TORCH_CHECK(!needs(n - 1), "tensorstep: internal error: dt gradients take the Python path");
    bool any_grad = false, any_need = false;
    for (const auto& g : grads) any_grad = any_grad || g.defined();
    for (size_t i = 0; i < n; ++i) any_need = any_need || (k.rows[i].differentiable && needs(i));
    if (!any_grad || !any_need) return out;

    std::vector<Tensor> saved(n);
    for (size_t s = 0; s < kept_at.size(); ++s) saved[kept_at[s]] = kept[s].unpack();
    if (parameters) {
      for (size_t r = 0; r < k.kept_rows.size(); ++r) {
        const KeptRow& p = (*parameters)[r];
        // the kernels read the given tensor itself (not a copy made when it was kept): written in
        // place since the forward, it no longer holds what the forward read (a SavedVariable's check)
        TORCH_CHECK(!p.given.defined() || !p.given.is_same(p.kernel) || p.given._version() == p.version,
                    k.rows[k.kept_rows[r]].name, ": one of the variables needed for gradient computation has been ",
                    "modified by an inplace operation: the step's forward read it at version ", p.version,
                    ", it is now at version ", p.given._version(), "; pass a copy (.clone()) to change it ",
                    "before the backward");
        saved[k.kept_rows[r]] = p.kernel;
      }
    }
    const Tensor& dt = saved[n - 1];
    const int64_t B = rows[0];
    if (k.fused && at::GradMode::is_enabled()) return fused_graph(k, saved, grads, needs, edge, std::move(out));
    const at::ArrayRef<Tensor> reads = k.fused ? at::ArrayRef<Tensor>(saved.data(), n - 1) : at::ArrayRef<Tensor>();

    variable_list per_batch;  // per-trajectory gradients of the differentiable inputs, in table order
    if (at::GradMode::is_enabled()) {
      // create_graph: the differentiable adjoint (Python AdjointFunction: backward, jvp, vmap)
      static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::adjoint_graph", "");
      c10::List<std::optional<Tensor>> gl;
      for (const auto& g : grads) gl.push_back(g.defined() ? std::optional<Tensor>(g) : std::nullopt);
      torch::jit::Stack stack{c10::IValue(handle), c10::IValue(gl), c10::IValue(dt), c10::IValue(B)};
      op.callBoxed(stack);
      per_batch = stack[0].toTensorVector();
    } else {
      // A gradient with stride 0 along the batch (what .sum() and .mean() losses give) is the same
      // for every trajectory, and so is its adjoint when dt is shared: it is run for one
      // trajectory and broadcast, instead of copying the gradient B times (the adjoint is linear).
      const bool shared = B > 1 && !k.fused && batch_invariant(k);
      variable_list full(grads.size()), once(grads.size());
      bool any_full = false, any_once = false;
      for (size_t j = 0; j < grads.size(); ++j) {
        const Tensor& x = grads[j];
        if (!x.defined()) continue;
        if (shared && x.dim() > 0 && x.stride(0) == 0) {
          once[j] = x.narrow(0, 0, 1).contiguous();
          any_once = true;
        } else {
          full[j] = x.contiguous();
          any_full = true;
        }
      }
      if (any_full) per_batch = run_adjoint(k, full, dt, B, needs, reads);
      if (any_once) {
        const variable_list one = run_adjoint(k, once, dt, 1, needs);
        if (!any_full) per_batch.assign(one.size(), Tensor());
        for (size_t d = 0; d < one.size(); ++d) {
          if (!one[d].defined()) continue;
          if (any_full) {
            per_batch[d].add_(one[d]);  // broadcast over the batch
          } else {
            auto shape = one[d].sizes().vec();
            shape[0] = B;
            per_batch[d] = one[d].expand(shape);  // as PyTorch's own sum backward: no copy
          }
        }
      }
    }

    for (size_t i = 0, d = 0; i < n; ++i) {
      const Row& row = k.rows[i];
      if (!row.differentiable || row.rule != KERNEL_DTYPE) continue;
      const Tensor& g = per_batch[d++];
      if (!needs(i)) continue;
      if (row.index < 0) {  // several trajectories may pick the same row: sum theirs
        out[edge[i]] = g;
      } else {
        auto shape = g.sizes().vec();
        shape[0] = rows[i];
        // (as runtime/rules.py scatter_rows: CUDA's index_add adds with atomics in no fixed order;
        // index_put with accumulate sorts the index stably, the same bits every call)
        Tensor table = at::zeros(shape, g.options());
        out[edge[i]] = g.is_cuda() ? table.index_put({saved[row.index]}, g, /*accumulate=*/true)
                                   : table.index_add(0, saved[row.index], g);
      }
    }
    return out;
  }
};

// The outputs, with the autograd node when a gradient is wanted (never when ``record`` is false:
// the tensorstep::<family> ops run below autograd, which their own autograd kernel handles).
std::vector<Tensor> run_node(const Kernels& k, int64_t handle, const std::vector<Tensor>& inputs, bool record = true,
                             KeptRows parameters = nullptr) {
  std::vector<Tensor> given;
  std::vector<int64_t> positions, rows(k.rows.size(), 0);
  given.reserve(inputs.size());
  positions.reserve(inputs.size());
  bool requires_grad = false;
  size_t saved = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    rows[i] = inputs[i].dim() > 0 ? inputs[i].size(0) : 1;
    saved += (k.fused && !(parameters && k.kept[i])) || k.rows[i].rule != KERNEL_DTYPE;
    requires_grad = requires_grad || inputs[i].requires_grad();
    // an edge only where a gradient can flow: not to an index or a fused step's cost parameters
    if (!k.rows[i].differentiable) continue;
    given.push_back(inputs[i]);
    positions.push_back(static_cast<int64_t>(i));
  }
  const int64_t B = inputs[0].size(0);
  std::vector<Tensor> ys;
  ys.reserve(k.outputs);
  for (const auto& shape : k.output_shapes) ys.push_back(fresh(resolve(shape, {B}), inputs[0].options()));
  run_forward(k, inputs, ys);
  if (!record || !requires_grad || !at::GradMode::is_enabled()) return ys;

  auto node = make_node<NativeStepBackward>();
  auto* step = static_cast<NativeStepBackward*>(node.get());
  torch::autograd::edge_list edges;  // (what function.h's collect_next_edges does)
  edges.reserve(given.size());
  for (const auto& t : given) edges.push_back(torch::autograd::impl::gradient_edge(t));
  step->set_next_edges(std::move(edges));
  step->handle = handle;
  step->anchor = hold(k);
  step->parameters = std::move(parameters);
  step->rows = std::move(rows);
  step->positions = std::move(positions);
  step->kept.reserve(saved);
  step->kept_at.reserve(saved);
  for (size_t i = 0; i < k.rows.size(); ++i) {
    if (step->parameters && k.kept[i]) continue;  // read from the slot's rows (step->parameters)
    if ((k.fused || k.rows[i].rule != KERNEL_DTYPE) && inputs[i].defined()) {  // a fused adjoint reads them all
      step->kept.emplace_back(inputs[i], /*is_output=*/false);
      step->kept_at.push_back(static_cast<int64_t>(i));
    }
  }
  for (auto& y : ys) {  // (functions/utils.h's set_history: the outputs are float tensors)
    const auto output_nr = node->add_input_metadata(y);
    torch::autograd::impl::set_gradient_edge(y, {node, output_nr});
  }
  return ys;
}

// A call checked here rather than in Python (whose checks cost several microseconds per call).
// An empty result means a value is off: the caller's Python checks say which.
std::vector<Tensor> step(int64_t handle, const Given& given, bool record = true, int64_t slot = -1,
                         int64_t held = -1) {
  const Kernels& k = kernels(handle);
  Checked c;
  if (!check(k, given, c, handle, slot, held)) return {};
  return run_node(k, handle, c.inputs, record, std::move(c.kept));
}

bool overlap(const Tensor& a, const Tensor& b) {  // both contiguous CPU tensors
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// out=: a plain call written into caller-owned outputs, with the rules of runtime/validate.py's
// check_out (nothing to differentiate, outputs disjoint from each other and from the inputs).
// False when anything is off: the caller then runs the Python checks, which name the problem.
bool step_out(int64_t handle, const Given& given, const std::vector<Tensor>& out, int64_t slot = -1,
              int64_t held = -1) {
  const Kernels& k = kernels(handle);
  Checked c;
  if (!check(k, given, c, handle, slot, held) || static_cast<int64_t>(out.size()) != k.outputs) return false;
  const bool grad = at::GradMode::is_enabled();
  for (const auto& x : c.inputs) {
    if (grad && x.defined() && x.requires_grad()) return false;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const Tensor& y = out[i];
    const auto shape = resolve(k.output_shapes[i], c.sizes);
    if (!y.defined() || y.layout() != at::kStrided || y.device() != k.device || y.scalar_type() != k.dtype ||
        !y.is_contiguous() || y.sizes() != at::IntArrayRef(shape) || (grad && y.requires_grad()) || y.is_inference() ||
        y.is_neg()) {
      return false;
    }
    for (const auto& x : c.inputs) {
      if (x.defined() && overlap(x, y)) return false;
    }
    for (size_t j = 0; j < i; ++j) {
      if (overlap(out[j], y)) return false;
    }
  }
  run_forward(k, c.inputs, out);
  for (const auto& y : out) y.unsafeGetTensorImpl()->bump_version();  // written in place
  return true;
}

// ---- the ops, as boxed kernels ---------------------------------------------------------------
// Python calls an op with its arguments on a stack (boxed) either way: these read them from
// there, sparing the compiler the templates that unbox typed C++ functions (a good part of the
// node's build time).
using Stack = torch::jit::Stack;

std::vector<std::string> strings(const c10::IValue& v) {
  std::vector<std::string> out;
  for (const auto& s : v.toListRef()) out.push_back(s.toStringRef());
  return out;
}

void register_kernels_boxed(const c10::OperatorHandle&, Stack* stack) {
  constexpr size_t n = 23;
  const auto a = torch::jit::last(*stack, n);
  const int64_t h = register_kernels(a[0].toInt(), a[1].toInt(), strings(a[2]), strings(a[3]), a[4].toIntVector(),
                                     a[5].toIntVector(), a[6].toIntVector(), a[7].toIntVector(), a[8].toIntVector(),
                                     a[9].toIntVector(), a[10].toIntVector(), a[11].toIntVector(), strings(a[12]),
                                     strings(a[13]), a[14].toScalarType(), a[15].toBool(), a[16].toIntVector(),
                                     a[17].toBool(), a[18].toStringRef(), a[19].toInt(), a[20].toInt(), a[21].toInt(),
                                     a[22].toOptional<Tensor>());
  torch::jit::drop(*stack, n);
  stack->emplace_back(h);
}

void step_boxed(const c10::OperatorHandle&, Stack* stack) {
  const auto a = torch::jit::last(*stack, 4);
  std::vector<Tensor> ys = step(a[0].toInt(), a[1].toOptionalTensorList(), true, a[2].toInt(), a[3].toInt());
  torch::jit::drop(*stack, 4);
  stack->emplace_back(std::move(ys));
}

void step_out_boxed(const c10::OperatorHandle&, Stack* stack) {
  const auto a = torch::jit::last(*stack, 5);
  const bool done = step_out(a[0].toInt(), a[1].toOptionalTensorList(), a[2].toTensorVector(), a[3].toInt(),
                             a[4].toInt());
  torch::jit::drop(*stack, 5);
  stack->emplace_back(done);
}

void keep_boxed(const c10::OperatorHandle&, Stack* stack) {
  const auto a = torch::jit::last(*stack, 5);
  keep(a[0].toInt(), a[1].toInt(), a[2].toOptionalTensorList(), a[3].toOptionalTensorList(), a[4].toInt());
  torch::jit::drop(*stack, 5);
}

void new_slot_boxed(const c10::OperatorHandle&, Stack* stack) {
  std::lock_guard<std::mutex> guard(slots_mutex);
  slots.emplace(next_slot, Slot{});
  stack->emplace_back(next_slot++);
}

// ---- the CPU kernels of torch.compile's ops (tensorstep::<family>, runtime/ops.py) --------------
// A compiled graph calls a family's forward op and its adjoint's .needed overload on every call;
// their Python kernels cost more than the kernels themselves at small batches. Once Python binds a
// kernel key to its handle (``bind``), these kernels serve the family's ops on CPU with the checks
// and kernels above. Anything else (a key not bound, a value to explain, a call the step op does
// not take) goes to the ops' Python implementation (tensorstep_native::forward_py, adjoint_py).
std::mutex bound_mutex;
std::unordered_map<std::string, int64_t> bound;  // kernel key → handle
std::set<std::string> claimed;                   // families whose CPU kernels are these

int64_t bound_handle(const std::string& key) {
  std::lock_guard<std::mutex> guard(bound_mutex);
  const auto found = bound.find(key);
  return found == bound.end() ? -1 : found->second;
}

bool has_required(const Kernels& k, const Given& given) {
  for (size_t i = 0; i < k.rows.size() && i < given.size(); ++i) {
    if (k.rows[i].presence == REQUIRED && !given.get(i).has_value()) return false;
  }
  return true;
}

// A forward op's arguments (key, the table's inputs, dt: n on the stack) passed to a Python op
// taking (key, inputs as one list).
void forward_in_python(const c10::OperatorHandle& python, size_t n, Stack* stack) {
  const auto a = torch::jit::last(*stack, n);
  c10::IValue key = a[0];
  Given given;
  for (size_t i = 1; i < n; ++i) given.push_back(a[i].isNone() ? std::nullopt : std::optional<Tensor>(a[i].toTensor()));
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(key));
  stack->emplace_back(std::move(given));
  python.callBoxed(stack);
}

// (key, the table's inputs, dt) -> outputs
void family_forward_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const auto a = torch::jit::last(*stack, n);
  Given given;
  given.reserve(n - 1);
  for (size_t i = 1; i < n; ++i) given.push_back(a[i].isNone() ? std::nullopt : std::optional<Tensor>(a[i].toTensor()));
  const int64_t h = bound_handle(a[0].toStringRef());
  if (h >= 0 && has_required(kernels(h), given)) {
    std::vector<Tensor> ys = step(h, given, /*record=*/false);
    if (!ys.empty()) {
      torch::jit::drop(*stack, n);
      stack->emplace_back(std::move(ys));
      return;
    }
  }
  static const auto python = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::forward_py", "");
  forward_in_python(python, n, stack);
}

// The adjoint's arguments as run_adjoint takes them (contiguous gradients): false when they are
// not what the family's forward gives (the Python implementation then handles them).
bool adjoint_arguments(const Kernels& k, int64_t B, const Given& grads, const Tensor& dt, size_t needed,
                       variable_list& out) {
  size_t differentiable = 0;
  for (const auto& row : k.rows) differentiable += row.differentiable && row.rule == KERNEL_DTYPE;
  if (B <= 0 || needed != differentiable || static_cast<int64_t>(grads.size()) != k.outputs) return false;
  const Sizes sizes(k.symbols.size(), B);
  const auto shape = resolve(k.output_shape, sizes);
  const auto dt_shape = resolve(k.rows.back().shape, sizes);
  if (!dt.defined() || !dt.device().is_cpu() || dt.scalar_type() != k.dtype || !dt.is_contiguous() ||
      dt.sizes() != at::IntArrayRef(dt_shape)) {
    return false;
  }
  bool any = false;
  out.assign(grads.size(), Tensor());
  for (size_t j = 0; j < grads.size(); ++j) {
    const std::optional<Tensor> g = grads.get(j);
    if (!g.has_value()) continue;
    if (g->layout() != at::kStrided || !g->device().is_cpu() || g->scalar_type() != k.dtype ||
        g->sizes() != at::IntArrayRef(shape)) {
      return false;
    }
    out[j] = g->contiguous();
    any = true;
  }
  return any;
}

// (key, batch, grads, dt[, needed]) -> the gradients of the differentiable inputs (those needed)
void family_adjoint_boxed(const c10::OperatorHandle& op, Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const auto a = torch::jit::last(*stack, n);
  const int64_t B = a[1].toInt();
  const Given grads = a[2].toOptionalTensorList();
  const Tensor dt = a[3].toTensor();
  c10::IValue flags = n == 5 ? a[4] : c10::IValue();
  std::vector<bool> needed;
  if (n == 5) {
    for (const bool flag : a[4].toBoolList()) needed.push_back(flag);
  }
  const int64_t h = bound_handle(a[0].toStringRef());
  if (h >= 0) {
    const Kernels& k = kernels(h);
    std::vector<int64_t> slot(k.rows.size(), -1);  // table position → place among the differentiable inputs
    int64_t count = 0;
    for (size_t i = 0; i < k.rows.size(); ++i) {
      if (k.rows[i].differentiable && k.rows[i].rule == KERNEL_DTYPE) slot[i] = count++;
    }
    if (n == 4) needed.assign(count, true);
    variable_list given;
    if (adjoint_arguments(k, B, grads, dt, needed.size(), given)) {
      const variable_list per_batch = run_adjoint(k, given, dt, B, [&](size_t i) { return needed[slot[i]]; });
      std::vector<Tensor> out;
      for (size_t d = 0; d < per_batch.size(); ++d) {
        if (needed[d]) out.push_back(per_batch[d]);
      }
      torch::jit::drop(*stack, n);
      stack->emplace_back(std::move(out));
      return;
    }
  }
  c10::IValue key = a[0];
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(key));
  stack->emplace_back(B);
  stack->emplace_back(grads);
  stack->emplace_back(dt);
  stack->emplace_back(std::move(flags));
  static const auto python = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::adjoint_py", "");
  python.callBoxed(stack);
}

// Their autograd kernels (CPU): a call that wants no gradient (every call a compiled graph makes)
// goes straight to the kernel below autograd; one that does takes the Python autograd kernel
// (runtime/ops.py's autograd.Functions) through tensorstep_native::forward_autograd_py /
// adjoint_autograd_py.
bool wants_grad(at::ArrayRef<c10::IValue> args) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().requires_grad()) return true;
    if (v.isList()) {
      for (const auto& x : v.toListRef()) {
        if (x.isTensor() && x.toTensor().requires_grad()) return true;
      }
    }
  }
  return false;
}

bool below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, Stack* stack) {
  if (wants_grad(torch::jit::last(*stack, op.schema().arguments().size()))) return false;
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  return true;
}

void family_forward_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, Stack* stack) {
  if (below_autograd(op, ks, stack)) return;
  static const auto python = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::forward_autograd_py", "");
  forward_in_python(python, op.schema().arguments().size(), stack);
}

void family_adjoint_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, Stack* stack) {
  if (below_autograd(op, ks, stack)) return;
  if (op.schema().arguments().size() == 4) stack->emplace_back();  // needed: None (every gradient)
  static const auto python = c10::Dispatcher::singleton().findSchemaOrThrow("tensorstep_native::adjoint_autograd_py", "");
  python.callBoxed(stack);
}

// bind(key, handle, family): the key's calls take the handle's kernels; the family's ops take the
// kernels above on CPU (registered once per family, for the life of the process).
void bind_boxed(const c10::OperatorHandle&, Stack* stack) {
  const auto a = torch::jit::last(*stack, 3);
  const std::string key = a[0].toStringRef(), family = a[2].toStringRef();
  const int64_t h = a[1].toInt();
  torch::jit::drop(*stack, 3);
  kernels(h);  // a known handle
  std::lock_guard<std::mutex> guard(bound_mutex);
  if (claimed.insert(family).second) {
    auto* lib = new torch::Library(torch::Library::IMPL, "tensorstep", c10::DispatchKey::CPU, __FILE__, __LINE__);
    lib->impl(family.c_str(), torch::CppFunction::makeFromBoxedFunction<&family_forward_boxed>());
    lib->impl((family + "_adjoint").c_str(), torch::CppFunction::makeFromBoxedFunction<&family_adjoint_boxed>());
    lib->impl((family + "_adjoint.needed").c_str(), torch::CppFunction::makeFromBoxedFunction<&family_adjoint_boxed>());
    auto* grad = new torch::Library(torch::Library::IMPL, "tensorstep", c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
    grad->impl(family.c_str(), torch::CppFunction::makeFromBoxedFunction<&family_forward_autograd>());
    grad->impl((family + "_adjoint").c_str(), torch::CppFunction::makeFromBoxedFunction<&family_adjoint_autograd>());
    grad->impl((family + "_adjoint.needed").c_str(), torch::CppFunction::makeFromBoxedFunction<&family_adjoint_autograd>());
  }
  bound[key] = h;
}

}  // namespace

// A step's slot released (runtime/native.py Slot.__del__): a C function called through ctypes, not an
// op, so that a step collected while another program is traced (torch.export's tracer records every
// op called on its thread) adds nothing to that program.
extern "C" void tensorstep_release_slot(int64_t slot) {
  Slot released;  // its tensors are freed after the lock is given back
  std::lock_guard<std::mutex> guard(slots_mutex);
  const auto found = slots.find(slot);
  if (found != slots.end()) {
    released = std::move(found->second);
    slots.erase(found);
  }
}

// This thread's kernel call wrote no output (runtime/unbuilt.py keep), or that record was taken (1, 0).
extern "C" void tensorstep_unbuilt(int32_t kept) { unbuilt = kept != 0; }

TORCH_LIBRARY(tensorstep_native, m) {
  m.def("register_kernels(int forward, int adjoint, str[] names, str[] meanings, int[] ranks, int[] shapes, "
        "int[] rules, int[] presences, int[] indices, int[] differentiable, int[] output_shapes, "
        "int[] output_ranks, str[] symbols, str[] messages, ScalarType dtype, bool fused, int[] kept, "
        "bool cuda=False, str device=\"cpu\", int launch=0, int stream=0, int plans_kept=0, Tensor? anchor=None) -> int",
        torch::CppFunction::makeFromBoxedFunction<&register_kernels_boxed>());
  m.def("step(int handle, Tensor?[] inputs, int slot=-1, int held=-1) -> Tensor[]");
  m.def("step_out(int handle, Tensor?[] inputs, Tensor(a!)[] out, int slot=-1, int held=-1) -> bool");
  m.def("keep(int handle, int slot, Tensor?[] given, Tensor?[] inputs, int held=-1) -> ()",
        torch::CppFunction::makeFromBoxedFunction<&keep_boxed>());
  m.def("new_slot() -> int", torch::CppFunction::makeFromBoxedFunction<&new_slot_boxed>());
  m.def("bind(str key, int handle, str family) -> ()", torch::CppFunction::makeFromBoxedFunction<&bind_boxed>());
  m.def("empty_output(int[] shape, ScalarType dtype) -> Tensor", &empty_output);
  m.def("output_cache(int limit=-1, bool release=False) -> int[]", &output_cache);
  m.def("cuda_plans(int handle) -> int[]", &cuda_plans);
  // implemented in Python (runtime/native.py): the create_graph adjoint, and the ops' Python path
  m.def("adjoint_graph(int handle, Tensor?[] grads, Tensor dt, int batch) -> Tensor[]");
  m.def("adjoint_graph_fused(int handle, Tensor?[] inputs, Tensor?[] grads, Tensor dt) -> Tensor[]");
  m.def("raise_unbuilt() -> ()");
  m.def("cuda_plan(int handle, str entry, int batch) -> int[]");
  m.def("forward_py(str key, Tensor?[] inputs) -> Tensor[]");
  m.def("adjoint_py(str key, int batch, Tensor?[] grads, Tensor dt, bool[]? needed) -> Tensor[]");
  m.def("forward_autograd_py(str key, Tensor?[] inputs) -> Tensor[]");
  m.def("adjoint_autograd_py(str key, int batch, Tensor?[] grads, Tensor dt, bool[]? needed) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tensorstep_native, CompositeImplicitAutograd, m) {
  m.impl("step", torch::CppFunction::makeFromBoxedFunction<&step_boxed>());
  m.impl("step_out", torch::CppFunction::makeFromBoxedFunction<&step_out_boxed>());
}
