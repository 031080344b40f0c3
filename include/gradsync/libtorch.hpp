#pragma once
// gradsync::libtorch::AutogradHooks — a Synchronizer driven by LibTorch's autograd, the way
// PyTorch's DistributedDataParallel drives its reducer: each parameter's gradient is marked
// ready() the moment autograd has accumulated it, so its bucket synchronizes while backward
// computes the layers before it.
//
//   gs::Synchronizer<...> sync(transport);
//   gs::libtorch::AutogradHooks hooks(sync, model->named_parameters());
//   for (each step) {
//     hooks.zero();                       // instead of optimizer.zero_grad()
//     loss_fn(model->forward(x), y).backward();   // ready() per parameter, from autograd
//     sync.wait();                        // every .grad now holds the average over the ranks
//     optimizer.step();
//   }
//
// How. Every parameter's .grad becomes a tensor this object owns, registered with the
// Synchronizer in the order given (the same on every rank); autograd accumulates into it in place.
// A post hook on the parameter's gradient accumulator (the AccumulateGrad node, which this object
// keeps alive: autograd holds it only weakly) calls ready() once the accumulation is done. LibTorch
// 1.13 has no public hook that runs after accumulation (register_hook sees the gradient before
// it), hence the accumulator's, which is also what DDP's reducer uses.
//
// Rules. Every registered parameter must receive a gradient in every backward (an unused one is
// never marked ready, and wait() fails naming it), exactly once per step (two backward passes
// before a wait() mark it twice, an Error). zero() rather than optimizer.zero_grad(), which may
// replace the .grad tensors (set_to_none): a hook that finds its parameter's .grad replaced throws,
// naming it, rather than synchronize a buffer nobody reads. Parameters are dense, contiguous CPU
// tensors of f32, f64, f16 or bf16; anything else is refused, by name, before any is registered.
// A parameter listed twice (tied weights) is registered once; one already hooked by another live
// AutogradHooks is refused. The destructor removes the hooks, so a model may outlive them.
//
// Needs LibTorch's headers and libraries; gradsync.hpp does not include this header.

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include "gradsync/error.hpp"
#include "gradsync/types.hpp"

namespace gradsync::libtorch {

namespace detail {

inline DType dtype_of(const torch::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case torch::kFloat: return DType::f32;
    case torch::kDouble: return DType::f64;
    case torch::kHalf: return DType::f16;
    case torch::kBFloat16: return DType::bf16;
    default:
      throw Error(ErrorKind::unsupported, {.operation = "register"},
                  fmt::format("parameter {:?} is of {}: f32, f64, f16 or bf16 only", name,
                              std::string(c10::toString(t.scalar_type()))));
  }
}

// What every AutogradHooks hook is, to find one already on an accumulator.
class HookMark : public torch::autograd::FunctionPostHook {};

// Marks one gradient ready once autograd has accumulated it, if it went where it was registered.
template <class Sync>
class ReadyHook final : public HookMark {
 public:
  ReadyHook(Sync& sync, GradId id, torch::Tensor parameter, const void* gradient, std::string name)
      : sync_(sync), id_(id), parameter_(std::move(parameter)), gradient_(gradient), name_(std::move(name)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (!parameter_.grad().defined() || parameter_.grad().data_ptr() != gradient_)
      throw Error(ErrorKind::invalid_argument, {.operation = "ready"},
                  fmt::format("parameter {:?}: its .grad is no longer the buffer gradsync synchronizes (replaced "
                              "by zero_grad(), create_graph or an assignment?); use AutogradHooks::zero()",
                              name_));
    sync_.ready(id_);
    return outputs;
  }

 private:
  Sync& sync_;
  GradId id_;
  torch::Tensor parameter_;
  const void* gradient_;
  std::string name_;
};

}  // namespace detail

template <class Sync>
class AutogradHooks {
 public:
  // Registers `parameters` with `sync` under their names (model->named_parameters()).
  AutogradHooks(Sync& sync, const torch::OrderedDict<std::string, torch::Tensor>& parameters) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : parameters) named.emplace_back(item.key(), item.value());
    add_all(sync, named);
  }

  // The same for unnamed parameters (model->parameters()), named by their index.
  AutogradHooks(Sync& sync, const std::vector<torch::Tensor>& parameters) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (std::size_t i = 0; i < parameters.size(); ++i) named.emplace_back(fmt::format("parameter {}", i), parameters[i]);
    add_all(sync, named);
  }

  AutogradHooks(const AutogradHooks&) = delete;
  AutogradHooks& operator=(const AutogradHooks&) = delete;

  // Takes the hooks off the accumulators: a backward after this marks nothing.
  ~AutogradHooks() {
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      auto& hooks = accumulators_[i]->post_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hooks_[i]; }),
                  hooks.end());
    }
  }

  // Zeroes every gradient in place, before the next backward.
  void zero() {
    for (auto& g : gradients_) g.zero_();
  }

  std::size_t size() const noexcept { return gradients_.size(); }

 private:
  // Checks every parameter first, so that a refused one leaves nothing registered.
  void add_all(Sync& sync, const std::vector<std::pair<std::string, torch::Tensor>>& named) {
    std::vector<const void*> seen;  // tied weights: the same tensor under two names
    std::vector<std::pair<std::string, torch::Tensor>> unique;
    for (const auto& [name, parameter] : named) {
      const void* impl = parameter.unsafeGetTensorImpl();
      if (std::find(seen.begin(), seen.end(), impl) != seen.end()) continue;
      seen.push_back(impl);
      check(name, parameter);
      unique.emplace_back(name, parameter);
    }
    for (const auto& [name, parameter] : unique) add(sync, name, parameter);
  }

  static void check(const std::string& name, const torch::Tensor& parameter) {
    detail::dtype_of(parameter, name);
    if (!parameter.device().is_cpu() || parameter.is_sparse() || !parameter.is_contiguous() ||
        !parameter.requires_grad() || !parameter.is_leaf())
      throw Error(ErrorKind::unsupported, {.operation = "register"},
                  fmt::format("parameter {:?}: a dense, contiguous CPU leaf tensor that requires a gradient is "
                              "needed (device {}, {}{}{}{})",
                              name, parameter.device().str(), parameter.is_sparse() ? "sparse" : "dense",
                              parameter.is_contiguous() ? "" : ", not contiguous",
                              parameter.requires_grad() ? "" : ", requires_grad false",
                              parameter.is_leaf() ? "" : ", not a leaf"));
    for (const auto& hook : torch::autograd::impl::grad_accumulator(parameter)->post_hooks())
      if (dynamic_cast<const detail::HookMark*>(hook.get()))
        throw Error(ErrorKind::invalid_argument, {.operation = "register"},
                    fmt::format("parameter {:?} is already registered by another live AutogradHooks", name));
  }

  void add(Sync& sync, const std::string& name, const torch::Tensor& parameter) {
    torch::Tensor gradient = torch::zeros_like(parameter, torch::MemoryFormat::Contiguous);
    torch::Tensor target = parameter;  // a handle: the parameter itself
    target.mutable_grad() = gradient;
    const GradId id = sync.add(name, TensorView{gradient.data_ptr(), static_cast<std::size_t>(gradient.numel()),
                                                detail::dtype_of(parameter, name), Device::cpu()});
    auto accumulator = torch::autograd::impl::grad_accumulator(parameter);
    auto hook = std::make_unique<detail::ReadyHook<Sync>>(sync, id, parameter, gradient.data_ptr(), name);
    hooks_.push_back(hook.get());
    accumulator->add_post_hook(std::move(hook));
    accumulators_.push_back(std::move(accumulator));
    gradients_.push_back(std::move(gradient));
  }

  std::vector<torch::Tensor> gradients_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<const torch::autograd::FunctionPostHook*> hooks_;  // per accumulator: the hook this object added
};

}  // namespace gradsync::libtorch
