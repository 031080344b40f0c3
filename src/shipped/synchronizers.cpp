// The shipped Synchronizers of four codecs, shipped::Codec's alternatives from
// GRADSYNC_SHIPPED_FIRST_CODEC on, each with every shipped bucketing policy and topology. Meson
// compiles this unit once per four codecs: fewer units than codecs, because each unit also
// instantiates what every codec shares (the transport, the front, the control channel; about
// 6 s of a 2-core machine's core), and more than one, so that they build side by side.

#include <utility>
#include <variant>

#include "gradsync/synchronizer.hpp"
#include "shipped/make_with.hpp"

namespace gradsync::shipped::detail {
namespace {

// The Synchronizer behind AnySynchronizer's calls.
template <class S>
class Erased final : public AnySynchronizer {
 public:
  template <class... Args>
  explicit Erased(Args&&... args) : sync_(std::forward<Args>(args)...) {}

  GradId add(std::string name, TensorView gradient) override { return sync_.add(std::move(name), gradient); }
  void on_averaged(std::function<void(GradId)> update) override { sync_.on_averaged(std::move(update)); }
  void ready(GradId id) override { sync_.ready(id); }
  void wait() override { sync_.wait(); }
  bool try_wait() override { return sync_.try_wait(); }

  int rank() const noexcept override { return sync_.rank(); }
  int size() const noexcept override { return sync_.size(); }
  const Group& group() const noexcept override { return sync_.group(); }
  const Layout& layout() const noexcept override { return sync_.layout(); }
  const BucketPlan& plan() const noexcept override { return sync_.plan(); }
  const IterationStats& last_iteration() const noexcept override { return sync_.last_iteration(); }

 private:
  S sync_;
};

}  // namespace

template <class C>
std::unique_ptr<AnySynchronizer> make_with(JobTransport transport, const Options& options, const Bucketing& bucketing,
                                           const C& codec, const Topology& topology) {
  return std::visit(
      [&]<class B, class T>(const B& b, const T& t) -> std::unique_ptr<AnySynchronizer> {
        return std::make_unique<Erased<Synchronizer<B, C, T, JobTransport>>>(std::move(transport), options, b, codec, t);
      },
      bucketing, topology);
}

// shipped::Codec's alternatives GRADSYNC_SHIPPED_FIRST_CODEC + 0 .. 3.
#define GRADSYNC_SHIP(I)                                                                                        \
  template std::unique_ptr<AnySynchronizer> make_with(                                                         \
      JobTransport, const Options&, const Bucketing&,                                                          \
      const std::variant_alternative_t<GRADSYNC_SHIPPED_FIRST_CODEC + I, Codec>&, const Topology&);
GRADSYNC_SHIP(0)
GRADSYNC_SHIP(1)
GRADSYNC_SHIP(2)
GRADSYNC_SHIP(3)

}  // namespace gradsync::shipped::detail
