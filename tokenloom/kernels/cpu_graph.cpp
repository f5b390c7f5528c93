// A recorded op list, replayed from C++: the CPU's counterpart of a CUDA graph (runner/cpu_graphs.py).
//
// A batch-1 decode step on a CPU is a few hundred dispatcher calls around a stream of weights.
// Made from Python, each costs microseconds of interpreter and argument parsing before its kernel
// starts; replayed from here, each is one boxed dispatcher call.  The list is recorded once per
// batch size by running the forward under a dispatch mode (Python does that: it sees every op,
// its arguments and its outputs) and handed over op by op:
//
//   * an argument that an earlier op of the list produced is a *slot*: the template keeps a
//     placeholder and the replay puts that op's output there (also inside a tensor list);
//   * every other argument is a constant kept in the template: weights, the KV caches, the
//     persistent input buffers the runner refills before each replay, scalars;
//   * each op's tensor outputs fill slots; a slot is dropped after its last reader, so a replay
//     holds no more intermediates alive than the eager forward does.
//
// The engine runs in a thread beside the server's event loop: a call of `run` from Python
// (a TorchScript class method) replays with the GIL released (tests/test_cpu_graphs.py checks).

#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

struct Patch {
  int64_t arg;   // which argument
  int64_t elem;  // which element of a list argument, or -1: the argument itself
  int64_t slot;  // whose output goes there
};

struct Step {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // the template: constants, placeholders where patches go
  std::vector<Patch> patches;
  std::vector<int64_t> outputs;  // a slot per flattened output (tensors and list elements), -1: not kept
  std::vector<int64_t> release;  // slots last read by this op
};

struct OpList : torch::CustomClassHolder {
  std::vector<Step> steps;
  int64_t num_slots = 0;
  int64_t result = -1;

  // One op, in order.  `args`: every schema argument, positionally (the recorder fills in
  // defaults and keyword arguments); patched positions may hold the record-time value, which
  // is dropped here.
  void add(const std::string& name, const std::string& overload, c10::List<c10::IValue> args,
           std::vector<int64_t> patch_arg, std::vector<int64_t> patch_elem, std::vector<int64_t> patch_slot,
           std::vector<int64_t> outputs, std::vector<int64_t> release) {
    TORCH_CHECK(patch_arg.size() == patch_elem.size() && patch_arg.size() == patch_slot.size(), "patch lists differ");
    Step s{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()), {}, {}, {}, {}};
    TORCH_CHECK(args.size() == s.op.schema().arguments().size(), name, ".", overload, ": ", args.size(),
                " arguments for a schema of ", s.op.schema().arguments().size());
    const auto& schema_args = s.op.schema().arguments();
    for (size_t i = 0; i < args.size(); ++i) {
      c10::IValue a = args.get(i);
      // A Python number where the schema takes a tensor (`x - 8`): the dispatch mode sees the
      // number; the kernel takes it as PyTorch's argument parser passes it, a wrapped number.
      if (schema_args[i].type()->kind() == c10::TypeKind::TensorType && (a.isInt() || a.isDouble() || a.isBool())) {
        at::Tensor t = c10::scalar_to_tensor(a.toScalar());
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        a = t;
      }
      // A list of tensors where the schema takes optional ones (an index with no holes):
      // the element type the kernel's unboxing checks for.
      if (a.isTensorList()) {
        const auto want = schema_args[i].type()->cast<c10::ListType>();
        if (want && want->getElementType()->kind() == c10::TypeKind::OptionalType) {
          c10::impl::GenericList list(want->getElementType());
          for (const at::Tensor& t : a.toTensorVector()) list.push_back(t);
          a = list;
        }
      }
      s.args.push_back(std::move(a));
    }
    for (size_t i = 0; i < patch_arg.size(); ++i) {
      const Patch p{patch_arg[i], patch_elem[i], patch_slot[i]};
      TORCH_CHECK(p.arg >= 0 && p.arg < int64_t(s.args.size()) && p.slot >= 0, "bad patch");
      c10::IValue& a = s.args[p.arg];
      if (p.elem < 0) {
        a = c10::IValue();
      } else {
        TORCH_CHECK(a.isList() && p.elem < int64_t(a.toListRef().size()), "bad list patch");
        auto list = a.toList();
        list.set(p.elem, c10::IValue());  // keeps its element type; the replay fills a copy
      }
      s.patches.push_back(p);
      num_slots = std::max(num_slots, p.slot + 1);
    }
    for (int64_t o : outputs) num_slots = std::max(num_slots, o + 1);
    s.outputs = std::move(outputs);
    s.release = std::move(release);
    steps.push_back(std::move(s));
  }

  void set_result(int64_t slot) {
    TORCH_CHECK(slot >= 0 && slot < num_slots, "no such slot");
    result = slot;
  }

  int64_t size() const { return int64_t(steps.size()); }

  at::Tensor run() {
    TORCH_CHECK(result >= 0, "the op list has no result");
    std::vector<c10::IValue> slots(num_slots);
    torch::jit::Stack stack;
    for (const Step& s : steps) {
      stack.assign(s.args.begin(), s.args.end());
      for (size_t i = 0; i < s.patches.size(); ++i) {
        const Patch& p = s.patches[i];
        if (p.elem < 0) {
          stack[p.arg] = slots[p.slot];
          continue;
        }
        // a list argument: patched in a copy (the template's list is shared), copied once
        if (i == 0 || s.patches[i - 1].arg != p.arg) stack[p.arg] = s.args[p.arg].toList().copy();
        stack[p.arg].toList().set(p.elem, slots[p.slot]);
      }
      s.op.callBoxed(&stack);
      size_t k = 0;
      auto keep = [&](c10::IValue v) {
        TORCH_CHECK(k < s.outputs.size(), s.op.schema().name(), " returned more than was recorded");
        const int64_t slot = s.outputs[k++];
        if (slot >= 0) slots[slot] = std::move(v);
      };
      for (c10::IValue& r : stack) {
        if (r.isTensorList()) {
          for (const at::Tensor& t : r.toTensorVector()) keep(t);
        } else {
          keep(std::move(r));
        }
      }
      for (int64_t slot : s.release) slots[slot] = c10::IValue();
    }
    return slots[result].toTensor();
  }
};

}  // namespace

TORCH_LIBRARY(tokenloom_graph, m) {
  m.class_<OpList>("OpList")
      .def(torch::init<>())
      .def("add", &OpList::add)
      .def("set_result", &OpList::set_result)
      .def("size", &OpList::size)
      .def("run", &OpList::run);
}
