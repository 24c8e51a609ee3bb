// Where a backend's tensors live, and what running collectives there takes besides the backend's
// calls: copies, padding, fusion buffers, stand-ins for outputs that could not be allocated, and
// ordering after the front end's work. HostMemory serves every job (CPU copies and scaling, fused
// outputs that view pooled buffers); the NCCL build's CudaMemory serves GPU tensors (copies on a
// stream, no kernels of its own, fused outputs copied out of one buffer). The Executor over them
// (executor.h) fuses, scales and runs every kind of collective the same way for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "collective.h"
#include "common.h"

namespace kerasdist {

inline size_t RoundedUp(size_t bytes, size_t multiple) { return (bytes + multiple - 1) / multiple * multiple; }

class TensorMemory {
 public:
  virtual ~TensorMemory() = default;

  // Fused tensors start at multiples of this many bytes.
  virtual size_t alignment() const = 0;
  // Tensors of more bytes than this are reduced alone, in their own memory, whatever the fusion
  // threshold: the copy into a buffer would cost more than the call it saves.
  virtual size_t largest_fused_bytes() const = 0;
  // True when this memory runs passes of its own over values (scaling, 16-bit conversion). When
  // false the backend must carry every scale while it combines: tensors then fuse only with
  // tensors scaled alike, and compression is refused before negotiation (DeviceHooks::check).
  virtual bool runs_kernels() const = 0;
  // True when a fused output becomes a view of its fusion buffer (AliasFn); false when it gets
  // memory of its own and is copied out, so that the buffer is free again at once.
  virtual bool outputs_view_buffers() const = 0;

  // Orders what this memory and its backend do next after the front end's own work on `c`'s
  // tensors: called before reading its inputs and after each allocation of one of its outputs.
  virtual Status OrderAfterFrontEnd(Collective* c) = 0;
  // `count` values of `from_type` at `from` into `to` as `to_type` (one of them 16-bit when they
  // differ), multiplied by `scale`. Without kernels only equal types and a scale of 1 can be copied.
  virtual Status Copy(void* to, DataType to_type, const void* from, DataType from_type, int64_t count, double scale,
                      const std::string& name) = 0;
  virtual Status Zero(void* data, size_t bytes, const std::string& name) = 0;
  // Called with the memory a tensor reduced alone is reduced in (its output, often its input's
  // own memory) before the backend's call. Host memory asks the kernel for huge pages there;
  // memory with nothing to prepare leaves it alone.
  virtual void PrepareLoneTensor(void* /*data*/, size_t /*bytes*/) {}
  // A buffer of at least `bytes` for one fused group that no live output views, or null when
  // none can be had (`*tried` then says the size asked for); `*transient` may be made its owner,
  // to be freed with the caller's outputs.
  virtual FusionBuffer* BufferFor(size_t bytes, std::unique_ptr<FusionBuffer>* transient, size_t* tried) = 0;
  // `bytes` of memory kept until Synchronize: scratch, or a stand-in for an output the front end
  // could not allocate (this rank still takes part, or the other ranks would wait in the
  // collective for ever). Ends the job if even that memory cannot be had.
  virtual void* Scratch(size_t bytes, const std::string& name) = 0;
  // Returns once what was enqueued on this memory so far is done (a device's copies out), and
  // frees the scratch memory.
  virtual Status Synchronize() = 0;
};

// Output `index` of `c` (`shape` of `dtype`) from the front end, ordered after its work; when it
// cannot be allocated, scratch memory stands in for it and the returned status says why.
inline Status AllocateOutput(TensorMemory& memory, Collective* c, int index, const Shape& shape, DataType dtype,
                             void** out) {
  const Status allocated = c->allocate(index, shape, out);
  if (allocated.ok()) return memory.OrderAfterFrontEnd(c);
  *out = memory.Scratch(NumElements(shape) * DataTypeSize(dtype), c->request.name);
  return allocated;
}

// The factor a collective's values are multiplied by on their way in: its prescale, where the
// memory runs kernels; otherwise the backend carries it with the rest.
inline double ScaleIn(const TensorMemory& memory, const Collective& c) {
  return memory.runs_kernels() ? c.request.prescale : 1.0;
}
// The factor its combined values of `dtype` still need: the finishing scale (postscale, a float
// Average's division), times the prescale where the memory did not apply it.
inline double ScaleAfter(const TensorMemory& memory, const Collective& c, DataType dtype) {
  return c.FinishScale(dtype) * (memory.runs_kernels() ? 1.0 : c.request.prescale);
}

}  // namespace kerasdist
