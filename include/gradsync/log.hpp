#pragma once
// gradsync::LogSink — where the library's messages go.
//
// The library prints little, and nothing per step: the bucketing policy's new plans, selective
// compression's decisions, connections refused during setup. Each message is one line without
// its newline. Options::log (the Synchronizer) and TcpOptions::log (the transport) take a sink;
// by default it is standard error. A trainer that keeps its own logs hands them a lambda; an
// empty sink silences the library.

#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

namespace gradsync {

using LogSink = std::function<void(std::string_view line)>;

// The default sink: the line and a newline on standard error, in one write so that lines of
// several ranks sharing a terminal do not interleave mid-line.
inline void log_to_stderr(std::string_view line) {
  std::string out(line);
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stderr);
}

// Sends `line` to `sink` unless it is empty.
inline void log_line(const LogSink& sink, std::string_view line) {
  if (sink) sink(line);
}

}  // namespace gradsync
