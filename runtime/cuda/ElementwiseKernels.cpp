//===- ElementwiseKernels.cpp - CUDA C++ of the dense graph ops -----------===//

#include "megaslide/runtime/cuda/ElementwiseKernels.h"

#include "megaslide/Support/EmbeddedFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <cassert>
#include <cstring>
#include <set>
#include <tuple>

namespace megaslide::cuda {

#include "ElementwiseKernelsSource.inc"

using exec::DType;

namespace {

/// The kernels' device code (device/Elementwise.cuh, device/Attention.cuh),
/// compiled in as text: one text per file, in order.
const EmbeddedFile kDeviceFiles[] = {
#include "megaslide/runtime/cuda/DenseDeviceText.inc"
};

//===----------------------------------------------------------------------===//
// Parameter lists
//===----------------------------------------------------------------------===//

struct Param {
  char kind; ///< i, o, f, F, l, s, d, u, q (ElementwiseKernelsSource.inc)
  int type = -1;
  std::string name;
};

std::vector<Param> parseParams(llvm::StringRef text) {
  std::vector<Param> params;
  llvm::SmallVector<llvm::StringRef> items;
  text.split(items, ',');
  for (llvm::StringRef item : items) {
    item = item.trim();
    auto [head, name] = item.split(' ');
    Param p;
    p.kind = head.front();
    if (head.size() > 1)
      p.type = head[1] - '0';
    p.name = name.trim().str();
    params.push_back(p);
  }
  return params;
}

const KernelBody *findBody(llvm::StringRef kind) {
  for (const KernelBody &b : kKernelBodies)
    if (kind == b.kind)
      return &b;
  return nullptr;
}

const char *cudaTypeName(DType t) {
  switch (t) {
  case DType::BF16:
    return "ms_bf16";
  case DType::F16:
    return "ms_f16";
  case DType::F32:
    return "float";
  case DType::I32:
    return "int";
  case DType::I64:
    return "long long";
  }
  return "void";
}

/// The C type of a parameter, with `T<N>` spelled `typeName(N)`.
template <typename TypeName>
std::string paramType(const Param &p, TypeName typeName) {
  switch (p.kind) {
  case 'i':
    return "const " + typeName(p.type) + " *";
  case 'o':
    return typeName(p.type) + " *";
  case 'f':
    return "const float *";
  case 'F':
    return "float *";
  case 'l':
    return "long long";
  case 's':
    return "float";
  case 'd':
    return "double";
  case 'u':
    return "unsigned";
  case 'q':
    return "msDivisor";
  }
  return "void";
}

/// `type name`, without a space after a pointer's star.
std::string declare(const std::string &type, const std::string &name) {
  return type + (type.back() == '*' ? "" : " ") + name;
}

} // namespace

//===----------------------------------------------------------------------===//
// Instances and source
//===----------------------------------------------------------------------===//

uint64_t fastDivisor(int64_t d) {
  assert(d >= 1 && d <= kMaxKernelElements && "divisor out of range");
  unsigned shift = 0;
  while ((uint64_t(1) << shift) < uint64_t(d))
    ++shift;
  uint64_t magic = (uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1;
  return uint64_t(d) << 32 | (magic & 0xffffffffu);
}

std::string KernelInstance::name() const {
  std::string s = "ms_" + kind;
  for (DType t : types)
    s += std::string("_") + exec::dtypeName(t);
  return s;
}

bool KernelInstance::operator<(const KernelInstance &o) const {
  return std::tie(kind, types) < std::tie(o.kind, o.types);
}

bool KernelInstance::operator==(const KernelInstance &o) const {
  return kind == o.kind && types == o.types;
}

llvm::ArrayRef<KernelKindInfo> elementwiseKernelKinds() {
  static const std::vector<KernelKindInfo> kinds = [] {
    std::vector<KernelKindInfo> k;
    for (const KernelBody &b : kKernelBodies)
      k.push_back({b.kind, b.numTypes, b.threads, b.tensorCore});
    return k;
  }();
  return kinds;
}

unsigned kernelBlockThreads(llvm::StringRef name) {
  // The longest kind the name starts with: attention_fwd_tc64 over
  // attention_fwd.
  const KernelBody *best = nullptr;
  for (const KernelBody &b : kKernelBodies) {
    std::string prefix = std::string("ms_") + b.kind + "_";
    if (name.starts_with(prefix) &&
        (!best || std::strlen(b.kind) > std::strlen(best->kind)))
      best = &b;
  }
  return best ? best->threads : kElementwiseBlockThreads;
}

std::vector<std::string> kernelParameterTypes(const KernelInstance &kernel) {
  const KernelBody *body = findBody(kernel.kind);
  if (!body || (int)kernel.types.size() != body->numTypes)
    return {};
  std::vector<std::string> types;
  for (const Param &p : parseParams(body->params))
    types.push_back(paramType(
        p, [&](int i) { return std::string(cudaTypeName(kernel.types[i])); }));
  return types;
}

std::string emitElementwiseSource(llvm::ArrayRef<KernelInstance> kernels) {
  std::set<KernelInstance> unique(kernels.begin(), kernels.end());
  std::string out;
  llvm::raw_string_ostream os(out);
  os << "// MegaSlide dense graph-op kernels (runtime/cuda/"
        "ElementwiseKernels.cpp).\n// "
     << unique.size() << " instances; fp32 arithmetic, bf16/f16/f32 storage; "
     << kElementwiseBlockThreads
     << " threads per block (attention on tensor cores: "
     << kAttentionTcBlockThreads << ").\n";
  for (const EmbeddedFile &file : kDeviceFiles)
    os << file.text;
  for (const KernelBody &b : kKernelBodies) {
    std::vector<Param> params = parseParams(b.params);
    os << "\ntemplate <";
    for (int i = 0; i < b.numTypes; ++i)
      os << (i ? ", " : "") << "typename T" << i;
    os << ">\n__device__ __forceinline__ void ms_" << b.kind << "_impl(";
    for (auto [i, p] : llvm::enumerate(params))
      os << (i ? ", " : "")
         << declare(paramType(p, [](int t) { return "T" + std::to_string(t); }),
                    p.name);
    os << ") {" << b.body << "}\n";
  }
  os << "\n";
  for (const KernelInstance &k : unique) {
    const KernelBody *b = findBody(k.kind);
    if (!b || (int)k.types.size() != b->numTypes)
      continue;
    std::vector<Param> params = parseParams(b->params);
    std::vector<std::string> types = kernelParameterTypes(k);
    os << "extern \"C\" __global__ void __launch_bounds__(" << b->threads
       << ")\n"
       << k.name() << "(";
    for (size_t i = 0; i < params.size(); ++i)
      os << (i ? ", " : "") << declare(types[i], params[i].name);
    os << ") {\n  ms_" << k.kind << "_impl<";
    for (auto [i, t] : llvm::enumerate(k.types))
      os << (i ? ", " : "") << cudaTypeName(t);
    os << ">(";
    for (size_t i = 0; i < params.size(); ++i)
      os << (i ? ", " : "") << params[i].name;
    os << ");\n}\n";
  }
  return out;
}

std::vector<KernelInstance> representativeKernelInstances() {
  std::vector<KernelInstance> all;
  for (const KernelBody &b : kKernelBodies) {
    bool ids = llvm::StringRef(b.kind).starts_with("embedding");
    if (b.tensorCore) {
      // bf16 at every head dim (the kind carries it); f16 and an f32
      // output at 64 and 128 only: compiling all would double the test's
      // NVRTC time for the same code.
      llvm::StringRef kind(b.kind);
      bool wide = kind.ends_with("_tc64") || kind.ends_with("_tc128");
      all.push_back({b.kind, std::vector<DType>(b.numTypes, DType::BF16)});
      if (wide) {
        all.push_back({b.kind, std::vector<DType>(b.numTypes, DType::F16)});
        KernelInstance k{b.kind, std::vector<DType>(b.numTypes, DType::BF16)};
        k.types.back() = DType::F32;
        all.push_back(k);
      }
      continue;
    }
    for (DType t : {DType::BF16, DType::F16, DType::F32}) {
      KernelInstance k{b.kind, std::vector<DType>(b.numTypes, t)};
      if (ids)
        k.types[0] = t == DType::F32 ? DType::I64 : DType::I32;
      all.push_back(k);
    }
    if (b.numTypes > 1) {
      // bf16 in, f32 out: the mixed precision of gradients and losses.
      KernelInstance k{b.kind, std::vector<DType>(b.numTypes, DType::BF16)};
      k.types.back() = DType::F32;
      if (ids)
        k.types[0] = DType::I64;
      all.push_back(k);
    }
  }
  return all;
}

} // namespace megaslide::cuda
