#pragma once
// Checking a policy's settings when a Synchronizer is built (the optional validate() of the
// policy concepts, concepts.hpp): a setting out of range is an Error naming the policy, the
// setting, its value and what it may be, never undefined behaviour later.

#include <string_view>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::detail {

template <class V>
void check_setting(bool ok, std::string_view policy, std::string_view setting, const V& value, std::string_view range) {
  if (!ok)
    throw Error(ErrorKind::invalid_argument, {.operation = "settings"},
                fmt::format("{}: {} is {}; it must be {}", policy, setting, value, range));
}

// Calls p.validate() where the policy has one.
template <class P>
void validate_policy(const P& p) {
  if constexpr (requires { p.validate(); }) p.validate();
}

}  // namespace gradsync::detail
