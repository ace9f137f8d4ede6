// tf-ophandlers: the output dtypes an op's OpDef implies. Contracts: op_outputs.h.
#include "kernels/op_outputs.h"

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorflow/c/eager/abstract_op_attrs.h"
#include "tensorflow/c/eager/immediate_execution_operation.h"
#include "tensorflow/c/eager/tfe_op_internal.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"

namespace tf_ophandlers {

namespace {

// Where each flat output dtype of an op comes from, when that follows from its OpDef
// alone: a fixed type (kFixed + the dtype) or the dtype of flat input `index` (an input
// bound to the same type attribute: TensorFlow infers the attribute from, or checks it
// against, that input). An OpDef whose outputs depend on a number or list attribute, or
// on a type attribute no single input carries (Cast's DstT, Shape's out_type), has no
// plan (`ok` false): its dtypes are read from the attributes.
struct OutputPlan {
  bool ok = false;
  absl::InlinedVector<std::pair<int, TF_DataType>, 4> outputs;  // (input index or -1, fixed)
};

OutputPlan MakePlan(const tensorflow::OpDef& def) {
  OutputPlan plan;
  // Flat input index of the first input bound to each type attribute, while every
  // input before it is a single tensor (so flat index = argument index).
  std::vector<std::pair<std::string, int>> from_input;
  for (int i = 0; i < def.input_arg_size(); ++i) {
    const auto& arg = def.input_arg(i);
    if (!arg.number_attr().empty() || !arg.type_list_attr().empty()) break;
    if (!arg.type_attr().empty()) from_input.emplace_back(arg.type_attr(), i);
  }
  for (const auto& arg : def.output_arg()) {
    if (!arg.number_attr().empty() || !arg.type_list_attr().empty() || arg.is_ref()) {
      return OutputPlan();
    }
    if (arg.type() != tensorflow::DT_INVALID) {
      plan.outputs.emplace_back(-1, static_cast<TF_DataType>(arg.type()));
      continue;
    }
    int index = -1;
    for (const auto& f : from_input) {
      if (f.first == arg.type_attr()) {
        index = f.second;
        break;
      }
    }
    if (index < 0) return OutputPlan();
    plan.outputs.emplace_back(index, TF_DataType(0));
  }
  plan.ok = true;
  return plan;
}

// The plan of `def`, from a per-thread cache keyed by the OpDef (OpDefs of the registry
// live as long as the process; the plan depends on nothing else). Bounded: cleared when
// full. Per thread, so no lock and no GIL is needed.
const OutputPlan& PlanFor(const tensorflow::OpDef* def) {
  constexpr size_t kMaxPlans = 1024;
  thread_local std::unordered_map<const tensorflow::OpDef*, OutputPlan> plans;
  auto it = plans.find(def);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();
  return plans.emplace(def, MakePlan(*def)).first->second;
}

template <typename Dtypes>
bool ExpectedOutputsInto(const TFE_Op* op, Dtypes* dtypes) {
  const tensorflow::ImmediateExecutionOperation* iop = tensorflow::unwrap(op);
  const tensorflow::OpDef* def = iop->OpDef();
  if (def == nullptr) {
    // TensorFlow leaves OpDef() unset for some ops (those with list inputs: AddN,
    // ConcatV2, Pack, ...): ask the op registry. Not registered means a function call.
    if (!tensorflow::OpRegistry::Global()->LookUpOpDef(iop->Name(), &def).ok()) return false;
  }
  // The dtypes of the op's own inputs: no attribute lookups. False (nothing added) when
  // the plan does not apply: the attributes are read below.
  auto from_inputs = [&](const OutputPlan& plan) {
    if (!plan.ok) return false;
    size_t start = dtypes->size();
    int n_in = -1;
    for (const auto& o : plan.outputs) {
      if (o.first < 0) {
        dtypes->push_back(o.second);
        continue;
      }
      if (n_in < 0) n_in = static_cast<int>(iop->GetInputs().size());
      if (o.first >= n_in) {  // fewer inputs than the OpDef says: read the attributes
        dtypes->resize(start);
        return false;
      }
      dtypes->push_back(static_cast<TF_DataType>(iop->GetInputs()[o.first]->DataType()));
    }
    return true;
  };
  if (from_inputs(PlanFor(def))) return true;
  const tensorflow::AbstractOpAttrs* attrs = iop->GetOpAttrs();
  // Attributes TensorFlow inferred from the inputs (the T and N of AddN, ConcatV2, Pack,
  // ...) are not visible through the typed getters; read them from the full attr list.
  // Built only when needed (most ops never ask).
  std::unique_ptr<tensorflow::NameAttrList> all;
  auto lookup = [&](const std::string& name) -> const tensorflow::AttrValue* {
    if (all == nullptr) {
      all = std::make_unique<tensorflow::NameAttrList>();
      attrs->GetNameAttrList(all.get());
    }
    auto it = all->attr().find(name);
    return it == all->attr().end() ? nullptr : &it->second;
  };
  for (const auto& arg : def->output_arg()) {
    int64_t n = 1;
    if (!arg.number_attr().empty() && !attrs->GetInt(arg.number_attr(), &n)) {
      const tensorflow::AttrValue* v = lookup(arg.number_attr());
      if (v == nullptr || v->value_case() != tensorflow::AttrValue::kI) return false;
      n = v->i();
    }
    if (arg.type() != tensorflow::DT_INVALID) {
      for (int64_t i = 0; i < n; ++i) dtypes->push_back(static_cast<TF_DataType>(arg.type()));
    } else if (!arg.type_attr().empty()) {
      tensorflow::DataType t;
      if (!attrs->GetType(arg.type_attr(), &t)) {
        const tensorflow::AttrValue* v = lookup(arg.type_attr());
        if (v == nullptr || v->value_case() != tensorflow::AttrValue::kType) return false;
        t = v->type();
      }
      for (int64_t i = 0; i < n; ++i) dtypes->push_back(static_cast<TF_DataType>(t));
    } else if (!arg.type_list_attr().empty()) {
      absl::InlinedVector<tensorflow::DataType, 4> list;
      if (!attrs->GetTypeList(arg.type_list_attr(), &list).ok()) {
        const tensorflow::AttrValue* v = lookup(arg.type_list_attr());
        if (v == nullptr) return false;
        list.clear();
        for (int t : v->list().type()) list.push_back(static_cast<tensorflow::DataType>(t));
      }
      for (auto t : list) dtypes->push_back(static_cast<TF_DataType>(t));
    } else {
      return false;
    }
  }
  return true;
}
}  // namespace

bool ExpectedOutputs(const TFE_Op* op, std::vector<TF_DataType>* dtypes) {
  return ExpectedOutputsInto(op, dtypes);
}

bool ExpectedOutputs(const TFE_Op* op, absl::InlinedVector<TF_DataType, 4>* dtypes) {
  return ExpectedOutputsInto(op, dtypes);
}

bool IsRegisteredOpType(const char* type) {
  const tensorflow::OpDef* def = nullptr;
  return tensorflow::OpRegistry::Global()->LookUpOpDef(type, &def).ok();
}

}  // namespace tf_ophandlers
