//===- Safetensors.cpp - Reading and writing .safetensors files -----------===//

#include "megaslide/runtime/host/Safetensors.h"

#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"
#include "megaslide/runtime/support/Shape.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/Endian.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/SwapByteOrder.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using llvm::Error;
using llvm::StringRef;

static_assert(llvm::sys::IsLittleEndianHost,
              "tensor bytes are read and written in host order");

namespace {

/// Unit of pread/write and of dtype conversion: large enough to stream at
/// disk speed, small enough not to matter next to the tensors.
constexpr size_t kChunkBytes = 8u << 20;

Error fileError(StringRef path, const llvm::Twine &message) {
  return llvm::createStringError(
      std::make_error_code(std::errc::invalid_argument), "'%s': %s",
      path.str().c_str(), message.str().c_str());
}

Error errnoError(StringRef path, const llvm::Twine &action, int err) {
  std::error_code ec(err, std::generic_category());
  return llvm::createStringError(ec, "cannot %s '%s': %s", action.str().c_str(),
                                 path.str().c_str(), ec.message().c_str());
}

/// Top-level keys of a JSON object text, decoded, in order; llvm::json
/// keeps the last of duplicate keys silently, so they are found here.
/// `text` must already have parsed as a JSON object.
std::vector<std::string> topLevelKeys(StringRef text) {
  std::vector<std::string> keys;
  int depth = 0;
  bool expectKey = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') {
      size_t j = i + 1;
      while (j < text.size() && text[j] != '"')
        j += text[j] == '\\' ? 2 : 1;
      if (depth == 1 && expectKey) {
        llvm::Expected<llvm::json::Value> key =
            llvm::json::parse(text.slice(i, j + 1));
        if (key && key->getAsString())
          keys.push_back(key->getAsString()->str());
        else
          llvm::consumeError(key.takeError());
        expectKey = false;
      }
      i = j;
    } else if (c == '{' || c == '[') {
      ++depth;
      expectKey = depth == 1;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == ',' && depth == 1) {
      expectKey = true;
    }
  }
  return keys;
}

/// Top-level entries of a JSON object text other than "__metadata__" and
/// an upper bound on its values (one per '[', '{', ',' and ':' outside
/// strings, plus the root), counted without parsing and without
/// allocating; counting stops once an entry or value limit is passed.
/// `text` need not be valid JSON.
struct HeaderCounts {
  uint64_t entries = 0, values = 1;
};
HeaderCounts countHeader(StringRef text, uint64_t maxEntries,
                         uint64_t maxValues) {
  HeaderCounts n;
  int64_t depth = 0;
  bool expectKey = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') {
      size_t j = i + 1;
      while (j < text.size() && text[j] != '"')
        j += text[j] == '\\' ? 2 : 1;
      if (depth == 1 && expectKey) {
        if (text.slice(i + 1, j) != "__metadata__" && ++n.entries > maxEntries)
          return n;
        expectKey = false;
      }
      i = j;
      continue;
    }
    if (c == '{' || c == '[' || c == ',' || c == ':')
      if (++n.values > maxValues)
        return n;
    if (c == '{' || c == '[') {
      ++depth;
      expectKey = depth == 1;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == ',' && depth == 1) {
      expectKey = true;
    }
  }
  return n;
}

bool checkedMul(int64_t a, int64_t b, int64_t &out) {
  return !__builtin_mul_overflow(a, b, &out);
}

} // namespace

//===----------------------------------------------------------------------===//
// Element types, conversions, CRC-32C
//===----------------------------------------------------------------------===//

namespace {
struct DTypeRow {
  StDType dtype;
  const char *name;
  int64_t bytes;
};
constexpr DTypeRow kDTypes[] = {
    {StDType::Bool, "BOOL", 1},      {StDType::U8, "U8", 1},
    {StDType::I8, "I8", 1},          {StDType::F8E5M2, "F8_E5M2", 1},
    {StDType::F8E4M3, "F8_E4M3", 1}, {StDType::I16, "I16", 2},
    {StDType::U16, "U16", 2},        {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2},      {StDType::I32, "I32", 4},
    {StDType::U32, "U32", 4},        {StDType::F32, "F32", 4},
    {StDType::F64, "F64", 8},        {StDType::I64, "I64", 8},
    {StDType::U64, "U64", 8},
};
} // namespace

const char *host::stDTypeName(StDType dtype) {
  for (const DTypeRow &row : kDTypes)
    if (row.dtype == dtype)
      return row.name;
  return "?";
}

std::optional<StDType> host::parseStDType(StringRef name) {
  for (const DTypeRow &row : kDTypes)
    if (name == row.name)
      return row.dtype;
  return std::nullopt;
}

int64_t host::stDTypeBytes(StDType dtype) {
  for (const DTypeRow &row : kDTypes)
    if (row.dtype == dtype)
      return row.bytes;
  return 0;
}

int64_t StTensorInfo::numElements() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

namespace {
/// Slicing-by-8 tables of the reflected Castagnoli polynomial.
struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s)
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

uint32_t crc32cSoftware(uint32_t crc, const uint8_t *p, size_t n) {
  static const Crc32cTables tables;
  const auto &t = tables.t;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^
          t[4][lo >> 24] ^ t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^
          t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--)
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t
crc32cSse42(uint32_t crc, const uint8_t *p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--)
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif
} // namespace

uint32_t host::crc32c(uint32_t crc, llvm::ArrayRef<uint8_t> data) {
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hasSse42 = __builtin_cpu_supports("sse4.2");
  if (hasSse42)
    return ~crc32cSse42(crc, data.data(), data.size());
#endif
  return ~crc32cSoftware(crc, data.data(), data.size());
}

//===----------------------------------------------------------------------===//
// Reader
//===----------------------------------------------------------------------===//

SafetensorsReader::~SafetensorsReader() {
  if (fd >= 0)
    ::close(fd);
}

Error SafetensorsReader::readExact(uint64_t offset,
                                   llvm::MutableArrayRef<uint8_t> buf,
                                   StringRef what) const {
  size_t done = 0;
  while (done < buf.size()) {
    ssize_t n = ::pread(fd, buf.data() + done, buf.size() - done,
                        static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return errnoError(filePath, "read " + what + " from", errno);
    }
    if (n == 0)
      return fileError(filePath,
                       llvm::formatv("unexpected end of file reading {0} at "
                                     "byte {1} (the file is truncated)",
                                     what, offset + done));
    done += static_cast<size_t>(n);
  }
  return Error::success();
}

llvm::Expected<std::unique_ptr<SafetensorsReader>>
SafetensorsReader::open(StringRef path) {
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader());
  r->filePath = path.str();
  // Regular files only, opened without blocking: a FIFO named
  // x.safetensors in a data folder would otherwise hang the run.
  llvm::Expected<int> fd = openRegularFile(path, "", r->size);
  if (!fd)
    return fd.takeError();
  r->fd = *fd;

  if (r->size < 8)
    return fileError(path, llvm::formatv("the file is {0} bytes, too short "
                                         "for the 8-byte header length",
                                         r->size));
  uint8_t lengthBytes[8];
  if (Error e = r->readExact(0, lengthBytes, "the header length"))
    return e;
  uint64_t headerLength =
      llvm::support::endian::read64le(static_cast<const void *>(lengthBytes));
  if (headerLength > kMaxSafetensorsHeaderBytes)
    return fileError(path,
                     llvm::formatv("header length {0} exceeds the "
                                   "limit of {1} bytes (not a "
                                   "safetensors file?)",
                                   headerLength, kMaxSafetensorsHeaderBytes));
  if (headerLength > r->size - 8)
    return fileError(path,
                     llvm::formatv("header length {0} runs past the end of "
                                   "the file ({1} bytes; truncated?)",
                                   headerLength, r->size));
  r->dataOffset = 8 + headerLength;
  uint64_t dataSize = r->size - r->dataOffset;

  std::vector<uint8_t> headerBytes(headerLength);
  if (Error e = r->readExact(8, headerBytes, "the header"))
    return e;
  StringRef header(reinterpret_cast<const char *>(headerBytes.data()),
                   headerBytes.size());
  // Counted before parsing: the parse of a header of a million tensors
  // would cost gigabytes before any check could refuse it.
  HeaderCounts counts =
      countHeader(header, kMaxSafetensorsTensors, kMaxSafetensorsHeaderValues);
  if (counts.values > kMaxSafetensorsHeaderValues)
    return fileError(path, llvm::formatv("the header holds more than {0} "
                                         "JSON values, the limit",
                                         kMaxSafetensorsHeaderValues));
  if (counts.entries > kMaxSafetensorsTensors)
    return fileError(path, llvm::formatv("the header lists more than {0} "
                                         "tensors, the limit",
                                         kMaxSafetensorsTensors));
  size_t badUtf8 = 0;
  if (!llvm::json::isUTF8(header, &badUtf8))
    return fileError(path, llvm::formatv("header is not valid UTF-8 (byte "
                                         "{0} of the header)",
                                         badUtf8));
  llvm::Expected<llvm::json::Value> json = parseJson(header);
  if (!json)
    return fileError(path, "header is not valid JSON: " +
                               llvm::toString(json.takeError()));
  const llvm::json::Object *root = json->getAsObject();
  if (!root)
    return fileError(path, "header is not a JSON object");

  std::vector<std::string> keys = topLevelKeys(header);
  llvm::StringSet<> seen;
  for (const std::string &key : keys)
    if (!seen.insert(key).second)
      return fileError(path, "tensor '" + key +
                                 "' appears more than once in the header");

  // Validate in name order so that the first error reported does not
  // depend on hash order.
  std::vector<StringRef> names;
  for (const auto &kv : *root)
    names.push_back(kv.first);
  llvm::sort(names);
  for (StringRef name : names) {
    const llvm::json::Value &value = *root->get(name);
    if (name == "__metadata__") {
      const llvm::json::Object *metaObject = value.getAsObject();
      if (!metaObject)
        return fileError(path, "__metadata__ is not a JSON object");
      for (const auto &kv : *metaObject) {
        std::optional<StringRef> s = kv.second.getAsString();
        if (!s)
          return fileError(path, "__metadata__ field '" + kv.first.str() +
                                     "' is not a string");
        r->meta[kv.first.str()] = s->str();
      }
      continue;
    }
    auto bad = [&](const llvm::Twine &what) {
      return fileError(path, "tensor '" + name + "': " + what);
    };
    const llvm::json::Object *tensor = value.getAsObject();
    if (!tensor)
      return bad("header entry is not a JSON object");
    StTensorInfo info;
    info.name = name.str();

    std::optional<StringRef> dtypeName = tensor->getString("dtype");
    if (!dtypeName)
      return bad("missing string field 'dtype'");
    std::optional<StDType> dtype = parseStDType(*dtypeName);
    if (!dtype)
      return bad("unknown dtype '" + *dtypeName + "'");
    info.dtype = *dtype;

    const llvm::json::Array *shape = tensor->getArray("shape");
    if (!shape)
      return bad("missing array field 'shape'");
    int64_t elements = 1;
    for (const llvm::json::Value &dim : *shape) {
      std::optional<int64_t> d = dim.getAsInteger();
      if (!d || *d < 0)
        return bad("'shape' must hold non-negative integers");
      info.shape.push_back(*d);
      if (!checkedMul(elements, *d, elements))
        return bad("'shape' " + shapeString(info.shape) + " overflows 64 bits");
    }
    int64_t bytes;
    if (!checkedMul(elements, stDTypeBytes(info.dtype), bytes))
      return bad("'shape' " + shapeString(info.shape) + " overflows 64 bits");

    const llvm::json::Array *offsets = tensor->getArray("data_offsets");
    if (!offsets)
      return bad("missing array field 'data_offsets'");
    std::optional<int64_t> begin, end;
    if (offsets->size() == 2) {
      begin = (*offsets)[0].getAsInteger();
      end = (*offsets)[1].getAsInteger();
    }
    if (!begin || !end || *begin < 0 || *end < *begin)
      return bad("'data_offsets' must be [begin, end] with 0 <= begin <= "
                 "end");
    info.begin = static_cast<uint64_t>(*begin);
    info.end = static_cast<uint64_t>(*end);
    if (info.end - info.begin != static_cast<uint64_t>(bytes))
      return bad(llvm::formatv("'data_offsets' [{0}, {1}] span {2} bytes but "
                               "shape {3} of {4} needs {5}",
                               info.begin, info.end, info.end - info.begin,
                               shapeString(info.shape), stDTypeName(info.dtype),
                               bytes));
    if (info.end > dataSize)
      return bad(llvm::formatv("'data_offsets' [{0}, {1}] run past the end "
                               "of the data ({2} bytes; truncated?)",
                               info.begin, info.end, dataSize));
    r->entries.push_back(std::move(info));
  }

  if (r->entries.size() > kMaxSafetensorsTensors)
    return fileError(path, llvm::formatv("the header lists more than {0} "
                                         "tensors, the limit",
                                         kMaxSafetensorsTensors));

  llvm::sort(r->entries, [](const StTensorInfo &a, const StTensorInfo &b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  for (size_t i = 1; i < r->entries.size(); ++i) {
    const StTensorInfo &prev = r->entries[i - 1], &cur = r->entries[i];
    if (cur.begin < prev.end)
      return fileError(path,
                       llvm::formatv("tensor '{0}' (bytes [{1}, {2}]) overlaps "
                                     "tensor '{3}' (bytes [{4}, {5}])",
                                     cur.name, cur.begin, cur.end, prev.name,
                                     prev.begin, prev.end));
  }
  for (size_t i = 0; i < r->entries.size(); ++i)
    r->byName[r->entries[i].name] = i;
  return r;
}

const StTensorInfo *SafetensorsReader::find(StringRef name) const {
  auto it = byName.find(name);
  return it == byName.end() ? nullptr : &entries[it->second];
}

Error SafetensorsReader::readRaw(
    uint64_t offset, uint64_t length,
    llvm::function_ref<void(llvm::ArrayRef<uint8_t>)> onRaw) const {
  std::vector<uint8_t> buf(std::min<uint64_t>(length, kChunkBytes));
  for (uint64_t done = 0; done < length;) {
    size_t n =
        static_cast<size_t>(std::min<uint64_t>(length - done, kChunkBytes));
    llvm::MutableArrayRef<uint8_t> chunk(buf.data(), n);
    if (Error e = readExact(offset + done, chunk, "data"))
      return e;
    onRaw(chunk);
    done += n;
  }
  return Error::success();
}

Error SafetensorsReader::readF32(
    const StTensorInfo &info, llvm::MutableArrayRef<float> out,
    llvm::function_ref<void(llvm::ArrayRef<uint8_t>)> onRaw) const {
  if (static_cast<int64_t>(out.size()) != info.numElements())
    return fileError(filePath,
                     llvm::formatv("tensor '{0}' has {1} elements but the "
                                   "destination holds {2}",
                                   info.name, info.numElements(), out.size()));
  std::string what = "tensor '" + info.name + "'";
  uint64_t start = dataOffset + info.begin;
  switch (info.dtype) {
  case StDType::F32: {
    // Straight into the destination: no staging copy of large tensors.
    auto *bytes = reinterpret_cast<uint8_t *>(out.data());
    uint64_t total = info.end - info.begin;
    for (uint64_t done = 0; done < total;) {
      size_t n =
          static_cast<size_t>(std::min<uint64_t>(total - done, kChunkBytes));
      llvm::MutableArrayRef<uint8_t> chunk(bytes + done, n);
      if (Error e = readExact(start + done, chunk, what))
        return e;
      if (onRaw)
        onRaw(chunk);
      done += n;
    }
    return Error::success();
  }
  case StDType::BF16:
  case StDType::F16: {
    bool bf16 = info.dtype == StDType::BF16;
    std::vector<uint16_t> buf(
        std::min<size_t>(out.size(), kChunkBytes / sizeof(uint16_t)));
    for (size_t done = 0; done < out.size();) {
      size_t n = std::min(out.size() - done, buf.size());
      llvm::MutableArrayRef<uint8_t> chunk(
          reinterpret_cast<uint8_t *>(buf.data()), n * sizeof(uint16_t));
      if (Error e = readExact(start + done * sizeof(uint16_t), chunk, what))
        return e;
      if (onRaw)
        onRaw(chunk);
      float *dst = out.data() + done;
      if (bf16)
        for (size_t i = 0; i < n; ++i)
          dst[i] = cpu::bf16ToFloat(buf[i]);
      else
        for (size_t i = 0; i < n; ++i)
          dst[i] = halfToFloat(buf[i]);
      done += n;
    }
    return Error::success();
  }
  default:
    return fileError(filePath,
                     llvm::formatv("tensor '{0}' has dtype {1}; only F32, "
                                   "BF16 and F16 can be loaded",
                                   info.name, stDTypeName(info.dtype)));
  }
}

//===----------------------------------------------------------------------===//
// Writer
//===----------------------------------------------------------------------===//

Error host::writeFile(StringRef path, StringRef contents, bool sync) {
  return writeFileAtomically(path, contents);
}

Error host::syncDirectory(StringRef path) {
  std::string p = path.str();
  int fd = ::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return errnoError(path, "open directory", errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0)
    return errnoError(path, "fsync directory", err);
  return Error::success();
}

namespace {

/// Checks `tensors` and `options` and returns the padded header; `sizes`
/// receives each tensor's bytes. `path` names the file in errors.
llvm::Expected<std::string>
safetensorsHeader(StringRef path, llvm::ArrayRef<StTensorToWrite> tensors,
                  const SafetensorsWriteOptions &options,
                  std::vector<uint64_t> &sizes) {
  llvm::StringSet<> names;
  for (const StTensorToWrite &t : tensors) {
    auto bad = [&](const llvm::Twine &what) {
      return fileError(path, "cannot write tensor '" + t.name + "': " + what);
    };
    if (t.name.empty() || t.name == "__metadata__" ||
        !llvm::json::isUTF8(t.name))
      return bad("invalid name");
    if (!names.insert(t.name).second)
      return bad("duplicate name");
    if (t.dtype != StDType::F32 && t.dtype != StDType::BF16 &&
        !(t.dtype == StDType::U8 && t.u8))
      return bad(llvm::Twine("dtype ") + stDTypeName(t.dtype) +
                 " cannot be written (F32, BF16, or U8 from bytes)");
    int64_t elements = 1;
    for (int64_t d : t.shape)
      if (d < 0 || !checkedMul(elements, d, elements))
        return bad("invalid shape " + shapeString(t.shape));
    int64_t bytes;
    if (!checkedMul(elements, stDTypeBytes(t.dtype), bytes))
      return bad("invalid shape " + shapeString(t.shape));
    if (elements && !t.data && !t.source && !t.u8 &&
        !(t.bf16 && t.dtype == StDType::BF16))
      return bad("no data");
    sizes.push_back(static_cast<uint64_t>(bytes));
  }
  for (const auto &kv : options.metadata)
    if (!llvm::json::isUTF8(kv.first) || !llvm::json::isUTF8(kv.second))
      return fileError(path, "metadata '" + kv.first + "' is not UTF-8");

  std::string header;
  {
    llvm::raw_string_ostream os(header);
    llvm::json::OStream json(os);
    json.objectBegin();
    if (!options.metadata.empty())
      json.attributeObject("__metadata__", [&] {
        for (const auto &kv : options.metadata)
          json.attribute(kv.first, kv.second);
      });
    uint64_t offset = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const StTensorToWrite &t = tensors[i];
      json.attributeObject(t.name, [&] {
        json.attribute("dtype", stDTypeName(t.dtype));
        json.attributeArray("shape", [&] {
          for (int64_t d : t.shape)
            json.value(d);
        });
        json.attributeArray("data_offsets", [&] {
          json.value(static_cast<int64_t>(offset));
          json.value(static_cast<int64_t>(offset + sizes[i]));
        });
      });
      offset += sizes[i];
    }
    json.objectEnd();
  }
  // As the reference writer: pad with spaces so the data starts 8-aligned.
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

/// Writes the file (length, header, tensor data) into `out`, not
/// committing it; the CRC-32C of every byte goes to `*crcOut` when given.
Error writeSafetensorsData(AtomicFile &out, StringRef header,
                           llvm::ArrayRef<StTensorToWrite> tensors,
                           llvm::ArrayRef<uint64_t> sizes, uint32_t *crcOut) {
  uint32_t crc = 0;
  auto put = [&](const void *data, size_t size) -> Error {
    if (Error e = out.write(data, size))
      return e;
    if (crcOut)
      crc = crc32c(crc, llvm::ArrayRef<uint8_t>(
                            static_cast<const uint8_t *>(data), size));
    return Error::success();
  };
  uint8_t lengthBytes[8];
  llvm::support::endian::write64le(lengthBytes, header.size());
  if (Error e = put(lengthBytes, sizeof(lengthBytes)))
    return e;
  if (Error e = put(header.data(), header.size()))
    return e;
  std::vector<uint16_t> buf;
  std::vector<float> produced;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StTensorToWrite &t = tensors[i];
    if (t.source) { // produced in chunks, then written in its dtype
      int64_t elements = int64_t(sizes[i]) / stDTypeBytes(t.dtype);
      produced.resize(std::min<size_t>(elements, kChunkBytes / sizeof(float)));
      for (int64_t done = 0; done < elements;) {
        int64_t n = std::min<int64_t>(elements - done, produced.size());
        if (Error e = t.source(done, done + n, produced.data()))
          return e;
        if (t.dtype == StDType::F32) {
          if (Error e = put(produced.data(), n * sizeof(float)))
            return e;
        } else {
          buf.resize(n);
          for (int64_t k = 0; k < n; ++k)
            buf[k] = cpu::floatToBf16(produced[k]);
          if (Error e = put(buf.data(), n * sizeof(uint16_t)))
            return e;
        }
        done += n;
      }
      continue;
    }
    // Values stored as they are written go out in chunks, as they are.
    if (const void *raw = t.dtype == StDType::F32
                              ? static_cast<const void *>(t.data)
                          : t.bf16 ? static_cast<const void *>(t.bf16)
                          : t.u8   ? static_cast<const void *>(t.u8)
                                   : nullptr) {
      const auto *bytes = static_cast<const uint8_t *>(raw);
      for (uint64_t done = 0; done < sizes[i];) {
        size_t n = static_cast<size_t>(
            std::min<uint64_t>(sizes[i] - done, kChunkBytes));
        if (Error e = put(bytes + done, n))
          return e;
        done += n;
      }
      continue;
    }
    size_t elements = sizes[i] / sizeof(uint16_t);
    buf.resize(std::min<size_t>(elements, kChunkBytes / sizeof(uint16_t)));
    for (size_t done = 0; done < elements;) {
      size_t n = std::min(elements - done, buf.size());
      for (size_t k = 0; k < n; ++k)
        buf[k] = cpu::floatToBf16(t.data[done + k]);
      if (Error e = put(buf.data(), n * sizeof(uint16_t)))
        return e;
      done += n;
    }
  }
  if (crcOut)
    *crcOut = crc;
  return Error::success();
}

} // namespace

Error host::writeSafetensors(StringRef path,
                             llvm::ArrayRef<StTensorToWrite> tensors,
                             const SafetensorsWriteOptions &options) {
  // Everything is checked before the file is created.
  std::vector<uint64_t> sizes;
  llvm::Expected<std::string> header =
      safetensorsHeader(path, tensors, options, sizes);
  if (!header)
    return header.takeError();
  llvm::Expected<std::unique_ptr<AtomicFile>> file = AtomicFile::create(path);
  if (!file)
    return file.takeError();
  if (Error e =
          writeSafetensorsData(**file, *header, tensors, sizes, options.crc32c))
    return e;
  return (*file)->commit();
}

Error host::writeSafetensors(AtomicFile &file,
                             llvm::ArrayRef<StTensorToWrite> tensors,
                             const SafetensorsWriteOptions &options) {
  std::vector<uint64_t> sizes;
  llvm::Expected<std::string> header =
      safetensorsHeader(file.path(), tensors, options, sizes);
  if (!header)
    return header.takeError();
  return writeSafetensorsData(file, *header, tensors, sizes, options.crc32c);
}
