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
// never marked ready, and wait() times out naming it), exactly once per step (two backward passes
// before a wait() mark it twice, an Error). zero() rather than optimizer.zero_grad(), which may
// replace the .grad tensors (set_to_none). Parameters are dense, contiguous CPU tensors of f32,
// f64, f16 or bf16; anything else is refused with the parameter's name.
//
// Needs LibTorch's headers and libraries; gradsync.hpp does not include this header.

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

// Marks one gradient ready once autograd has accumulated it.
template <class Sync>
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(Sync& sync, GradId id) : sync_(sync), id_(id) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    sync_.ready(id_);
    return outputs;
  }

 private:
  Sync& sync_;
  GradId id_;
};

}  // namespace detail

template <class Sync>
class AutogradHooks {
 public:
  // Registers `parameters` with `sync` under their names (model->named_parameters()).
  AutogradHooks(Sync& sync, const torch::OrderedDict<std::string, torch::Tensor>& parameters) {
    for (const auto& item : parameters) add(sync, item.key(), item.value());
  }

  // The same for unnamed parameters (model->parameters()), named by their index.
  AutogradHooks(Sync& sync, const std::vector<torch::Tensor>& parameters) {
    for (std::size_t i = 0; i < parameters.size(); ++i) add(sync, fmt::format("parameter {}", i), parameters[i]);
  }

  AutogradHooks(const AutogradHooks&) = delete;
  AutogradHooks& operator=(const AutogradHooks&) = delete;

  // Zeroes every gradient in place, before the next backward.
  void zero() {
    for (auto& g : gradients_) g.zero_();
  }

  std::size_t size() const noexcept { return gradients_.size(); }

 private:
  void add(Sync& sync, const std::string& name, torch::Tensor parameter) {
    const DType dtype = detail::dtype_of(parameter, name);
    if (!parameter.device().is_cpu() || parameter.is_sparse() || !parameter.is_contiguous() ||
        !parameter.requires_grad())
      throw Error(ErrorKind::unsupported, {.operation = "register"},
                  fmt::format("parameter {:?}: a dense, contiguous CPU tensor that requires a gradient is needed "
                              "(device {}, {}{}{})",
                              name, parameter.device().str(), parameter.is_sparse() ? "sparse" : "dense",
                              parameter.is_contiguous() ? "" : ", not contiguous",
                              parameter.requires_grad() ? "" : ", requires_grad false"));
    torch::Tensor gradient = torch::zeros_like(parameter, torch::MemoryFormat::Contiguous);
    parameter.mutable_grad() = gradient;
    const GradId id = sync.add(name, TensorView{gradient.data_ptr(), static_cast<std::size_t>(gradient.numel()),
                                                dtype, Device::cpu()});
    auto accumulator = torch::autograd::impl::grad_accumulator(parameter);
    accumulator->add_post_hook(std::make_unique<detail::ReadyHook<Sync>>(sync, id));
    accumulators_.push_back(std::move(accumulator));
    gradients_.push_back(std::move(gradient));
  }

  std::vector<torch::Tensor> gradients_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace gradsync::libtorch
