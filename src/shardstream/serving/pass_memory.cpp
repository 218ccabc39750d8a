// A CPU allocator for torch that keeps the large blocks freed during a forward pass and hands them
// out again to later allocations they fit within that pass (see pass_memory.py for why).
//
// Blocks of 1 MiB or more are allocated here (from 2 MiB on 2 MiB-aligned, and advised for transparent
// huge pages when torch would be, THP_MEM_ALLOC_ENABLE=1); smaller ones go to the allocator installed
// before. Between `pass_memory_begin()` and the matching `pass_memory_end()` (passes may overlap on
// several threads), a freed large block is kept, by size, instead of being freed, and an allocation
// takes the smallest kept block that fits if it is under twice its size; the last `pass_memory_end()`
// frees every kept block.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

namespace {

constexpr size_t kLarge = size_t(1) << 20;
constexpr size_t kGranule = size_t(64) << 10;
constexpr size_t kHugePage = size_t(2) << 20;

struct State {
  std::mutex lock;
  std::multimap<size_t, void*> kept;        // size -> a block free for reuse
  std::unordered_map<void*, size_t> sizes;  // every large block we allocated and not freed
  size_t reused = 0;
  int passes = 0;  // passes running: while any is, freed large blocks are kept
  bool huge_pages = false;
};
// Never destroyed: torch may still free (or allocate) a tensor while static objects are destroyed at exit.
State& state = *new State();

void give_back(void* block) {
  std::lock_guard<std::mutex> guard(state.lock);
  auto found = state.sizes.find(block);
  if (state.passes > 0) {
    state.kept.emplace(found->second, block);
    return;
  }
  state.sizes.erase(found);
  std::free(block);
}

void raw_free(void* block);

struct PassMemoryAllocator final : c10::Allocator {
  c10::Allocator* fallback = nullptr;

  c10::DataPtr allocate(size_t n) override {
    if (n < kLarge) return fallback->allocate(n);
    size_t size = (n + kGranule - 1) / kGranule * kGranule;
    {
      std::lock_guard<std::mutex> guard(state.lock);
      auto found = state.kept.lower_bound(size);   // the smallest kept block that fits, if under twice the size
      if (found != state.kept.end() && found->first < 2 * size) {
        void* block = found->second;
        state.kept.erase(found);
        ++state.reused;
        return {block, block, &give_back, c10::Device(c10::DeviceType::CPU)};
      }
    }
    void* block = nullptr;
    if (posix_memalign(&block, size >= kHugePage ? kHugePage : 64, size) != 0) throw std::bad_alloc();
    if (state.huge_pages && size >= kHugePage) madvise(block, size, MADV_HUGEPAGE);
    std::lock_guard<std::mutex> guard(state.lock);
    state.sizes[block] = size;
    return {block, block, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  // Some kernels allocate raw pointers (raw_allocate) and free them through this deleter.
  c10::DeleterFnPtr raw_deleter() const override { return &raw_free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PassMemoryAllocator& allocator = *new PassMemoryAllocator();  // torch keeps a pointer to it

void raw_free(void* block) {
  bool ours;
  {
    std::lock_guard<std::mutex> guard(state.lock);
    ours = state.sizes.count(block) != 0;
  }
  if (ours) {
    give_back(block);
  } else {
    allocator.fallback->raw_deallocate(block);
  }
}

}  // namespace

extern "C" {

void pass_memory_install(int advise_huge_pages) {
  if (allocator.fallback != nullptr) return;
  state.huge_pages = advise_huge_pages != 0;
  allocator.fallback = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&allocator, /*priority=*/1);
}

void pass_memory_begin() {
  std::lock_guard<std::mutex> guard(state.lock);
  ++state.passes;
}

void pass_memory_end() {
  std::lock_guard<std::mutex> guard(state.lock);
  if (--state.passes > 0) return;
  for (auto& [size, block] : state.kept) {
    state.sizes.erase(block);
    std::free(block);
  }
  state.kept.clear();
}

size_t pass_memory_reused() {
  std::lock_guard<std::mutex> guard(state.lock);
  return state.reused;
}

}  // extern "C"
