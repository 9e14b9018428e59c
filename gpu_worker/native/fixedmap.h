// gpu_worker/native/fixedmap.cpp's FixedMap, for the native code that reads and writes one
// (fixedmap.cpp's Python type, jcodec.cpp's replay of a stretch of admissions): a hash table of
// fixed-width byte keys to int64 rows, open addressing with linear probing, sized from the table
// it indexes so that it never grows in service (docs/architecture.md, "Host indexes").
//
// A slot is the stored value plus one (0: an empty slot, so a fresh table is calloc's zeros), then
// the key's bytes, padded to 8. A key's home slot is its hash, CPython's own for bytes (SipHash,
// seeded per process: a tenant that chooses operation keys cannot aim them at one slot), masked.
// Removal shifts the following entries of the cluster back (no tombstones), so a table that lives
// for the life of the device stays as fast as a fresh one.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace aotx {
namespace fixedmap {

constexpr int MAX_WIDTH = 64;  // key bytes
constexpr int MAX_PARTS = 4;
constexpr const char* TYPE_NAME = "aotx_fixedmap.FixedMap";

struct Map {
  PyObject_HEAD
  int width;                // key bytes
  int stride;               // slot bytes: 8 (value + 1), then the key padded to 8
  int parts;                // the key's parts: one is the key itself, more are a tuple's items
  char kinds[MAX_PARTS];    // 'i': an int64 (8 bytes, little-endian), 'b': bytes
  int sizes[MAX_PARTS];     // each part's bytes
  uint64_t mask;            // slots - 1 (a power of two)
  Py_ssize_t used;
  unsigned char* slots;
  Py_buffer memory;         // where the slots are when the map was made in a given buffer (`memory`
  bool borrowed;            // set), else calloc's; the buffer is held until the map grows or goes
};

inline uint64_t hash_of(const Map* m, const unsigned char* key) {
  return uint64_t(_Py_HashBytes(key, m->width));
}

inline unsigned char* slot(const Map* m, uint64_t i) { return m->slots + i * uint64_t(m->stride); }

inline uint64_t stored(const unsigned char* s) {
  uint64_t v;
  memcpy(&v, s, 8);
  return v;
}

// The slot that holds `key`, or the empty slot where it would go (there is always one: at most
// half the slots are used).
inline uint64_t find(const Map* m, const unsigned char* key, uint64_t hash) {
  for (uint64_t i = hash & m->mask;; i = (i + 1) & m->mask) {
    const unsigned char* s = slot(m, i);
    if (stored(s) == 0 || memcmp(s + 8, key, size_t(m->width)) == 0) return i;
  }
}

// The value of `key`, its hash already known, -1 when it is not there.
inline int64_t get_hashed(const Map* m, const unsigned char* key, uint64_t hash) {
  return int64_t(stored(slot(m, find(m, key, hash)))) - 1;
}

inline int64_t get(const Map* m, const unsigned char* key) { return get_hashed(m, key, hash_of(m, key)); }

// A table of `slots` empty slots (a power of two), or nullptr with MemoryError set: calloc's, whose
// pages the kernel maps (zeroed) as they are first written. (2 MiB pages, faulted in when the map
// is made, built a checkpoint's indexes faster on their own but made the whole boot slower here:
// docs/performance.md, "Replay".)
inline unsigned char* allocate(const Map* m, uint64_t slots) {
  void* p = calloc(size_t(slots), size_t(m->stride));
  if (p == nullptr) PyErr_NoMemory();
  return static_cast<unsigned char*>(p);
}

// Twice the slots, every entry placed again: only when more keys went in than the table it indexes
// has rows (which a device never does; the size was chosen from that table's capacity).
inline bool grow(Map* m) {
  const uint64_t old_slots = m->mask + 1, slots = old_slots * 2;
  unsigned char* fresh = allocate(m, slots);
  if (fresh == nullptr) return false;
  unsigned char* old = m->slots;
  m->slots = fresh;
  m->mask = slots - 1;
  for (uint64_t i = 0; i < old_slots; ++i) {
    const unsigned char* s = old + i * uint64_t(m->stride);
    if (stored(s) == 0) continue;
    memcpy(slot(m, find(m, s + 8, hash_of(m, s + 8))), s, size_t(m->stride));
  }
  if (m->borrowed) {
    m->borrowed = false;
    PyBuffer_Release(&m->memory);
  } else {
    free(old);
  }
  return true;
}

// map[key] = value (value >= 0), the key's hash already known; false with an exception set when
// it cannot be stored.
inline bool put_hashed(Map* m, const unsigned char* key, uint64_t hash, int64_t value) {
  if (value < 0 || value == INT64_MAX) {
    PyErr_SetString(PyExc_ValueError, "a FixedMap value is a row: 0 <= value < 2**63 - 1");
    return false;
  }
  uint64_t i = find(m, key, hash);
  unsigned char* s = slot(m, i);
  if (stored(s) == 0) {
    if (uint64_t(m->used + 1) * 2 > m->mask + 1) {
      if (!grow(m)) return false;
      s = slot(m, find(m, key, hash));
    }
    memcpy(s + 8, key, size_t(m->width));
    ++m->used;
  }
  const uint64_t v = uint64_t(value) + 1;
  memcpy(s, &v, 8);
  return true;
}

inline bool put(Map* m, const unsigned char* key, int64_t value) { return put_hashed(m, key, hash_of(m, key), value); }

// Removes `key`, its hash already known: its value, -1 when it was not there.
inline int64_t erase_hashed(Map* m, const unsigned char* key, uint64_t hash) {
  uint64_t i = find(m, key, hash);
  const uint64_t v = stored(slot(m, i));
  if (v == 0) return -1;
  // shift back each later entry of the cluster whose home is not between the hole and it
  for (uint64_t j = (i + 1) & m->mask;; j = (j + 1) & m->mask) {
    unsigned char* s = slot(m, j);
    if (stored(s) == 0) break;
    const uint64_t home = hash_of(m, s + 8) & m->mask;
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    memcpy(slot(m, i), s, size_t(m->stride));
    i = j;
  }
  memset(slot(m, i), 0, size_t(m->stride));
  --m->used;
  return int64_t(v) - 1;
}

inline int64_t erase(Map* m, const unsigned char* key) { return erase_hashed(m, key, hash_of(m, key)); }

// Keys a batch hashes ahead of the one it stores or removes, their home slots prefetched: a table
// of a million entries is far larger than the caches, and one key's slot after another's is a
// cache (and TLB) miss each, which this many in flight at once overlap.
constexpr size_t AHEAD = 16;

inline void prefetch(const Map* m, uint64_t hash) { __builtin_prefetch(slot(m, hash & m->mask), 1); }

// each(i, key, hash) for each of n packed keys in order, the home slots of the keys AHEAD of it
// prefetched, until it returns false. Whether it went through all of them.
template <typename Each>
bool each_hashed(const Map* m, const unsigned char* keys, size_t n, Each each) {
  std::vector<uint64_t> hashes(n);
  for (size_t i = 0; i < n; ++i) hashes[i] = hash_of(m, keys + i * size_t(m->width));
  for (size_t i = 0; i < AHEAD && i < n; ++i) prefetch(m, hashes[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + AHEAD < n) prefetch(m, hashes[i + AHEAD]);
    if (!each(i, keys + i * size_t(m->width), hashes[i])) return false;
  }
  return true;
}

// `o` as a FixedMap whose keys are `width` bytes, or nullptr with TypeError set.
inline Map* check(PyObject* o, int width) {
  PyTypeObject* type = Py_TYPE(o);
  if (strcmp(type->tp_name, TYPE_NAME) != 0 || type->tp_basicsize != Py_ssize_t(sizeof(Map))
      || reinterpret_cast<Map*>(o)->width != width) {
    PyErr_Format(PyExc_TypeError, "a FixedMap of %d-byte keys expected, got %s", width, type->tp_name);
    return nullptr;
  }
  return reinterpret_cast<Map*>(o);
}

// An int64 as a key part, little-endian (the byte order numpy's "<i8" packs the same keys in).
inline void put_int(unsigned char* out, int64_t v) {
  for (int b = 0; b < 8; ++b) out[b] = static_cast<unsigned char>(uint64_t(v) >> (8 * b));
}

}  // namespace fixedmap
}  // namespace aotx
