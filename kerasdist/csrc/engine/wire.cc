#include "wire.h"

namespace kerasdist {

namespace {

// The fields every rank must send alike for a name: all but the execution and the wait.
void WriteSignature(ByteWriter& w, const Request& r) {
  w.PutString(r.name);
  w.Put<uint8_t>(static_cast<uint8_t>(r.kind));
  w.Put<uint8_t>(static_cast<uint8_t>(r.reduce_op));
  w.Put<int32_t>(r.root_rank);
  w.Put<double>(r.prescale);
  w.Put<double>(r.postscale);
  w.Put<uint32_t>(static_cast<uint32_t>(r.tensors.size()));
  for (const auto& t : r.tensors) {
    w.Put<uint8_t>(static_cast<uint8_t>(t.dtype));
    w.PutInts(t.shape);
    w.Put<uint8_t>(static_cast<uint8_t>(t.wire));
  }
  w.PutInts(r.splits);
  w.Put<uint8_t>(static_cast<uint8_t>(r.device));
  w.Put<uint8_t>(r.blocking ? 1 : 0);
  w.PutString(r.error);
}

}  // namespace

void WriteRequest(ByteWriter& w, const Request& r) {
  WriteSignature(w, r);
  w.Put<int64_t>(r.execution);
  w.Put<double>(r.waited_s);
}

Request ReadRequest(ByteReader& in) {
  Request r;
  r.name = in.GetString();
  r.kind = static_cast<OpKind>(in.Get<uint8_t>());
  r.reduce_op = static_cast<ReduceOp>(in.Get<uint8_t>());
  r.root_rank = in.Get<int32_t>();
  r.prescale = in.Get<double>();
  r.postscale = in.Get<double>();
  r.tensors.resize(in.Get<uint32_t>());
  for (auto& t : r.tensors) {
    t.dtype = static_cast<DataType>(in.Get<uint8_t>());
    t.shape = in.GetInts();
    t.wire = static_cast<DataType>(in.Get<uint8_t>());
  }
  r.splits = in.GetInts();
  r.device = static_cast<Device>(in.Get<uint8_t>());
  r.blocking = in.Get<uint8_t>() != 0;
  r.error = in.GetString();
  r.execution = in.Get<int64_t>();
  r.waited_s = in.Get<double>();
  return r;
}

void WriteResponse(ByteWriter& w, const Response& r) {
  w.PutString(r.name);
  w.Put<uint8_t>(static_cast<uint8_t>(r.status.code));
  w.PutString(r.status.message);
  w.Put<int32_t>(r.cache_id);
  w.PutInts(r.rank_rows);
  w.PutInts(r.alltoall_rows);
  w.Put<int32_t>(r.contributors);
  w.PutInts(r.zero_ranks);
  w.PutString(r.spec);
  w.Put<int32_t>(r.last_joined_rank);
}

Response ReadResponse(ByteReader& in) {
  Response r;
  r.name = in.GetString();
  r.status.code = static_cast<StatusCode>(in.Get<uint8_t>());
  r.status.message = in.GetString();
  r.cache_id = in.Get<int32_t>();
  r.rank_rows = in.GetInts();
  r.alltoall_rows = in.GetInts();
  r.contributors = in.Get<int32_t>();
  r.zero_ranks = in.GetInts();
  r.spec = in.GetString();
  r.last_joined_rank = in.Get<int32_t>();
  return r;
}

std::string RequestSignature(const Request& r) {
  ByteWriter w;
  WriteSignature(w, r);
  return std::string(w.bytes().begin(), w.bytes().end());
}

}  // namespace kerasdist
