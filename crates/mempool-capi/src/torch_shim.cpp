// The C++ half of mempool's PyTorch allocator (see src/torch.rs): PyTorch 2.11's CUDAPluggableAllocator
// does not check for a null return from its alloc function, but it does propagate a C++ exception, which
// its Python bindings turn into a RuntimeError carrying what() (RMM's allocator relies on the same path).
#include <stdexcept>
#include <string>

extern "C" [[noreturn]] void mempool_cxx_throw(const char* message) {
  throw std::runtime_error(std::string(message ? message : "mempool: allocation failed"));
}
