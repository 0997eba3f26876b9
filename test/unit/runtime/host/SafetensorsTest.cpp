//===- SafetensorsTest.cpp - Safetensors files ----------------------------===//
//
// host/Safetensors (runtime): round trips in F32 and BF16, streamed in
// chunks, and F16 reading; every structural check of untrusted files (each
// on a hand-made file), the header limits checked before parsing, and the
// CRC-32C that checkpoints and the writer share.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/HostTestSupport.h"

#include "megaslide/runtime/host/Safetensors.h"

#include "megaslide/runtime/cpu/HalfFloat.h"

#include "llvm/Support/Endian.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"

#include "gtest/gtest.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using namespace megaslide::host::test;
using llvm::StringRef;

namespace {

class SafetensorsTest : public ScratchDirTest {};

/// A safetensors file from a raw header and data, for malformed inputs.
std::string rawFile(StringRef header, StringRef data,
                    std::optional<uint64_t> length = std::nullopt) {
  std::string out(8, '\0');
  llvm::support::endian::write64le(out.data(),
                                   length ? *length : header.size());
  return out + header.str() + data.str();
}

TEST(Crc32c, KnownValues) {
  auto crcOf = [](StringRef s) {
    return crc32c(
        0, llvm::ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(s.data()),
                                   s.size()));
  };
  EXPECT_EQ(crcOf("123456789"), 0xE3069283u);
  EXPECT_EQ(crcOf(std::string(32, '\0')), 0x8A9136AAu); // RFC 3720 B.4
  EXPECT_EQ(crcOf(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(crcOf(""), 0u);
  // Incremental, across every split point and odd lengths.
  std::string text = "The quick brown fox jumps over the lazy dog, twice!";
  uint32_t whole = crcOf(text);
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    auto a = llvm::ArrayRef<uint8_t>(
        reinterpret_cast<const uint8_t *>(text.data()), text.size());
    EXPECT_EQ(crc32c(crc32c(0, a.take_front(cut)), a.drop_front(cut)), whole);
  }
}

TEST_F(SafetensorsTest, RoundTripF32AndBf16) {
  std::vector<float> a = {
      1.0f,    -2.5f, 1.0f + 1.0f / 1024,
      3.0e38f, -0.0f, std::numeric_limits<float>::denorm_min()};
  std::vector<float> b = {0.1f, 0.2f, 0.3f};
  float c = 42.0f;
  for (StDType dtype : {StDType::F32, StDType::BF16}) {
    std::string file = path(std::string("rt-") + stDTypeName(dtype));
    uint32_t crc = 0;
    SafetensorsWriteOptions options;
    options.metadata = {{"format", "pt"}, {"note", "h\xc3\xa9llo \"q\""}};
    options.crc32c = &crc;
    ASSERT_EQ(errorText(writeSafetensors(file,
                                         {{"a", {2, 3}, a.data(), dtype},
                                          {"b.weight", {3}, b.data(), dtype},
                                          {"scalar", {}, &c, dtype},
                                          {"none", {0, 5}, nullptr, dtype}},
                                         options)),
              "");
    std::string bytes = readAll(file);
    EXPECT_EQ(crc,
              crc32c(0, llvm::ArrayRef<uint8_t>(
                            reinterpret_cast<const uint8_t *>(bytes.data()),
                            bytes.size())));

    auto reader = SafetensorsReader::open(file);
    ASSERT_TRUE(!!reader) << llvm::toString(reader.takeError());
    const SafetensorsReader &r = **reader;
    EXPECT_EQ(r.dataStart() % 8, 0u);
    EXPECT_EQ(r.metadata().at("note"), "h\xc3\xa9llo \"q\"");
    ASSERT_EQ(r.tensors().size(), 4u);
    // Data order is write order.
    EXPECT_EQ(r.tensors()[0].name, "a");
    const StTensorInfo *ia = r.find("a");
    ASSERT_NE(ia, nullptr);
    EXPECT_EQ(ia->dtype, dtype);
    EXPECT_EQ(ia->shape, (std::vector<int64_t>{2, 3}));
    std::vector<float> got(6);
    ASSERT_EQ(errorText(r.readF32(*ia, got)), "");
    for (size_t i = 0; i < a.size(); ++i) {
      float want = dtype == StDType::F32
                       ? a[i]
                       : cpu::bf16ToFloat(cpu::floatToBf16(a[i]));
      EXPECT_EQ(std::memcmp(&got[i], &want, 4), 0) << i;
    }
    std::vector<float> gotC(1);
    ASSERT_EQ(errorText(r.readF32(*r.find("scalar"), gotC)), "");
    EXPECT_EQ(gotC[0], 42.0f);
    std::vector<float> none;
    ASSERT_EQ(errorText(r.readF32(*r.find("none"), none)), "");
    // Wrong destination size.
    std::vector<float> small(2);
    EXPECT_NE(errorText(r.readF32(*ia, small)).find("destination"),
              std::string::npos);
  }
}

TEST_F(SafetensorsTest, LargeTensorsStreamInChunks) {
  // Over the 8 MiB I/O chunk in both dtypes, not a multiple of it.
  std::vector<float> big(4'500'001);
  for (size_t i = 0; i < big.size(); ++i)
    big[i] = static_cast<float>(i) * 1.0009765625f - 7.0f;
  float tail = -1.0f;
  for (StDType dtype : {StDType::F32, StDType::BF16}) {
    std::string file = path("big");
    uint32_t crc = 0;
    SafetensorsWriteOptions options;
    options.crc32c = &crc;
    ASSERT_EQ(
        errorText(writeSafetensors(
            file,
            {{"big", {static_cast<int64_t>(big.size())}, big.data(), dtype},
             {"tail", {1}, &tail, dtype}},
            options)),
        "");
    auto reader = SafetensorsReader::open(file);
    ASSERT_TRUE(!!reader);
    const SafetensorsReader &r = **reader;
    std::vector<float> got(big.size());
    uint32_t readCrc = 0;
    ASSERT_EQ(errorText(r.readRaw(0, r.dataStart(),
                                  [&](llvm::ArrayRef<uint8_t> b) {
                                    readCrc = crc32c(readCrc, b);
                                  })),
              "");
    ASSERT_EQ(errorText(r.readF32(*r.find("big"), got,
                                  [&](llvm::ArrayRef<uint8_t> b) {
                                    readCrc = crc32c(readCrc, b);
                                  })),
              "");
    std::vector<float> gotTail(1);
    ASSERT_EQ(errorText(r.readF32(*r.find("tail"), gotTail,
                                  [&](llvm::ArrayRef<uint8_t> b) {
                                    readCrc = crc32c(readCrc, b);
                                  })),
              "");
    // Raw bytes seen while reading, in file order, are the whole file.
    EXPECT_EQ(readCrc, crc);
    EXPECT_EQ(gotTail[0], -1.0f);
    size_t wrong = 0;
    for (size_t i = 0; i < big.size(); ++i) {
      float want = dtype == StDType::F32
                       ? big[i]
                       : cpu::bf16ToFloat(cpu::floatToBf16(big[i]));
      wrong += std::memcmp(&got[i], &want, 4) != 0;
    }
    EXPECT_EQ(wrong, 0u) << stDTypeName(dtype);
  }
}

TEST_F(SafetensorsTest, ReadsF16AndRejectsIntegerDtypes) {
  std::string data;
  for (uint16_t h : {0x3C00, 0xC000, 0x0001, 0x7C00}) {
    data.push_back(static_cast<char>(h & 0xFF));
    data.push_back(static_cast<char>(h >> 8));
  }
  data += std::string(8, '\x01');
  writeAll(path("f16"),
           rawFile(R"({"h":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},)"
                   R"("i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})",
                   data));
  auto reader = SafetensorsReader::open(path("f16"));
  ASSERT_TRUE(!!reader) << llvm::toString(reader.takeError());
  std::vector<float> got(4);
  ASSERT_EQ(errorText((*reader)->readF32(*(*reader)->find("h"), got)), "");
  EXPECT_EQ(got, (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24),
                                     std::numeric_limits<float>::infinity()}));
  std::vector<float> one(1);
  std::string e = errorText((*reader)->readF32(*(*reader)->find("i"), one));
  EXPECT_NE(e.find("'i' has dtype I64"), std::string::npos) << e;
}

struct BadFile {
  const char *what;
  std::string bytes;
  std::vector<const char *> expected; ///< substrings of the error
};

TEST_F(SafetensorsTest, RejectsMalformedFiles) {
  std::string eight(8, '\0');
  auto entry = [](const char *name, const char *dtype, const char *shape,
                  const char *offsets) {
    return std::string("\"") + name + "\":{\"dtype\":\"" + dtype +
           "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
  };
  std::string good = "{" + entry("w", "F32", "[2]", "[0,8]") + "}";
  std::vector<BadFile> cases = {
      {"short", "abc", {"too short for the 8-byte header length"}},
      {"header length past EOF",
       rawFile(good, eight, good.size() + 100),
       {"header length", "runs past the end of the file"}},
      {"huge header length",
       rawFile(good, eight, uint64_t(1) << 62),
       {"exceeds the limit"}},
      {"truncated data",
       rawFile(good, eight.substr(0, 5)),
       {"tensor 'w'", "run past the end of the data", "truncated"}},
      {"not JSON", rawFile("{\"w\": [", eight), {"not valid JSON"}},
      {"not an object", rawFile("[1, 2]", eight), {"not a JSON object"}},
      {"bad UTF-8", rawFile("{\"\xff\": 1}", eight), {"not valid UTF-8"}},
      {"bad dtype",
       rawFile("{" + entry("w", "F17", "[2]", "[0,8]") + "}", eight),
       {"tensor 'w'", "unknown dtype 'F17'"}},
      {"missing dtype",
       rawFile(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight),
       {"tensor 'w'", "'dtype'"}},
      {"negative shape",
       rawFile("{" + entry("w", "F32", "[-2]", "[0,8]") + "}", eight),
       {"tensor 'w'", "'shape'"}},
      {"shape/offset mismatch",
       rawFile("{" + entry("w", "F32", "[3]", "[0,8]") + "}", eight),
       {"tensor 'w'", "span 8 bytes", "needs 12"}},
      {"reversed offsets",
       rawFile("{" + entry("w", "F32", "[0]", "[8,0]") + "}", eight),
       {"tensor 'w'", "'data_offsets'"}},
      {"three offsets",
       rawFile("{" + entry("w", "F32", "[2]", "[0,8,8]") + "}", eight),
       {"tensor 'w'", "'data_offsets'"}},
      {"overlapping",
       rawFile("{" + entry("a", "F32", "[2]", "[0,8]") + "," +
                   entry("b", "BF16", "[2]", "[4,8]") + "}",
               eight),
       {"tensor 'b'", "overlaps tensor 'a'"}},
      {"duplicate",
       rawFile("{" + entry("a", "F32", "[1]", "[0,4]") + "," +
                   entry("a", "F32", "[1]", "[4,8]") + "}",
               eight),
       {"tensor 'a' appears more than once"}},
      {"duplicate escaped",
       rawFile("{" + entry("ab", "F32", "[1]", "[0,4]") + "," +
                   entry("a\\u0062", "F32", "[1]", "[4,8]") + "}",
               eight),
       {"tensor 'ab' appears more than once"}},
      {"metadata not strings",
       rawFile(R"({"__metadata__":{"format":3}})", ""),
       {"__metadata__ field 'format'"}},
      {"overflowing shape",
       rawFile("{" + entry("w", "F32", "[4294967296,4294967296,4]", "[0,8]") +
                   "}",
               eight),
       {"tensor 'w'", "overflows"}},
  };
  for (const BadFile &c : cases) {
    std::string file = path("bad.safetensors");
    writeAll(file, c.bytes);
    auto reader = SafetensorsReader::open(file);
    ASSERT_FALSE(!!reader) << c.what;
    std::string e = llvm::toString(reader.takeError());
    EXPECT_NE(e.find(file), std::string::npos) << c.what << ": " << e;
    for (const char *s : c.expected)
      EXPECT_NE(e.find(s), std::string::npos) << c.what << ": " << e;
  }
  // A nested object's keys are not duplicates of top-level ones, and the
  // reference writer's space padding is accepted.
  writeAll(path("ok"), rawFile(R"({"__metadata__":{"w":"x"},)" +
                                   entry("w", "F32", "[2]", "[0,8]") + "}    ",
                               eight));
  EXPECT_TRUE(!!SafetensorsReader::open(path("ok")));
  EXPECT_NE(errorText(SafetensorsReader::open(path("absent")).takeError())
                .find("cannot open"),
            std::string::npos);
}

TEST_F(SafetensorsTest, FileTruncatedAfterOpen) {
  std::vector<float> v(1000, 1.5f);
  ASSERT_EQ(errorText(writeSafetensors(path("t"), {{"v", {1000}, v.data()}})),
            "");
  auto reader = SafetensorsReader::open(path("t"));
  ASSERT_TRUE(!!reader);
  ASSERT_EQ(::truncate(path("t").c_str(), 200), 0);
  std::vector<float> got(1000);
  std::string e = errorText((*reader)->readF32(*(*reader)->find("v"), got));
  EXPECT_NE(e.find("unexpected end of file reading tensor 'v'"),
            std::string::npos)
      << e;
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  float x = 0;
  EXPECT_NE(
      errorText(writeSafetensors(path("w"), {{"a", {1}, &x}, {"a", {1}, &x}}))
          .find("duplicate"),
      std::string::npos);
  EXPECT_NE(
      errorText(writeSafetensors(path("w"), {{"a", {1}, &x, StDType::F16}}))
          .find("F16 cannot be written"),
      std::string::npos);
  EXPECT_NE(errorText(writeSafetensors(path("w"), {{"__metadata__", {1}, &x}}))
                .find("invalid name"),
            std::string::npos);
  EXPECT_FALSE(llvm::sys::fs::exists(path("w")));
  std::string e =
      errorText(writeSafetensors(path("no/such/dir/w"), {{"a", {1}, &x}}));
  EXPECT_NE(e.find("cannot write"), std::string::npos) << e;
}

TEST_F(SafetensorsTest, HeaderLimitsAreCheckedBeforeParsing) {
  // A header length above the limit is refused before the header is read.
  std::string length(8, '\0');
  llvm::support::endian::write64le(length.data(),
                                   kMaxSafetensorsHeaderBytes + 1);
  writeSparse(path("long"), length, 8 + kMaxSafetensorsHeaderBytes + 1);
  EXPECT_EQ(errorText(SafetensorsReader::open(path("long")).takeError()),
            llvm::formatv("'{0}': header length {1} exceeds the limit of "
                          "{2} bytes (not a safetensors file?)",
                          path("long"), kMaxSafetensorsHeaderBytes + 1,
                          kMaxSafetensorsHeaderBytes)
                .str());

  // Too many tensors, or too many values, are refused before parsing:
  // these headers do not end, so parsing them would say "not valid JSON".
  auto manyTensors = [](uint64_t n, bool metadata) {
    std::string h = metadata ? "{\"__metadata__\":{}," : "{";
    for (uint64_t i = 0; i < n; ++i)
      h += "\"t" + std::to_string(i) + "\":0,";
    return h;
  };
  writeAll(path("tensors"),
           rawFile(manyTensors(kMaxSafetensorsTensors + 1, false), ""));
  EXPECT_EQ(errorText(SafetensorsReader::open(path("tensors")).takeError()),
            "'" + path("tensors") +
                "': the header lists more than 200000 "
                "tensors, the limit");
  // __metadata__ is not a tensor: the limit itself is allowed.
  writeAll(path("limit"),
           rawFile(manyTensors(kMaxSafetensorsTensors, true), ""));
  EXPECT_NE(errorText(SafetensorsReader::open(path("limit")).takeError())
                .find("header is not valid JSON"),
            std::string::npos);

  writeAll(path("values"),
           rawFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[" +
                       std::string(kMaxSafetensorsHeaderValues, ','),
                   ""));
  EXPECT_EQ(errorText(SafetensorsReader::open(path("values")).takeError()),
            "'" + path("values") +
                "': the header holds more than 4000000 "
                "JSON values, the limit");
}

} // namespace
