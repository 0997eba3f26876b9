//===- Packing.cpp - Static offsets for buffers with lifetimes ------------===//

#include "megaslide/Analysis/Packing.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>
#include <map>

using namespace megaslide;

namespace {

/// Free address ranges below the arena top, coalesced.
class FreeList {
public:
  /// Returns the offset of the smallest free block of at least `size`
  /// bytes (lowest offset on ties), or -1.
  int64_t takeBestFit(int64_t size) {
    auto best = blocks.end();
    for (auto it = blocks.begin(); it != blocks.end(); ++it)
      if (it->second >= size &&
          (best == blocks.end() || it->second < best->second))
        best = it;
    if (best == blocks.end())
      return -1;
    int64_t offset = best->first, remaining = best->second - size;
    blocks.erase(best);
    if (remaining > 0)
      blocks[offset + size] = remaining;
    return offset;
  }

  /// The free block ending at `top`, if any, is removed and its offset
  /// returned (so a slice can extend the arena from there); else `top`.
  int64_t takeTail(int64_t top) {
    if (blocks.empty())
      return top;
    auto last = std::prev(blocks.end());
    if (last->first + last->second != top)
      return top;
    int64_t offset = last->first;
    blocks.erase(last);
    return offset;
  }

  void release(int64_t offset, int64_t size) {
    auto next = blocks.lower_bound(offset);
    if (next != blocks.end() && offset + size == next->first) {
      size += next->second;
      next = blocks.erase(next);
    }
    if (next != blocks.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += size;
        return;
      }
    }
    blocks[offset] = size;
  }

private:
  std::map<int64_t, int64_t> blocks; // offset -> size
};

} // namespace

Packing megaslide::packSlices(llvm::ArrayRef<Slice> slices, int64_t alignment) {
  Packing result;
  result.offsets.assign(slices.size(), 0);
  std::vector<size_t> byStart(slices.size()), byEnd(slices.size());
  for (size_t i = 0; i < slices.size(); ++i)
    byStart[i] = byEnd[i] = i;
  // Same start: largest first, then index, for determinism.
  llvm::sort(byStart, [&](size_t a, size_t b) {
    if (slices[a].start != slices[b].start)
      return slices[a].start < slices[b].start;
    if (slices[a].size != slices[b].size)
      return slices[a].size > slices[b].size;
    return a < b;
  });
  llvm::sort(byEnd, [&](size_t a, size_t b) {
    return std::make_pair(slices[a].end, a) < std::make_pair(slices[b].end, b);
  });

  FreeList free;
  int64_t top = 0;
  size_t nextEnd = 0;
  for (size_t i : byStart) {
    const Slice &s = slices[i];
    // Slices whose last use came before this one's first are dead.
    for (; nextEnd < byEnd.size() && slices[byEnd[nextEnd]].end < s.start;
         ++nextEnd) {
      size_t dead = byEnd[nextEnd];
      if (slices[dead].size > 0)
        free.release(result.offsets[dead],
                     alignTo(slices[dead].size, alignment));
    }
    int64_t size = alignTo(s.size, alignment);
    if (size == 0)
      continue;
    int64_t offset = free.takeBestFit(size);
    if (offset < 0) {
      offset = free.takeTail(top);
      top = offset + size;
    }
    result.offsets[i] = offset;
    result.arenaSize = std::max(result.arenaSize, offset + size);
  }
  return result;
}

int64_t megaslide::peakLiveBytes(llvm::ArrayRef<Slice> slices,
                                 int64_t alignment) {
  std::vector<std::pair<int64_t, int64_t>> events; // (time, +/- bytes)
  for (const Slice &s : slices) {
    events.push_back({s.start, alignTo(s.size, alignment)});
    events.push_back({s.end + 1, -alignTo(s.size, alignment)});
  }
  // At equal times, frees (negative) come first.
  llvm::sort(events);
  int64_t live = 0, peak = 0;
  for (auto [time, delta] : events) {
    live += delta;
    peak = std::max(peak, live);
  }
  return peak;
}
