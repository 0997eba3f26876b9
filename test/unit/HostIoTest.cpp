//===- HostIoTest.cpp - Safetensors, weights and checkpoints --------------===//
//
// The host's file formats (runtime/host): safetensors round trips in F32
// and BF16 and F16 reading; every structural check of untrusted files
// (each on a hand-made file); diffusers weight directories, single and
// sharded, and the one error that lists unknown, missing and misshapen
// tensors; checkpoints bit-exact, with corruption, truncation, `latest`
// handling, retention and failed saves leaving earlier checkpoints intact.
// Plans and host states are built by hand here.
//
//===----------------------------------------------------------------------===//

#include "host/Checkpoint.h"
#include "host/Safetensors.h"
#include "host/Weights.h"

#include "cpu/AdamW.h"
#include "support/ReadFile.h"

#include "llvm/Support/Endian.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <limits>
#include <random>
#include <sys/resource.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using llvm::StringRef;

namespace {

//===----------------------------------------------------------------------===//
// Fixtures
//===----------------------------------------------------------------------===//

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string role = "master";
};

/// A plan with the given params plus both moments of every master.
exec::ExecPlan makePlan(const std::vector<ParamSpec> &specs) {
  exec::ExecPlan plan;
  plan.model = "hostio-test";
  plan.modelConfig = R"({"_class_name": "WanTransformer3DModel", )"
                     R"("num_layers": 1, "in_channels": 2})";
  for (const ParamSpec &s : specs) {
    exec::Param p;
    p.name = s.name;
    p.role = s.role;
    p.group = "blocks";
    p.type.shape = s.shape;
    plan.params.push_back(p);
  }
  for (const ParamSpec &s : specs) {
    if (s.role != "master")
      continue;
    for (const char *suffix : {".exp_avg", ".exp_avg_sq"}) {
      exec::Param m;
      m.name = s.name + suffix;
      m.role = "moment";
      m.of = s.name;
      m.type.shape = s.shape;
      plan.params.push_back(m);
    }
  }
  return plan;
}

std::vector<ParamSpec> defaultSpecs() {
  return {{"patch_embedding.weight", {4, 2, 1, 2, 2}},
          {"patch_embedding.bias", {4}},
          {"blocks.0.attn1.to_q.weight", {4, 4}},
          {"blocks.0.scale_shift_table", {1, 6, 4}},
          {"pos_embed", {1, 3, 4}, "frozen"},
          {"scalar", {}},
          {"empty", {0, 3}}};
}

/// A state for `plan` with every tensor filled from `seed`: values that
/// bf16 cannot hold exactly, signed zeros, subnormals, huge values.
HostState makeState(const exec::ExecPlan &plan, uint32_t seed) {
  HostState state;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const exec::Param &p : plan.params) {
    HostTensor t;
    t.param = &p;
    t.data.resize(static_cast<size_t>(p.type.numElements()));
    for (size_t i = 0; i < t.data.size(); ++i)
      t.data[i] = normal(rng);
    if (t.data.size() >= 4) {
      t.data[0] = -0.0f;
      t.data[1] = std::numeric_limits<float>::denorm_min();
      t.data[2] = 3.0e38f;
      t.data[3] = 1.0f + 1.0f / 1024; // not a bf16 value
    }
    state.index[p.name] = state.tensors.size();
    state.tensors.push_back(std::move(t));
  }
  state.step = 7;
  return state;
}

const HostTensor &get(const HostState &s, StringRef name) {
  return s.tensors[s.index.find(name)->second];
}
HostTensor &get(HostState &s, StringRef name) {
  return s.tensors[s.index.find(name)->second];
}

bool bitEqual(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

/// Error text, or "" on success.
std::string errorText(llvm::Error e) {
  return e ? llvm::toString(std::move(e)) : std::string();
}

class HostIoTest : public ::testing::Test {
protected:
  void SetUp() override {
    llvm::SmallString<128> path;
    ASSERT_FALSE(
        llvm::sys::fs::createUniqueDirectory("megaslide-hostio", path));
    dir = std::string(path);
  }
  void TearDown() override {
    llvm::sys::fs::remove_directories(dir, /*IgnoreErrors=*/true);
  }
  std::string path(StringRef name) const {
    llvm::SmallString<256> p(dir);
    llvm::sys::path::append(p, name);
    return std::string(p);
  }
  std::string dir;
};

std::string readAll(StringRef path) {
  auto buffer = llvm::MemoryBuffer::getFile(path, false, false);
  return buffer ? (*buffer)->getBuffer().str() : std::string("<unreadable>");
}

void writeAll(StringRef path, StringRef bytes) {
  std::ofstream out(path.str(), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A safetensors file from a raw header and data, for malformed inputs.
std::string rawFile(StringRef header, StringRef data,
                    std::optional<uint64_t> length = std::nullopt) {
  std::string out(8, '\0');
  llvm::support::endian::write64le(out.data(),
                                   length ? *length : header.size());
  return out + header.str() + data.str();
}

void flipByte(StringRef path, uint64_t offset) {
  std::string bytes = readAll(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] ^= 0x5A;
  writeAll(path, bytes);
}

//===----------------------------------------------------------------------===//
// Safetensors
//===----------------------------------------------------------------------===//

TEST(HostIoChecksum, Crc32cKnownValues) {
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

TEST(HostIoChecksum, HalfToFloat) {
  EXPECT_EQ(halfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(halfToFloat(0xC000), -2.0f);
  EXPECT_EQ(halfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(halfToFloat(0x0001), std::ldexp(1.0f, -24)); // smallest subnormal
  EXPECT_EQ(halfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(halfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(halfToFloat(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::signbit(halfToFloat(0x8000)) && halfToFloat(0x8000) == 0);
  EXPECT_EQ(halfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(halfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(halfToFloat(0x7E00)));
}

TEST_F(HostIoTest, SafetensorsRoundTripF32AndBf16) {
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

TEST_F(HostIoTest, SafetensorsLargeTensorsStreamInChunks) {
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

TEST_F(HostIoTest, SafetensorsReadsF16AndRejectsIntegerDtypes) {
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

TEST_F(HostIoTest, SafetensorsRejectsMalformedFiles) {
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

TEST_F(HostIoTest, SafetensorsFileTruncatedAfterOpen) {
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

TEST_F(HostIoTest, SafetensorsWriterRejectsBadTensors) {
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

//===----------------------------------------------------------------------===//
// Weights
//===----------------------------------------------------------------------===//

TEST_F(HostIoTest, WeightsRoundTripF32AndBf16) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 1);
  for (StDType dtype : {StDType::F32, StDType::BF16}) {
    std::string out = path(std::string("w-") + stDTypeName(dtype));
    SaveWeightsOptions options;
    options.dtype = dtype;
    ASSERT_EQ(errorText(saveWeights(plan, saved, out, options)), "");
    EXPECT_TRUE(llvm::sys::fs::exists(out + "/" + kWeightsFile.str()));
    EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsIndexFile.str()));
    EXPECT_EQ(readAll(out + "/config.json"), plan.modelConfig + "\n");

    HostState loaded = makeState(plan, 2);
    ASSERT_EQ(errorText(loadWeights(out, loaded)), "");
    for (const HostTensor &t : saved.tensors) {
      const HostTensor &l = get(loaded, t.param->name);
      if (t.param->role == "moment") {
        // Weights do not touch the optimizer state.
        EXPECT_TRUE(
            bitEqual(l.data, get(makeState(plan, 2), t.param->name).data));
        continue;
      }
      std::vector<float> want = t.data;
      if (dtype == StDType::BF16)
        for (float &f : want)
          f = cpu::bf16ToFloat(cpu::floatToBf16(f));
      EXPECT_TRUE(bitEqual(l.data, want)) << t.param->name;
    }
    // The file alone loads too; it carries only weights.
    HostState again = makeState(plan, 3);
    ASSERT_EQ(errorText(loadWeights(out + "/" + kWeightsFile.str(), again)),
              "");
    auto reader = SafetensorsReader::open(out + "/" + kWeightsFile.str());
    ASSERT_TRUE(!!reader);
    EXPECT_EQ((*reader)->tensors().size(), 7u);
    EXPECT_EQ((*reader)->metadata().at("format"), "pt");
  }
}

TEST_F(HostIoTest, WeightsShardedWithIndex) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 4);
  std::string out = path("sharded");
  SaveWeightsOptions options;
  // patch_embedding.weight is 128 bytes: a tensor over the limit gets a
  // shard of its own; the rest pack up to 64 bytes per shard.
  options.maxShardBytes = 64;
  ASSERT_EQ(errorText(saveWeights(plan, saved, out, options)), "");
  EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsFile.str()));
  auto index = llvm::json::parse(readAll(out + "/" + kWeightsIndexFile.str()));
  ASSERT_TRUE(!!index);
  const llvm::json::Object *root = index->getAsObject();
  EXPECT_EQ(root->getObject("metadata")->getInteger("total_size"),
            (32 + 4 + 16 + 24 + 12 + 1 + 0) * 4);
  const llvm::json::Object *map = root->getObject("weight_map");
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(map->size(), 7u);
  // Bytes in plan order, one shard each: 128 (over the limit, alone) | 16
  // (q would overflow) | 64 | 96 | 48 + 4 + 0.
  EXPECT_EQ(map->getString("patch_embedding.weight"),
            "diffusion_pytorch_model-00001-of-00005.safetensors");
  EXPECT_EQ(map->getString("patch_embedding.bias"),
            "diffusion_pytorch_model-00002-of-00005.safetensors");
  EXPECT_EQ(map->getString("blocks.0.attn1.to_q.weight"),
            "diffusion_pytorch_model-00003-of-00005.safetensors");
  EXPECT_EQ(map->getString("blocks.0.scale_shift_table"),
            "diffusion_pytorch_model-00004-of-00005.safetensors");
  EXPECT_EQ(map->getString("pos_embed"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");
  EXPECT_EQ(map->getString("scalar"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");
  EXPECT_EQ(map->getString("empty"),
            "diffusion_pytorch_model-00005-of-00005.safetensors");

  HostState loaded = makeState(plan, 5);
  ASSERT_EQ(errorText(loadWeights(out, loaded)), "");
  for (const HostTensor &t : saved.tensors) {
    if (t.param->role != "moment") {
      EXPECT_TRUE(bitEqual(get(loaded, t.param->name).data, t.data))
          << t.param->name;
    }
  }

  // Saving unsharded into the same directory removes the old shards and
  // index, which would otherwise take precedence.
  std::ofstream(out + "/keep-me.txt") << "user file";
  ASSERT_EQ(errorText(saveWeights(plan, loaded, out)), "");
  EXPECT_FALSE(llvm::sys::fs::exists(out + "/" + kWeightsIndexFile.str()));
  EXPECT_FALSE(llvm::sys::fs::exists(
      out + "/diffusion_pytorch_model-00001-of-00005.safetensors"));
  EXPECT_TRUE(llvm::sys::fs::exists(out + "/keep-me.txt"));
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(out, ec), end; it != end && !ec;
       it.increment(ec))
    EXPECT_FALSE(llvm::sys::path::filename(it->path()).starts_with("."))
        << it->path();
}

TEST_F(HostIoTest, WeightsIndexErrors) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 6);
  std::string out = path("idx");
  SaveWeightsOptions options;
  options.maxShardBytes = 64;
  ASSERT_EQ(errorText(saveWeights(plan, state, out, options)), "");
  std::string indexPath = out + "/" + kWeightsIndexFile.str();
  std::string original = readAll(indexPath);

  auto withIndex = [&](StringRef from, StringRef to) {
    std::string text = original;
    size_t at = text.find(from.str());
    EXPECT_NE(at, std::string::npos) << from.str();
    text.replace(at, from.size(), to.str());
    writeAll(indexPath, text);
    return errorText(loadWeights(out, state));
  };
  std::string e =
      withIndex("diffusion_pytorch_model-00001-of-00005.safetensors",
                "../escape.safetensors");
  EXPECT_NE(e.find("not a file of the directory"), std::string::npos) << e;
  e = withIndex("\"patch_embedding.bias\": "
                "\"diffusion_pytorch_model-00002-of-00005.safetensors\"",
                "\"patch_embedding.bias\": "
                "\"diffusion_pytorch_model-00003-of-00005.safetensors\"");
  EXPECT_NE(e.find("maps tensor 'patch_embedding.bias'"), std::string::npos)
      << e;
  e = withIndex("\"weight_map\"", "\"weights\"");
  EXPECT_NE(e.find("no 'weight_map'"), std::string::npos) << e;
  writeAll(indexPath, original);
  llvm::sys::fs::remove(out +
                        "/diffusion_pytorch_model-00004-of-00005.safetensors");
  e = errorText(loadWeights(out, state));
  EXPECT_NE(e.find("00004-of-00005.safetensors"), std::string::npos) << e;

  std::string empty = path("empty-dir");
  llvm::sys::fs::create_directories(empty + "/transformer");
  e = errorText(loadWeights(empty, state));
  EXPECT_NE(e.find("has neither"), std::string::npos) << e;
  EXPECT_NE(e.find("'transformer' subdirectory"), std::string::npos) << e;
}

TEST_F(HostIoTest, WeightsMismatchListsEverythingAtOnce) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 7);
  std::string out = path("mismatch");
  ASSERT_EQ(errorText(saveWeights(plan, state, out)), "");

  // The model the weights are loaded into: one tensor renamed, one
  // reshaped, eight new ones.
  std::vector<ParamSpec> other = defaultSpecs();
  other[2].name = "blocks.0.attn1.to_k.weight";
  other[3].shape = {1, 4, 6};
  for (int i = 0; i < 8; ++i)
    other.push_back({"extra." + std::to_string(i), {2}});
  exec::ExecPlan otherPlan = makePlan(other);
  HostState target = makeState(otherPlan, 8);
  HostState before = makeState(otherPlan, 8);
  std::string e = errorText(loadWeights(out, target));
  EXPECT_NE(e.find("'" + out +
                   "' does not match the model (15 tensors "
                   "expected)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("9 missing: blocks.0.attn1.to_k.weight, extra.0, extra.1, "
                   "extra.2, extra.3, ... (4 more)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1 unexpected (not in the model): "
                   "blocks.0.attn1.to_q.weight"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1 with a different shape: blocks.0.scale_shift_table "
                   "(file [1, 6, 4], model [1, 4, 6])"),
            std::string::npos)
      << e;
  // Nothing was loaded.
  for (const HostTensor &t : target.tensors)
    EXPECT_TRUE(bitEqual(t.data, get(before, t.param->name).data));

  // A checkpoint's moments are not weights.
  std::vector<float> m(4);
  ASSERT_EQ(errorText(writeSafetensors(
                path("moments.safetensors"),
                {{"patch_embedding.bias.exp_avg", {4}, m.data()}})),
            "");
  e = errorText(loadWeights(path("moments.safetensors"), state));
  EXPECT_NE(e.find("unexpected (not in the model): "
                   "patch_embedding.bias.exp_avg"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("7 missing"), std::string::npos) << e;
}

TEST_F(HostIoTest, WeightsSaveFailureLeavesDirectory) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 9);
  writeAll(path("file"), "not a directory");
  std::string e = errorText(saveWeights(plan, state, path("file/sub")));
  EXPECT_NE(e.find("file/sub"), std::string::npos) << e;
  SaveWeightsOptions options;
  options.dtype = StDType::F16;
  EXPECT_NE(errorText(saveWeights(plan, state, path("x"), options)).find("F16"),
            std::string::npos);
}

//===----------------------------------------------------------------------===//
// Checkpoints
//===----------------------------------------------------------------------===//

/// Fails the disk after `limit` bytes of any file (RLIMIT_FSIZE) while in
/// scope: writes past it fail with EFBIG, like a full disk.
class FileSizeLimit {
public:
  explicit FileSizeLimit(rlim_t limit) {
    getrlimit(RLIMIT_FSIZE, &saved);
    previous = std::signal(SIGXFSZ, SIG_IGN);
    rlimit l = saved;
    l.rlim_cur = limit;
    setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, previous);
  }

private:
  rlimit saved;
  void (*previous)(int);
};

std::vector<std::string> entries(StringRef dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec))
    names.push_back(llvm::sys::path::filename(it->path()).str());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(HostIoTest, CheckpointRoundTripIsBitExact) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState saved = makeState(plan, 10);
  saved.step = 123;
  std::string trainer = R"({"epoch": 3, "rng": [1, 2, 3], "s": "\u00e9"})";
  auto stepDir = saveCheckpoint(dir, saved, trainer);
  ASSERT_TRUE(!!stepDir) << llvm::toString(stepDir.takeError());
  EXPECT_EQ(*stepDir, path("step-000123"));
  EXPECT_EQ(readAll(path("latest")), "step-000123\n");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000123"}));
  EXPECT_EQ(entries(*stepDir),
            (std::vector<std::string>{"manifest.json", "state.safetensors",
                                      "trainer.json"}));

  auto manifest = llvm::json::parse(readAll(*stepDir + "/manifest.json"));
  ASSERT_TRUE(!!manifest);
  const llvm::json::Object *m = manifest->getAsObject();
  EXPECT_EQ(m->getInteger("step"), 123);
  EXPECT_EQ(m->getString("checksum"), "crc32c");
  const llvm::json::Array *files = m->getArray("files");
  ASSERT_EQ(files->size(), 2u);
  for (const llvm::json::Value &f : *files) {
    const llvm::json::Object *o = f.getAsObject();
    std::string content = readAll(*stepDir + "/" + o->getString("name")->str());
    EXPECT_EQ(o->getInteger("bytes"), static_cast<int64_t>(content.size()));
    char hex[9];
    snprintf(hex, sizeof(hex), "%08x",
             crc32c(0, llvm::ArrayRef<uint8_t>(
                           reinterpret_cast<const uint8_t *>(content.data()),
                           content.size())));
    EXPECT_EQ(o->getString("crc32c"), StringRef(hex));
  }

  HostState loaded = makeState(plan, 11);
  std::string gotTrainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, loaded, gotTrainer)), "");
  EXPECT_EQ(gotTrainer, trainer);
  EXPECT_EQ(loaded.step, 123);
  for (const HostTensor &t : saved.tensors)
    EXPECT_TRUE(bitEqual(get(loaded, t.param->name).data, t.data))
        << t.param->name;

  auto list = listCheckpoints(dir);
  ASSERT_TRUE(!!list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].step, 123);
  EXPECT_EQ(checkpointDirName(1234567), "step-1234567");
  auto none = listCheckpoints(path("nothing-here"));
  ASSERT_TRUE(!!none);
  EXPECT_TRUE(none->empty());
}

TEST_F(HostIoTest, CheckpointCorruptionIsDetected) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 12);
  state.step = 10;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "{}"));
  state.step = 20;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "{\"at\": 20}"));
  std::string stateFile = path("step-000020/state.safetensors");
  std::string original = readAll(stateFile);
  std::string trainer;

  // A flipped byte in the tensor data: found by the checksum.
  flipByte(stateFile, original.size() - 3);
  HostState loaded = makeState(plan, 13);
  std::string e = errorText(loadLatestCheckpoint(dir, loaded, trainer));
  EXPECT_NE(e.find("'" + stateFile + "' is corrupt: its CRC-32C is"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("the previous checkpoint is '" + path("step-000010") + "'"),
            std::string::npos)
      << e;
  EXPECT_EQ(loaded.step, 7) << "step changed by a failed load";
  EXPECT_EQ(trainer, "");
  // ... and the suggested one loads.
  ASSERT_EQ(errorText(loadCheckpoint(path("step-000010"), loaded, trainer)),
            "");
  EXPECT_EQ(loaded.step, 10);
  EXPECT_EQ(trainer, "{}");

  // A flipped byte in the header: a format error, said to be corruption.
  writeAll(stateFile, original);
  flipByte(stateFile, 9);
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find(stateFile), std::string::npos) << e;
  EXPECT_NE(e.find("the file is corrupt"), std::string::npos) << e;

  // Truncated: named by its size before anything is read.
  writeAll(stateFile, StringRef(original).drop_back(100));
  e = errorText(loadLatestCheckpoint(dir, loaded, trainer));
  EXPECT_NE(e.find("'" + stateFile + "' is " +
                   std::to_string(original.size() - 100) +
                   " bytes, the manifest records " +
                   std::to_string(original.size()) + " (truncated)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(path("step-000010")), std::string::npos) << e;

  // trainer.json edited: its checksum.
  writeAll(stateFile, original);
  std::string trainerFile = path("step-000020/trainer.json");
  std::string trainerText = readAll(trainerFile);
  trainerText[trainerText.find("20")] = '3';
  writeAll(trainerFile, trainerText);
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find("'" + trainerFile + "' is corrupt: its CRC-32C"),
            std::string::npos)
      << e;

  // No manifest: incomplete.
  llvm::sys::fs::remove(path("step-000020/manifest.json"));
  e = errorText(loadCheckpoint(path("step-000020"), loaded, trainer));
  EXPECT_NE(e.find("not a complete checkpoint: manifest.json is missing"),
            std::string::npos)
      << e;

  // Tensors that do not match the plan.
  exec::ExecPlan other = makePlan({{"something.else", {2}}});
  HostState otherState = makeState(other, 1);
  e = errorText(loadCheckpoint(path("step-000010"), otherState, trainer));
  EXPECT_NE(e.find("3 missing: something.else, something.else.exp_avg, "
                   "something.else.exp_avg_sq"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("unexpected (not in the model)"), std::string::npos) << e;
}

TEST_F(HostIoTest, CheckpointLatestHandling) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 14);
  std::string trainer;
  std::string e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find("no checkpoint in '" + dir + "'"), std::string::npos) << e;

  state.step = 5;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "five"));
  state.step = 6;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "six"));

  writeAll(path("latest"), "\x01garbage\xff");
  e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find("'" + path("latest") + "' is corrupt"), std::string::npos)
      << e;
  EXPECT_NE(
      e.find("the newest complete checkpoint is '" + path("step-000006") + "'"),
      std::string::npos)
      << e;

  writeAll(path("latest"), "step-000099\n");
  e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find(path("step-000099")), std::string::npos) << e;
  EXPECT_NE(e.find("the previous checkpoint is '" + path("step-000006") + "'"),
            std::string::npos)
      << e;

  llvm::sys::fs::remove(path("latest"));
  e = errorText(loadLatestCheckpoint(dir, state, trainer));
  EXPECT_NE(e.find("is missing; the newest complete checkpoint is '" +
                   path("step-000006")),
            std::string::npos)
      << e;

  // `latest` pointing at the older one is honoured.
  writeAll(path("latest"), "step-000005");
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "five");
  EXPECT_EQ(state.step, 5);
}

TEST_F(HostIoTest, CheckpointRetention) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 15);
  // Leftovers of a crashed save (a dead pid) go; those of a live process
  // (this one) stay.
  std::string dead = path(".tmp-step-000001-999999999");
  std::string live = path(".tmp-step-000001-" + std::to_string(::getpid()));
  llvm::sys::fs::create_directories(dead);
  llvm::sys::fs::create_directories(live);
  writeAll(dead + "/state.safetensors", "partial");
  for (int64_t step : {100, 200, 300, 400}) {
    state.step = step;
    ASSERT_TRUE(!!saveCheckpoint(dir, state, ""));
  }
  EXPECT_FALSE(llvm::sys::fs::exists(dead));
  EXPECT_TRUE(llvm::sys::fs::exists(live));
  llvm::sys::fs::remove(live);
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000300", "step-000400"}));
  // keep = 0 keeps all; keep = 1 only the new one.
  state.step = 500;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "", {/*keep=*/0}));
  EXPECT_EQ(entries(dir).size(), 4u);
  state.step = 600;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "", {/*keep=*/1}));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000600"}));
  // A run restarted from an earlier step never deletes later checkpoints,
  // and saving the same step again replaces it.
  state.step = 50;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "a"));
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "b"));
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "step-000050", "step-000600"}));
  std::string trainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "b");
  EXPECT_EQ(state.step, 50);
}

// Tests that saving never follows a symlink named like a checkpoint, that
// it refuses non-finite state, that replaceOthers replaces only real
// checkpoints, and that a checkpoint folder has one owner at a time.
TEST_F(HostIoTest, CheckpointGuards) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 17);
  std::string mine = path("../mine-" + std::to_string(::getpid()));
  llvm::sys::fs::create_directories(mine);
  writeAll(mine + "/thesis.txt", "years");
  ASSERT_FALSE(llvm::sys::fs::create_link(mine, path("step-000001")));
  for (int64_t step : {2, 3, 4}) {
    state.step = step;
    ASSERT_EQ(errorText(saveCheckpoint(dir, state, "").takeError()), "");
  }
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000001",
                                                    "step-000003",
                                                    "step-000004"}));
  // A save onto a symlinked step is refused; nothing is followed.
  ASSERT_FALSE(llvm::sys::fs::create_link(mine, path("step-000005")));
  state.step = 5;
  std::string refused = errorText(saveCheckpoint(dir, state, "").takeError());
  EXPECT_NE(refused.find("step-000005' exists and is not a checkpoint"),
            std::string::npos)
      << refused;
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  llvm::sys::fs::remove(path("step-000005"));
  // Non-finite state is never saved.
  std::vector<std::string> before = entries(dir);
  state.tensors[0].data[1] = std::numeric_limits<float>::quiet_NaN();
  std::string nan = errorText(saveCheckpoint(dir, state, "").takeError());
  EXPECT_NE(nan.find("holds nan at element 1"), std::string::npos) << nan;
  EXPECT_EQ(entries(dir), before);
  state.tensors[0].data[1] = 0;
  // replaceOthers: a fresh run's first save removes the old run's real
  // checkpoints, later steps included, and leaves the symlink alone.
  state.step = 2;
  CheckpointOptions replace;
  replace.replaceOthers = true;
  ASSERT_EQ(errorText(saveCheckpoint(dir, state, "fresh", replace).takeError()),
            "");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000001",
                                                    "step-000002"}));
  llvm::Expected<std::string> trainer = readLatestTrainerState(dir);
  ASSERT_TRUE(!!trainer) << llvm::toString(trainer.takeError());
  EXPECT_EQ(*trainer, "fresh");
  EXPECT_TRUE(llvm::sys::fs::exists(mine + "/thesis.txt"));
  llvm::sys::fs::remove(path("step-000001"));
  llvm::sys::fs::remove_directories(mine);

  // One lock per folder, also within one process (flock is per open file).
  auto first = CheckpointLock::acquire(dir);
  ASSERT_TRUE(!!first) << llvm::toString(first.takeError());
  auto second = CheckpointLock::acquire(dir);
  ASSERT_FALSE(!!second);
  std::string busy = llvm::toString(second.takeError());
  EXPECT_NE(busy.find("in use by another run (pid " +
                      std::to_string(::getpid()) + ")"),
            std::string::npos)
      << busy;
  first->reset();
  auto third = CheckpointLock::acquire(dir);
  EXPECT_TRUE(!!third) << llvm::toString(third.takeError());
}

TEST_F(HostIoTest, FailedSaveKeepsPreviousCheckpoints) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 16);
  state.step = 1;
  ASSERT_TRUE(!!saveCheckpoint(dir, state, "one"));
  std::string before = readAll(path("step-000001/state.safetensors"));

  // Disk full halfway through state.safetensors.
  state.step = 2;
  {
    FileSizeLimit full(300);
    auto saved = saveCheckpoint(dir, state, "two");
    ASSERT_FALSE(!!saved);
    std::string e = llvm::toString(saved.takeError());
    EXPECT_NE(e.find("state.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find("cannot write"), std::string::npos) << e;
  }
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"latest", "step-000001"}));
  EXPECT_EQ(readAll(path("latest")), "step-000001\n");
  EXPECT_EQ(readAll(path("step-000001/state.safetensors")), before);
  std::string trainer;
  ASSERT_EQ(errorText(loadLatestCheckpoint(dir, state, trainer)), "");
  EXPECT_EQ(trainer, "one");

  // Unwritable location (works as root too: a file where a directory
  // should be).
  writeAll(path("plain-file"), "x");
  auto saved = saveCheckpoint(path("plain-file/ckpt"), state, "");
  ASSERT_FALSE(!!saved);
  EXPECT_NE(llvm::toString(saved.takeError()).find("plain-file/ckpt"),
            std::string::npos);

  // Tensors of the wrong size are refused before anything is written.
  get(state, "patch_embedding.bias").data.pop_back();
  state.step = 3;
  saved = saveCheckpoint(dir, state, "");
  ASSERT_FALSE(!!saved);
  EXPECT_NE(llvm::toString(saved.takeError()).find("patch_embedding.bias"),
            std::string::npos);
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"latest", "plain-file", "step-000001"}));
}

//===----------------------------------------------------------------------===//
// Bounded readers: regular files only, reads bounded by the format
//===----------------------------------------------------------------------===//

/// Sees whether anything opens FIFO `path` for reading while in scope:
/// opening the write end without blocking succeeds only while a reader
/// has the FIFO open, and releases a reader blocked in open(), so a
/// reader that would hang makes the test fail instead.
class FifoWatch {
public:
  explicit FifoWatch(std::string fifo) : fifo(std::move(fifo)) {
    watcher = std::thread([this] {
      while (!done) {
        int fd = ::open(this->fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0) {
          opened = true;
          ::close(fd);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  ~FifoWatch() { openedByReader(); }
  /// Whether a reader opened the FIFO; stops watching.
  bool openedByReader() {
    done = true;
    if (watcher.joinable())
      watcher.join();
    return opened;
  }

private:
  std::string fifo;
  std::atomic<bool> done{false}, opened{false};
  std::thread watcher;
};

/// A sparse file of `size` bytes starting with `prefix`: large files cost
/// no disk.
void writeSparse(StringRef path, StringRef prefix, uint64_t size) {
  writeAll(path, prefix);
  ASSERT_EQ(::truncate(path.str().c_str(), static_cast<off_t>(size)), 0);
}

TEST_F(HostIoTest, ReadBoundedFileReadsRegularFilesWithinTheBound) {
  writeAll(path("f"), "hello");
  llvm::Expected<std::string> text = readBoundedFile(path("f"), 5, "greeting");
  ASSERT_TRUE(!!text) << llvm::toString(text.takeError());
  EXPECT_EQ(*text, "hello");

  EXPECT_EQ(errorText(readBoundedFile(path("f"), 4, "greeting").takeError()),
            "cannot read greeting '" + path("f") +
                "': it is 5 bytes, over the limit of 4 bytes");
  // Refused by its size: 1 GiB is never read (nor stored: sparse).
  writeSparse(path("big"), "x", uint64_t(1) << 30);
  EXPECT_EQ(errorText(readBoundedFile(path("big"), 4096, "").takeError()),
            "cannot read '" + path("big") +
                "': it is 1073741824 bytes, over the limit of 4096 bytes");
  // stat says 0 bytes for /proc files: the bound holds all the same.
  text = readBoundedFile("/proc/self/status", 1 << 20, "");
  ASSERT_TRUE(!!text) << llvm::toString(text.takeError());
  EXPECT_NE(text->find("Name:"), std::string::npos);
  EXPECT_EQ(errorText(readBoundedFile("/proc/self/status", 8, "").takeError()),
            "cannot read '/proc/self/status': it holds more than 8 bytes, "
            "over the limit of 8 bytes");
  EXPECT_EQ(errorText(readBoundedFile(path("absent"), 8, "x").takeError()),
            "cannot read x '" + path("absent") +
                "': No such file or directory");
}

TEST_F(HostIoTest, ReadersRefuseFifosDevicesAndDirectories) {
  std::string fifo = path("x.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", path("zero").c_str()), 0);
  FifoWatch watch(fifo);
  uint64_t size;
  struct Case {
    std::string path, kind;
  };
  for (const Case &c :
       {Case{fifo, "a FIFO (named pipe)"},
        Case{"/dev/zero", "a character device"},
        Case{path("zero"), "a character device"}, Case{dir, "a directory"}}) {
    std::string notRegular = "': it is " + c.kind + ", not a regular file";
    EXPECT_EQ(errorText(readBoundedFile(c.path, 1 << 20, "").takeError()),
              "cannot read '" + c.path + notRegular);
    EXPECT_EQ(errorText(openRegularFile(c.path, "data", size).takeError()),
              "cannot open data '" + c.path + notRegular);
    EXPECT_EQ(errorText(SafetensorsReader::open(c.path).takeError()),
              "cannot open '" + c.path + notRegular);
  }
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the FIFO";
}

TEST_F(HostIoTest, SafetensorsHeaderLimitsAreCheckedBeforeParsing) {
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

TEST_F(HostIoTest, CheckpointSmallFilesAreBounded) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 3);
  std::string trainer;
  std::string latest = path("latest");
  auto loadError = [&] {
    return errorText(loadLatestCheckpoint(dir, state, trainer));
  };

  ASSERT_EQ(::symlink("/dev/zero", latest.c_str()), 0);
  EXPECT_NE(loadError().find("cannot read '" + latest +
                             "': it is a character device, not a regular "
                             "file"),
            std::string::npos)
      << loadError();
  ASSERT_EQ(::unlink(latest.c_str()), 0);

  writeSparse(latest, "step-000001\n", 64 << 20);
  EXPECT_NE(loadError().find("cannot read '" + latest +
                             "': it is 67108864 bytes, over the limit of "
                             "4096 bytes"),
            std::string::npos)
      << loadError();
  ASSERT_EQ(::unlink(latest.c_str()), 0);

  ASSERT_EQ(::mkfifo(latest.c_str(), 0600), 0);
  {
    FifoWatch watch(latest);
    EXPECT_NE(loadError().find("it is a FIFO (named pipe), not a regular "
                               "file"),
              std::string::npos)
        << loadError();
    EXPECT_FALSE(watch.openedByReader()) << "a reader opened 'latest'";
  }

  // A manifest that is a FIFO.
  ASSERT_TRUE(llvm::sys::fs::create_directory(path("step-000001")) ==
              std::error_code());
  std::string manifest = path("step-000001/manifest.json");
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0600), 0);
  FifoWatch watch(manifest);
  std::string e =
      errorText(loadCheckpoint(path("step-000001"), state, trainer));
  EXPECT_NE(e.find("cannot read '" + manifest +
                   "': it is a FIFO (named pipe), not a regular file"),
            std::string::npos)
      << e;
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the manifest";
}

TEST_F(HostIoTest, WeightsIndexIsBounded) {
  exec::ExecPlan plan = makePlan(defaultSpecs());
  HostState state = makeState(plan, 4);
  std::string index = path(kWeightsIndexFile);
  writeSparse(index, "{", kMaxWeightsIndexBytes + 1);
  EXPECT_EQ(errorText(loadWeights(dir, state)),
            llvm::formatv("cannot read '{0}': it is {1} bytes, over the "
                          "limit of {2} bytes",
                          index, kMaxWeightsIndexBytes + 1,
                          kMaxWeightsIndexBytes)
                .str());
  ASSERT_EQ(::unlink(index.c_str()), 0);
  ASSERT_EQ(::mkfifo(index.c_str(), 0600), 0);
  FifoWatch watch(index);
  EXPECT_EQ(errorText(loadWeights(dir, state)),
            "cannot read '" + index +
                "': it is a FIFO (named pipe), not a regular file");
  EXPECT_FALSE(watch.openedByReader()) << "a reader opened the index";
}

} // namespace

TEST(HostMemory, WhatARunMayUse) {
  constexpr uint64_t GiB = 1ull << 30;
  auto usable = [](HostMemoryReadings r) {
    llvm::Expected<uint64_t> bytes = usableHostMemoryBytes(r);
    return bytes ? *bytes : (llvm::consumeError(bytes.takeError()), 0);
  };
  HostMemoryReadings plain;
  plain.physicalBytes = 24 * GiB;
  EXPECT_EQ(usable(plain), 24 * GiB);
  // A VM whose memory is hot-plugged as it is used: few blocks online.
  HostMemoryReadings growing;
  growing.physicalBytes = 8 * GiB;
  growing.blockBytes = 128 * GiB;
  EXPECT_EQ(usable(growing), 128 * GiB);
  // A container's limit caps what the machine has, and no more.
  HostMemoryReadings container;
  container.physicalBytes = 24 * GiB;
  container.cgroupLimit = 4 * GiB;
  EXPECT_EQ(usable(container), 4 * GiB);
  container.cgroupLimit = 128 * GiB;
  EXPECT_EQ(usable(container), 24 * GiB);
  for (auto [text, bytes] :
       {std::pair<const char *, uint64_t>{"1000", 1000}, {"128GiB", 128 * GiB},
        {"1.5TB", 1500000000000ull}, {" 2 TiB ", 2048 * GiB}, {"64 GB", 64000000000ull},
        {"0", 0}, {"lots", 0}, {"GiB", 0}, {"99999999999999TiB", 0}}) {
    SCOPED_TRACE(text);
    HostMemoryReadings given;
    given.physicalBytes = 24 * GiB;
    given.cgroupLimit = 128 * GiB;
    given.override = std::string(text);
    llvm::Expected<uint64_t> got = usableHostMemoryBytes(given);
    if (bytes) {
      ASSERT_TRUE(!!got) << llvm::toString(got.takeError());
      EXPECT_EQ(*got, bytes);
    } else {
      ASSERT_FALSE(!!got);
      EXPECT_NE(llvm::toString(got.takeError()).find("is not a size"),
                std::string::npos);
    }
  }
}

TEST(HostMemory, ThisMachineHasSome) {
  HostMemoryReadings r = readHostMemory();
  EXPECT_GT(r.physicalBytes, 0u);
  if (r.blockBytes) { // the online blocks hold MemTotal and more
    EXPECT_GE(*r.blockBytes, r.physicalBytes / 2);
  }
}
