#pragma once
#include <cstddef>
#include <cstdint>

namespace luwu {
// CRC-32C of nbytes at data, continuing from a previous result `value`
// (0 to start). Thread-safe; no allocation.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t value = 0);
}  // namespace luwu
