// Fuzz target: every codec's decode of bytes that came over the wire. The first byte picks the
// codec, the next two the number of values the receiver expects, the rest are the encoded bytes;
// each is decoded into f32 and f64 values, overwriting and adding. Bytes that do not describe
// exactly that many values must be a gradsync::Error (concepts.hpp, CodecFor), never a crash or a
// read past the buffer.

#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <vector>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/random_k.hpp"
#include "gradsync/compression/terngrad.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/error.hpp"

using namespace gradsync;

namespace {

template <class Codec, class T>
void decode(const Codec& codec, std::span<const std::byte> encoded, std::size_t n) {
  if constexpr (CodecFor<Codec, T>) {
    std::vector<T> out(n, T(1));
    for (DecodeMode mode : {DecodeMode::overwrite, DecodeMode::add}) {
      try {
        codec.decode(encoded, std::span<T>(out), mode);
      } catch (const Error&) {
      }
    }
  }
}

const auto codecs = std::tuple{compression::None{}, compression::Fp16{},    compression::Bf16{},
                               compression::TwoBit{}, compression::OneBit{}, compression::TopK{},
                               compression::RandomK{}, compression::TernGrad<>{}};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::size_t which = data[0] % std::tuple_size_v<decltype(codecs)>;
  const std::size_t n = (std::size_t{data[1]} << 8 | data[2]) % 4097;
  // Decoders may read the bytes as words: they start aligned, as in every buffer the library
  // decodes from (concepts.hpp, CodecFor), so they are copied to the heap's alignment first.
  const auto input = std::as_bytes(std::span(data + 3, size - 3));
  const std::vector<std::byte> encoded(input.begin(), input.end());
  std::size_t index = 0;
  std::apply(
      [&](const auto&... codec) {
        ((index++ == which ? (decode<std::decay_t<decltype(codec)>, float>(codec, encoded, n),
                              decode<std::decay_t<decltype(codec)>, double>(codec, encoded, n))
                           : void()),
         ...);
      },
      codecs);
  return 0;
}
