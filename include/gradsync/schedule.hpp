#pragma once
// What a topology produces: the steps one rank performs to allreduce one bucket, as a list in an
// order that respects their dependencies. An executor runs the list; a step that needs a message
// waits for the receive that fills it, and every other dependency is met by list order.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gradsync/launch/environment.hpp"
#include "gradsync/types.hpp"

namespace gradsync {

// The ranks taking part in a collective, with their own numbering: `members` are transport ranks,
// group rank i is members[i], and `rank` is this process's group rank. A Synchronizer built on a
// group (synchronizer.hpp) averages over its members only, and its ranks check at the first
// synchronization that they agree on the members, naming the group (`name`) if they do not.
//
// Machine-local groups follow the launchers' numbering (launch/environment.hpp): machine m holds
// ranks m*L .. m*L+L-1, L = LOCAL_WORLD_SIZE, the same on every machine.
struct Group {
  int rank = 0;
  std::vector<int> members{};
  std::string name = "world";

  int size() const noexcept { return static_cast<int>(members.size()); }
  std::string describe() const;  // "machine 1: ranks 4, 5, 6, 7"
  // Throws Error(invalid_argument) unless this group places transport rank `self` at its own
  // rank and names only ranks of a transport of `transport_size`.
  void check_fits(int self, int transport_size) const;

  // Every rank of a transport of `size` ranks, in transport order.
  static Group world(int rank, int size);
  // An explicit list of transport ranks, numbered in the order given; `self` (this process's
  // transport rank) must be one of them, and none may repeat. Throws Error(invalid_argument).
  static Group of(std::vector<int> members, int self, std::string name);
  // The ranks on this process's machine: its local ranks, numbered by LOCAL_RANK.
  static Group machine(const launch::Launch& launch);
  // One rank of each machine, those with this process's LOCAL_RANK, numbered by machine.
  static Group across_machines(const launch::Launch& launch);
};

// What a schedule needs to know about the codec it will run with.
struct CodecTraits {
  bool identity = false;  // encoded bytes are the values themselves: send and receive in place
  // Not the codec's but the transport's: it matches messages by order and completes them in
  // all-or-nothing groups (transport::Nccl), so a receive listed before sends it does not need
  // can hold them back: list each receive just before the step that uses it, not up front.
  bool receives_at_use = false;
};

inline constexpr std::uint32_t no_slot = std::numeric_limits<std::uint32_t>::max();
inline constexpr std::uint32_t no_step = std::numeric_limits<std::uint32_t>::max();

struct Step {
  enum class Op : std::uint8_t {
    send,         // post a send of `slot` (or of `range` in place) to `peer`
    recv,         // post a receive from `peer` into `slot` (or into `range` in place)
    encode,       // encode `range` into `slot` (a raw slot: copy it there)
    decode_add,   // range += decode(slot) (a raw slot: range += its values)
    decode_copy,  // range = decode(slot) (a raw slot: range = its values)
    average,      // range /= Schedule::contributors
  };
  Op op = Op::send;
  int peer = -1;                  // group index of the peer for send/recv
  std::uint32_t message = 0;      // matches a send to its receive; equal on both sides
  ElemRange range;                // elements of the bucket this step concerns
  std::uint32_t slot = no_slot;   // scratch holding the encoded form of `range`; no_slot = in place
  std::uint32_t after = no_step;  // an earlier send or recv that must have completed first
};

// How a topology's schedule moves one segment of a bucket, for the cost model of selective
// compression (engine/cost_model.hpp): each piece crosses `hops` transfers in sequence, and at each
// a link carries `fan_in` pieces at once.
struct PipelineShape {
  int hops = 0;
  int fan_in = 1;
  std::size_t segment_elements = 0;  // the largest segment
};

// What one message costs between two ranks of the group: latency + bytes * seconds_per_byte.
// topology::Auto predicts its candidates' times with it; the Synchronizer measures it at the first
// synchronization (engine::calibrate_link) and every rank gets the same figures.
struct LinkModel {
  double latency = 50e-6;                   // seconds
  double seconds_per_byte = 1.0 / 1.25e9;   // 10 Gbit/s

  double seconds(double bytes) const noexcept { return latency + bytes * seconds_per_byte; }
};

// Raw slots. A slot normally holds the codec's encoding of its range. A slot marked in `slot_raw`
// holds the range's plain values in the accumulation dtype instead, whatever the codec: it is sized
// elements * sizeof(dtype), encode copies the values in, decode_add and decode_copy add or copy
// them out, and the codec never sees it. A topology uses raw slots for hops that should not be
// compressed inside a compressed bucket (topology::Hierarchical's transfers within a machine); it
// sends such values in place, so only receives land in raw slots. `slot_raw` is empty (no raw
// slot, as Ring and ParameterServer leave it) or has one entry per slot. The executors read it
// through BucketExchange, the one place a slot's bytes are interpreted; the dependency graph does
// not care what a slot holds.
struct Schedule {
  std::vector<Step> steps{};
  std::vector<std::size_t> slot_elements{};  // elements whose encoding each slot must hold
  std::vector<bool> slot_raw{};  // empty, or per slot: holds plain values, not an encoding (above)
  int contributors = 0;  // ranks whose values the average covers: the group, less any dedicated servers

  bool raw(std::uint32_t slot) const noexcept { return slot < slot_raw.size() && slot_raw[slot]; }
};

}  // namespace gradsync
