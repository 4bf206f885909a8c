// The one description of a forward call that the engine hands to a model:
// which rows belong to which sequence, their positions, where their keys and
// values go in the paged cache, which rows need logits. Built only through
// add_sequence, so the derived arrays always agree with each other.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"

namespace dflash {

// How a sequence's rows use its Gated DeltaNet state (hybrid targets; other models ignore it).
struct StateUse {
  int32_t slot = -1;    // its slot in the RecurrentCache (-1: none)
  int32_t replay = 0;   // tape rows (its last uncommitted forward's accepted rows) to fold in first
  bool commit = true;   // false: a verification block, whose rows go to the tape
};

struct ForwardBatch {
  int page_size = 0;
  std::vector<int32_t> token_ids;   // one per row (unused for draft context projection)
  std::vector<int32_t> positions;   // one per row
  std::vector<int32_t> kv_slots;    // physical cache slot per row
  std::vector<AttentionSegment> segments;
  std::vector<RecurrentSegment> recurrent;  // one per sequence given a state slot
  std::vector<int32_t> logit_rows;  // rows whose logits are wanted, in output order
  // Rows whose tokens are on the device (e.g. drafted by the forward before): their token_ids
  // entries are placeholders. Empty ids: none.
  DeviceTokens from_device;
  const DeviceTokens* device_tokens() const { return from_device.ids.empty() ? nullptr : &from_device; }

  explicit ForwardBatch(int page_size_) : page_size(page_size_) {}

  // Appends `tokens` of one sequence at positions n_past.. . `page_table` must
  // cover n_past + tokens.size() positions and outlive the batch. causal=false
  // lets every row see every key of the sequence (DFlash draft block). `state`: its recurrent
  // state (hybrid targets; a sequence starting at position 0 starts from a zero state).
  // Returns the index of the sequence's first row.
  int32_t add_sequence(const std::vector<int32_t>& tokens, int32_t n_past, const std::vector<int32_t>& page_table,
                       bool causal = true, StateUse state = {});
  int32_t n_rows() const { return static_cast<int32_t>(positions.size()); }

  // Sizes every sequence's attention launches for `keys` keys (>= each one's n_keys; its page
  // table padded with page 0 past the pages it has), so that a graph captured for this batch
  // serves later steps with more keys, up to `keys`.
  void set_key_capacity(int32_t keys);

 private:
  std::vector<std::shared_ptr<std::vector<int32_t>>> padded_tables_;  // segments point into these
};

}  // namespace dflash
