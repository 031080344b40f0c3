#pragma once
// The programs' JSON output, through nlohmann::json: strings come out escaped (quotes, backslashes,
// control characters; bytes that are not UTF-8 as U+FFFD) and numbers that are not finite as null.

#include <string>

#include <nlohmann/json.hpp>

#include "gradsync/options.hpp"

namespace gradsync::toolkit {

// Keeps an object's keys in the order they were added, the order the programs have always written.
using Json = nlohmann::ordered_json;

// `value` rounded to `decimals` places, so that a measurement is written with the digits it
// means (NaN and infinities stay as they are, and are written as null).
double rounded(double value, int decimals);

// The double a float reads as: 0.1f is written 0.1, not 0.10000000149011612.
double as_written(float value);

// The text of `value`: an array one element a line, anything else on one line.
std::string json_text(const Json& value);

// Writes json_text(value) to the file at `path`, replacing it.
void write_json(const std::string& path, const Json& value);

// An iteration's schedules per bucket (IterationStats::schedules): what each ran, its predicted
// and its measured time in ms, for the trainers' and benchmarks' --json.
Json schedules_json(const IterationStats& stats);

}  // namespace gradsync::toolkit
