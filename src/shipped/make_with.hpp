#pragma once
// How make_synchronizer() reaches the Synchronizers of one codec: make_with<C> is compiled in
// synchronizers.cpp, once per four alternatives of shipped::Codec, so that the shipped
// combinations build side by side and the dispatch (make_synchronizer.cpp) only links them.

#include <memory>

#include "gradsync/shipped.hpp"

namespace gradsync::shipped::detail {

template <class C>
std::unique_ptr<AnySynchronizer> make_with(JobTransport transport, const Options& options, const Bucketing& bucketing,
                                           const C& codec, const Topology& topology);

}  // namespace gradsync::shipped::detail
