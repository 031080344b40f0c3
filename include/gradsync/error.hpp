#pragma once
// gradsync::Error: the one exception type the library throws. Its message always says which rank
// saw the problem and, where they apply, which peer, bucket and operation were involved, so that a
// failure in a 64-rank job can be traced from any rank's log line alone.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace gradsync {

enum class ErrorKind : std::uint8_t {
  invalid_argument,  // the caller broke an API rule (bad id, ready twice, ...)
  mismatch,          // ranks disagree on gradients or policies
  timeout,           // a wait passed its deadline
  peer_failed,       // another rank failed or went away; this rank cannot go on
  protocol,          // a message had the wrong size, version or contents
  unsupported,       // valid request this build or policy cannot serve
  internal,          // something below gradsync failed (out of memory, a policy threw)
};

std::string_view to_string(ErrorKind kind) noexcept;

// Where an error happened. Fields that do not apply stay empty and are left out of the message.
struct ErrorContext {
  int rank = -1;
  std::optional<int> peer{};
  std::optional<std::uint32_t> bucket{};
  std::string operation{};
};

// Where a failure that spread from rank to rank began: the rank that failed first and what was
// said of it (its own error, or what its peers saw when it died). A rank that fails because
// another did passes this on (transport::Tcp's abort notices carry it), so every rank's Error can
// name the first failure, however many ranks it went through on its way.
struct FailureOrigin {
  int rank = -1;
  std::string cause{};
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, ErrorContext context, std::string detail);

  ErrorKind kind() const noexcept { return kind_; }
  const ErrorContext& context() const noexcept { return context_; }
  // The description without the context prefix.
  const std::string& detail() const noexcept { return detail_; }

  // The same error with the fields it left empty taken from `outer`: a codec does not know its
  // rank or bucket, the layer that called it does. The origin stays.
  Error filled(const ErrorContext& outer) const;

  // Where the failure began, if it began on another rank and the transport knows (FailureOrigin).
  const std::optional<FailureOrigin>& origin() const noexcept { return origin_; }
  Error with_origin(FailureOrigin origin) const;

 private:
  ErrorKind kind_;
  ErrorContext context_;
  std::string detail_;
  std::optional<FailureOrigin> origin_;
};

}  // namespace gradsync
