//===- PipelineOptions.h - The planning options and what follows -*- C++ -*-===//
//
// The planning options are declared once, in PipelineOptions.def; this
// header derives from those lines what the rest of the compiler reads:
//
//  - PlanningOptions: their values, plain and copyable (what megaslide-plan,
//    the C API and Python fill in; planModel's input);
//  - forEachOption: every option with its name, help, pass option and flag,
//    for code that treats them alike (flags, C API keys, listings);
//  - PipelineOption<&PlanningOptions::field>: the option, declared in the
//    pass that reads it, under its pass option name and with the one
//    default and help;
//  - setPlanningOptions: the typed setter of every option a pass declares,
//    which the pipelines (lib/Pipelines/Pipelines.cpp) call on each pass
//    they add, so that no builder restates an option and no value goes
//    through text;
//  - OptionEnum<E> and EnumOptionParser<E>: the cases of an enum option
//    as cl values, with errors that name the choices;
//  - arenaBudget: the device arena's share of the GPU budget.
//
// Values are typed where they are given: sizes are ByteSize or ByteBudget
// (Support/Units.h), parsed by the flags, the C API and llvm::cl, so a bad
// value is an error that names the option there.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H
#define MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H

#include "dialects/Schedule/SchedulePolicies.h"
#include "megaslide/Support/Units.h"

#include "mlir/Pass/Pass.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/CommandLine.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace megaslide {

enum class AttentionKind { Dsa, Global };

/// The cases of an enum option: values(), name(value) and help(value).
template <typename E> struct OptionEnum;

template <> struct OptionEnum<AttentionKind> {
  static llvm::SmallVector<AttentionKind> values() {
    return {AttentionKind::Dsa, AttentionKind::Global};
  }
  static llvm::StringRef name(AttentionKind kind) {
    return kind == AttentionKind::Dsa ? "dsa" : "global";
  }
  static llvm::StringRef help(AttentionKind kind) {
    return kind == AttentionKind::Dsa ? "3D Deformable Slide Attention"
                                      : "keep global attention";
  }
};

template <> struct OptionEnum<schedule::ActivationPolicy> {
  static auto values() { return schedule::activationPolicies(); }
  static llvm::StringRef name(schedule::ActivationPolicy p) {
    return schedule::stringifyEnum(p);
  }
  static llvm::StringRef help(schedule::ActivationPolicy p) {
    return schedule::describe(p);
  }
};
template <> struct OptionEnum<schedule::HostStatePolicy> {
  static auto values() { return schedule::hostStatePolicies(); }
  static llvm::StringRef name(schedule::HostStatePolicy p) {
    return schedule::stringifyEnum(p);
  }
  static llvm::StringRef help(schedule::HostStatePolicy p) {
    return schedule::describe(p);
  }
};

template <> struct OptionEnum<schedule::UpdatePolicy> {
  static auto values() { return schedule::updatePolicies(); }
  static llvm::StringRef name(schedule::UpdatePolicy p) {
    return schedule::stringifyEnum(p);
  }
  static llvm::StringRef help(schedule::UpdatePolicy p) {
    return schedule::describe(p);
  }
};
template <> struct OptionEnum<schedule::EmaPolicy> {
  static auto values() { return schedule::emaPolicies(); }
  static llvm::StringRef name(schedule::EmaPolicy p) {
    return schedule::stringifyEnum(p);
  }
  static llvm::StringRef help(schedule::EmaPolicy p) {
    return schedule::describe(p);
  }
};

/// The case named `name`, if any.
template <typename E> std::optional<E> parseOptionEnum(llvm::StringRef name) {
  for (E value : OptionEnum<E>::values())
    if (OptionEnum<E>::name(value) == name)
      return value;
  return std::nullopt;
}

/// The case names joined by `separator` ("keep, recompute, ...").
template <typename E>
std::string optionEnumNames(llvm::StringRef separator = ", ") {
  std::string names;
  for (E value : OptionEnum<E>::values())
    names += (names.empty() ? "" : separator.str()) +
             OptionEnum<E>::name(value).str();
  return names;
}

/// "unknown value 'x'; use one of a, b, c": the message every entry point
/// gives for a bad enum value.
template <typename E> std::string unknownOptionValue(llvm::StringRef value) {
  return "unknown value '" + value.str() + "'; use one of " +
         optionEnumNames<E>();
}

/// The cl parser of an enum option: its cases as literal values (listed
/// by --help), and an error naming them.
template <typename E> struct EnumOptionParser : llvm::cl::parser<E> {
  using llvm::cl::parser<E>::parser;
  void initialize() {
    for (E value : OptionEnum<E>::values())
      this->addLiteralOption(OptionEnum<E>::name(value), value,
                             OptionEnum<E>::help(value));
  }
  bool parse(llvm::cl::Option &option, llvm::StringRef argName,
             llvm::StringRef arg, E &value) {
    if (std::optional<E> parsed = parseOptionEnum<E>(arg)) {
      value = *parsed;
      return false;
    }
    return option.error(unknownOptionValue<E>(arg), argName);
  }
  /// How pass pipelines print the value.
  static void print(llvm::raw_ostream &os, E value) {
    os << OptionEnum<E>::name(value);
  }
};

template <typename T>
using OptionParserFor =
    std::conditional_t<std::is_enum_v<T>, EnumOptionParser<T>,
                       mlir::detail::PassOptions::OptionParser<T>>;

/// The values of the planning options; defaults as declared.
struct PlanningOptions {
#define MEGASLIDE_OPTION(FIELD, TYPE, NAME, INIT, HELP, PASS, FLAG)           \
  TYPE FIELD = INIT;
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  std::vector<int64_t> FIELD;
#include "megaslide/Pipelines/PipelineOptions.def"
};

/// What the rest of the tree knows of an option besides its value.
struct OptionInfo {
  llvm::StringRef name;       ///< pipeline option (megaslide-opt)
  llvm::StringRef help;
  llvm::StringRef passOption; ///< its name in the passes that read it
  llvm::StringRef flag;       ///< megaslide-plan flag; "" if none
  /// The C API and Python key: the name with '_' for '-'.
  std::string key() const {
    std::string k = name.str();
    std::replace(k.begin(), k.end(), '-', '_');
    return k;
  }
};

/// Calls `fn(info, field)` for every option in declaration order, where
/// `field` is `options`' member for it (a value of PlanningOptions, an
/// option of PipelineOptions).
template <typename Options, typename Fn>
void forEachOption(Options &options, Fn &&fn) {
#define MEGASLIDE_OPTION(FIELD, TYPE, NAME, INIT, HELP, PASS, FLAG)           \
  fn(OptionInfo{NAME, HELP, PASS, FLAG}, options.FIELD);
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  fn(OptionInfo{NAME, HELP, PASS, FLAG}, options.FIELD);
#include "megaslide/Pipelines/PipelineOptions.def"
}

/// A value as pass-option text (what `megaslide-opt --megaslide-pipeline=`
/// reads; the listing's defaults, the bucket cache key).
template <typename T> std::string printOptionValue(const T &value) {
  if constexpr (std::is_enum_v<T>) {
    return OptionEnum<T>::name(value).str();
  } else if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_base_of_v<ByteSize, T>) {
    std::string text;
    llvm::raw_string_ostream os(text);
    llvm::cl::parser<T>::print(os, value);
    return text;
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    std::string text;
    for (int64_t v : value)
      text += (text.empty() ? "" : ",") + std::to_string(v);
    return text;
  } else {
    return std::to_string(value);
  }
}

/// The declaration of the option stored in `Member`.
template <auto Member> struct OptionDecl;
#define MEGASLIDE_OPTION(FIELD, TYPE, NAME, INIT, HELP, PASS, FLAG)           \
  template <> struct OptionDecl<&PlanningOptions::FIELD> {                    \
    using Type = TYPE;                                                         \
    static constexpr bool isTriple = false;                                    \
    static constexpr const char *name = NAME, *passOption = PASS,              \
                                *help = HELP;                                  \
    static Type init() { return INIT; }                                        \
  };
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  template <> struct OptionDecl<&PlanningOptions::FIELD> {                    \
    static constexpr bool isTriple = true;                                     \
    static constexpr const char *name = NAME, *passOption = PASS,              \
                                *help = HELP;                                  \
  };
#include "megaslide/Pipelines/PipelineOptions.def"

namespace detail {
/// A planning option as a pass declares it, seen from the pipelines.
class PlanningOptionSlot {
public:
  virtual ~PlanningOptionSlot() = default;
  /// The pipeline option's name ("gpu-mem").
  virtual llvm::StringRef optionName() const = 0;
  /// Sets the pass's option to the value in `values`.
  virtual void setFrom(const PlanningOptions &values) = 0;
};

/// The slots of the live passes, by pass: a PipelineOption adds itself when
/// its pass is made (or cloned) and removes itself when it is destroyed.
/// mlir::Pass looks its options up only by text, so the typed setters are
/// found here. Passes are made on any thread (two plans at once from
/// Python), hence the lock.
class PlanningOptionSlots {
public:
  /// Never destroyed, so that a pass destroyed during static destruction
  /// still finds it.
  static PlanningOptionSlots &get() {
    static auto *slots = new PlanningOptionSlots;
    return *slots;
  }
  void add(const mlir::Pass &pass, PlanningOptionSlot &slot) {
    std::lock_guard<std::mutex> lock(mutex);
    byPass[&pass].push_back(&slot);
  }
  void remove(const mlir::Pass &pass, PlanningOptionSlot &slot) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = byPass.find(&pass);
    if (it == byPass.end())
      return;
    llvm::erase(it->second, &slot);
    if (it->second.empty())
      byPass.erase(it);
  }
  /// The slots of `pass`, in the order it declares them.
  llvm::SmallVector<PlanningOptionSlot *> of(const mlir::Pass &pass) {
    std::lock_guard<std::mutex> lock(mutex);
    return byPass.lookup(&pass);
  }

private:
  std::mutex mutex;
  llvm::DenseMap<const mlir::Pass *, llvm::SmallVector<PlanningOptionSlot *>>
      byPass;
};
} // namespace detail

/// Sets every planning option `pass` declares (PipelineOption) to its value
/// in `values`, typed: nothing is printed and parsed again, so nothing can
/// fail.
inline void setPlanningOptions(mlir::Pass &pass,
                               const PlanningOptions &values) {
  for (detail::PlanningOptionSlot *slot :
       detail::PlanningOptionSlots::get().of(pass))
    slot->setFrom(values);
}

/// Whether `pass` declares the planning option `name` (the listing's
/// "read by").
inline bool declaresPlanningOption(const mlir::Pass &pass,
                                   llvm::StringRef name) {
  return llvm::any_of(detail::PlanningOptionSlots::get().of(pass),
                      [&](detail::PlanningOptionSlot *slot) {
                        return slot->optionName() == name;
                      });
}

/// A planning option in the pass that reads it, e.g.
///   PipelineOption<&PlanningOptions::gpuMemory> gpuMemory{*this};
/// The pass needs a copy constructor that copies no option (as any pass
/// with options in C++); the pipelines set its value by name.
template <auto Member, bool = OptionDecl<Member>::isTriple>
struct PipelineOption;

template <auto Member>
struct PipelineOption<Member, false>
    : mlir::Pass::Option<typename OptionDecl<Member>::Type,
                         OptionParserFor<typename OptionDecl<Member>::Type>>,
      detail::PlanningOptionSlot {
  using Decl = OptionDecl<Member>;
  using Base = mlir::Pass::Option<typename Decl::Type,
                                  OptionParserFor<typename Decl::Type>>;
  explicit PipelineOption(mlir::Pass &pass)
      : Base(pass, Decl::passOption, llvm::cl::desc(Decl::help),
             llvm::cl::init(Decl::init())),
        pass(pass) {
    detail::PlanningOptionSlots::get().add(pass, *this);
  }
  ~PipelineOption() override {
    detail::PlanningOptionSlots::get().remove(pass, *this);
  }
  using Base::operator=;

  llvm::StringRef optionName() const override { return Decl::name; }
  void setFrom(const PlanningOptions &values) override {
    *this = values.*Member;
  }

private:
  const mlir::Pass &pass;
};

template <auto Member>
struct PipelineOption<Member, true> : mlir::Pass::ListOption<int64_t>,
                                      detail::PlanningOptionSlot {
  using Decl = OptionDecl<Member>;
  explicit PipelineOption(mlir::Pass &pass)
      : mlir::Pass::ListOption<int64_t>(pass, Decl::passOption,
                                        llvm::cl::desc(Decl::help)),
        pass(pass) {
    detail::PlanningOptionSlots::get().add(pass, *this);
  }
  ~PipelineOption() override {
    detail::PlanningOptionSlots::get().remove(pass, *this);
  }
  using mlir::Pass::ListOption<int64_t>::operator=;

  llvm::StringRef optionName() const override { return Decl::name; }
  void setFrom(const PlanningOptions &values) override {
    *this = llvm::ArrayRef<int64_t>(values.*Member);
  }

private:
  const mlir::Pass &pass;
};

/// What the device arena may use: the GPU budget less what the runtime
/// keeps for itself (`gpu-reserve`; all of it when the reserve is larger).
/// Planning, the budget check and the report all take it from here.
inline uint64_t arenaBudget(const ByteSize &gpuMemory,
                            const ByteSize &gpuReserve) {
  return gpuMemory.bytes() - std::min(gpuMemory.bytes(), gpuReserve.bytes());
}

/// The OS and runtime allowance of `os-allowance auto` on a host of
/// `hostMemory` bytes: 1/16 of it, at least 4 GB (a minimal OS, the CUDA
/// driver and the runtime's heap) and at most 64 GB (a large host's page
/// cache and daemons need no more), so a 64 GB host keeps 4 GB, a 512 GB
/// one 32 GB and one of 1 TB or more 64 GB (docs/MemoryAccounting.md).
inline uint64_t osAllowanceFor(uint64_t hostMemory) {
  constexpr uint64_t kMin = 4'000'000'000, kMax = 64'000'000'000;
  return std::clamp<uint64_t>(hostMemory / 16, kMin, kMax);
}

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H
