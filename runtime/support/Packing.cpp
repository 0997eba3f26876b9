//===- Packing.cpp - Static offsets for buffers with lifetimes ------------===//

#include "megaslide/runtime/support/Packing.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

using namespace megaslide;

namespace {

/// Free address ranges below the arena top, coalesced. Indexed both by
/// offset (for coalescing and the tail) and by (size, offset) (for best
/// fit), so every operation is logarithmic in the number of free blocks.
class FreeList {
public:
  /// Returns the offset of the smallest free block of at least `size`
  /// bytes (lowest offset on ties), or -1.
  int64_t takeBestFit(int64_t size) {
    auto best = bySize.lower_bound({size, std::numeric_limits<int64_t>::min()});
    if (best == bySize.end())
      return -1;
    auto [blockSize, offset] = *best;
    erase(offset);
    if (blockSize > size)
      insert(offset + size, blockSize - size);
    return offset;
  }

  /// The free block ending at `top`, if any, is removed and its offset
  /// returned (so a slice can extend the arena from there); else `top`.
  int64_t takeTail(int64_t top) {
    if (byOffset.empty())
      return top;
    auto last = std::prev(byOffset.end());
    if (last->first + last->second != top)
      return top;
    int64_t offset = last->first;
    erase(offset);
    return offset;
  }

  void release(int64_t offset, int64_t size) {
    auto next = byOffset.lower_bound(offset);
    if (next != byOffset.end() && offset + size == next->first) {
      size += next->second;
      next = erase(next->first);
    }
    if (next != byOffset.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        int64_t start = prev->first;
        size += prev->second;
        erase(start);
        insert(start, size);
        return;
      }
    }
    insert(offset, size);
  }

private:
  void insert(int64_t offset, int64_t size) {
    byOffset[offset] = size;
    bySize.insert({size, offset});
  }
  /// Removes the block at `offset`; returns the block after it.
  std::map<int64_t, int64_t>::iterator erase(int64_t offset) {
    auto it = byOffset.find(offset);
    bySize.erase({it->second, offset});
    return byOffset.erase(it);
  }

  std::map<int64_t, int64_t> byOffset;          // offset -> size
  std::set<std::pair<int64_t, int64_t>> bySize; // (size, offset)
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
