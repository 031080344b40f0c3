#include <utility>
#include <variant>

#include "shipped/make_with.hpp"

namespace gradsync {

// Meson compiles synchronizers.cpp for this many codecs, four to a unit.
static_assert(std::variant_size_v<shipped::Codec> == GRADSYNC_SHIPPED_CODECS && GRADSYNC_SHIPPED_CODECS % 4 == 0);

std::unique_ptr<AnySynchronizer> make_synchronizer(JobTransport transport, Options options,
                                                   shipped::Bucketing bucketing, shipped::Codec codec,
                                                   shipped::Topology topology) {
  return std::visit(
      [&](const auto& c) {
        return shipped::detail::make_with(std::move(transport), options, bucketing, c, topology);
      },
      codec);
}

}  // namespace gradsync
