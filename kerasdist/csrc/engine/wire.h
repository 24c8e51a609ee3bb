// Byte encoding of the negotiation messages. Ranks run the same binary, so native
// endianness and fixed-width integers are enough.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace kerasdist {

class ByteWriter {
 public:
  template <typename T> void Put(T value) {
    const char* p = reinterpret_cast<const char*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void PutInts(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Put<int64_t>(x);
  }
  std::vector<char>& bytes() { return bytes_; }

 private:
  std::vector<char> bytes_;
};

class ByteReader {
 public:
  ByteReader(const char* data, size_t size) : data_(data), size_(size) {}
  template <typename T> T Get() {
    Need(sizeof(T));
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string GetString() {
    uint32_t n = Get<uint32_t>();
    Need(n);
    std::string s(data_ + pos_, n);
    pos_ += n;
    return s;
  }
  std::vector<int64_t> GetInts() {
    uint32_t n = Get<uint32_t>();
    std::vector<int64_t> v(n);
    for (auto& x : v) x = Get<int64_t>();
    return v;
  }
  bool done() const { return pos_ == size_; }

 private:
  void Need(size_t n) {
    if (pos_ + n > size_) throw std::runtime_error("kerasdist: truncated negotiation message");
  }
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

void WriteRequest(ByteWriter& w, const Request& r);
Request ReadRequest(ByteReader& r);
void WriteResponse(ByteWriter& w, const Response& r);
Response ReadResponse(ByteReader& r);

// The bytes that decide whether a repeated request may reuse a cached response.
std::string RequestSignature(const Request& r);

}  // namespace kerasdist
