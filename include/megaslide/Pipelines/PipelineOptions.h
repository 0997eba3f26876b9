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
//  - OptionEnum<E> and EnumOptionParser<E>: the cases of an enum option
//    as cl values, with errors that name the choices.
//
// The pipelines hand each pass the options it declares by name
// (lib/Pipelines/Pipelines.cpp), so no builder restates them.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H
#define MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H

#include "megaslide/Dialect/Schedule/SchedulePolicies.h"

#include "mlir/Pass/Pass.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/CommandLine.h"

#include <algorithm>
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

/// A value as pass-option text (what a pass's initializeOptions reads).
template <typename T> std::string printOptionValue(const T &value) {
  if constexpr (std::is_enum_v<T>) {
    return OptionEnum<T>::name(value).str();
  } else if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return value.find(' ') == std::string::npos ? value : "{" + value + "}";
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
    static constexpr const char *passOption = PASS, *help = HELP;              \
    static Type init() { return INIT; }                                        \
  };
#define MEGASLIDE_TRIPLE_OPTION(FIELD, NAME, HELP, PASS, FLAG)                \
  template <> struct OptionDecl<&PlanningOptions::FIELD> {                    \
    static constexpr bool isTriple = true;                                     \
    static constexpr const char *passOption = PASS, *help = HELP;              \
  };
#include "megaslide/Pipelines/PipelineOptions.def"

/// A planning option in the pass that reads it, e.g.
///   PipelineOption<&PlanningOptions::gpuMemory> gpuMemory{*this};
/// The pass needs a copy constructor that copies no option (as any pass
/// with options in C++); the pipelines set its value by name.
template <auto Member, bool = OptionDecl<Member>::isTriple>
struct PipelineOption;

template <auto Member>
struct PipelineOption<Member, false>
    : mlir::Pass::Option<typename OptionDecl<Member>::Type,
                         OptionParserFor<typename OptionDecl<Member>::Type>> {
  using Decl = OptionDecl<Member>;
  using Base = mlir::Pass::Option<typename Decl::Type,
                                  OptionParserFor<typename Decl::Type>>;
  explicit PipelineOption(mlir::Pass &pass)
      : Base(pass, Decl::passOption, llvm::cl::desc(Decl::help),
             llvm::cl::init(Decl::init())) {}
  using Base::operator=;
};

template <auto Member>
struct PipelineOption<Member, true> : mlir::Pass::ListOption<int64_t> {
  using Decl = OptionDecl<Member>;
  explicit PipelineOption(mlir::Pass &pass)
      : mlir::Pass::ListOption<int64_t>(pass, Decl::passOption,
                                        llvm::cl::desc(Decl::help)) {}
  using mlir::Pass::ListOption<int64_t>::operator=;
};

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_PIPELINEOPTIONS_H
