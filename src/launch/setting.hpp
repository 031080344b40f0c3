#pragma once
// A transport's own GRADSYNC_* number settings, read the same way by every transport: absent is
// nullopt, anything but a whole number within [low, high] an Error naming the variable. Private
// to the library; compiled in environment.cpp.

#include <optional>
#include <string_view>

namespace gradsync::launch {

std::optional<long> number_setting(std::string_view name, long low, long high);

}  // namespace gradsync::launch
