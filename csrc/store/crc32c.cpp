// CRC-32C (Castagnoli) for the NVMe tier's per-chunk checksums.
//
// Chunks are 1-64 MiB and are checksummed on every write and (optionally)
// every read, so the checksum must run far faster than the disk: the SSE4.2
// crc32 instruction gives ~10+ GB/s per core. It is chosen at run time so the
// module still loads on CPUs without it (table-driven fallback).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "store/crc32c.h"

namespace luwu {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
  }
};

uint32_t crc32c_table(uint32_t crc, const uint8_t* p, size_t n) {
  static const Table table;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of 3 cycles and a throughput of 1, so
// one stream of it runs at ~8 GB/s. The node protocol checksums every payload
// on both ends of a ~3 GB/s loopback, where that is most of the cost; three
// independent streams over three blocks keep the unit busy (~3x), and the
// blocks' CRCs are joined by "shifting" one past the next block's zeros: the
// CRC register is linear over GF(2), so crc(A || B) = shift_|B|(crc(A)) ^ crc(B).

// shift_n as a table of 4 x 256 entries, one per byte of the register.
struct Shift {
  uint32_t t[4][256];
  explicit Shift(size_t nbytes) {
    // The operator of one zero bit is a 32x32 GF(2) matrix; square it up to n bytes.
    uint32_t op[32], sq[32];
    op[0] = kPoly;  // bit 0 of the reflected register shifts out through the polynomial
    for (int i = 1; i < 32; ++i) op[i] = 1u << (i - 1);
    uint32_t acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = 1u << i;  // identity
    size_t bits = nbytes * 8;
    while (bits) {
      if (bits & 1) multiply(acc, op);
      square(op, sq);
      std::memcpy(op, sq, sizeof op);
      bits >>= 1;
    }
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = apply(acc, b << (8 * k));
  }
  static uint32_t apply(const uint32_t* m, uint32_t v) {
    uint32_t r = 0;
    for (int i = 0; v; ++i, v >>= 1)
      if (v & 1) r ^= m[i];
    return r;
  }
  static void square(const uint32_t* m, uint32_t* out) {
    for (int i = 0; i < 32; ++i) out[i] = apply(m, m[i]);
  }
  static void multiply(uint32_t* acc, const uint32_t* m) {  // acc = m . acc
    uint32_t r[32];
    for (int i = 0; i < 32; ++i) r[i] = apply(m, acc[i]);
    std::memcpy(acc, r, sizeof r);
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

constexpr size_t kLong = 8192, kShort = 256;

__attribute__((target("sse4.2"))) uint64_t one_stream(uint64_t c, const uint8_t* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

template <size_t kBlock>
__attribute__((target("sse4.2"))) uint64_t three_streams(uint64_t c0, const uint8_t*& p, size_t& n,
                                                        const Shift& shift) {
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t a, b, d;
      std::memcpy(&a, p + i, 8);
      std::memcpy(&b, p + kBlock + i, 8);
      std::memcpy(&d, p + 2 * kBlock + i, 8);
      c0 = __builtin_ia32_crc32di(c0, a);
      c1 = __builtin_ia32_crc32di(c1, b);
      c2 = __builtin_ia32_crc32di(c2, d);
    }
    c0 = shift(shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return c0;
}

uint32_t crc32c_hw(uint32_t crc, const uint8_t* p, size_t n) {
  static const Shift long_shift(kLong), short_shift(kShort);
  uint64_t c = crc;
  c = three_streams<kLong>(c, p, n, long_shift);
  c = three_streams<kShort>(c, p, n, short_shift);
  return static_cast<uint32_t>(one_stream(c, p, n));
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t nbytes, uint32_t value) {
  // Standard CRC-32C: pre- and post-inverted, so value chains across calls.
  uint32_t crc = ~value;
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return ~crc32c_hw(crc, p, nbytes);
#endif
  return ~crc32c_table(crc, p, nbytes);
}

}  // namespace luwu
