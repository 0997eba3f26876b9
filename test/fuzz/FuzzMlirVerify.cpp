//===- FuzzMlirVerify.cpp - Fuzz target: parse and verify MLIR -------------===//
//
// megaslide-opt's first job on arbitrary bytes: parse them as MLIR with the
// graph (`megaslide`), schedule (`msched`) and func dialects registered and
// run the verifier, so every custom parser, printer and verifier of the two
// dialects sees hostile IR. IR that verifies must then round-trip as the
// lit tests assume (`megaslide-opt %s | megaslide-opt`): its custom form
// and its generic form parse and verify again, and the custom form prints
// the same text the second time. A crash, a sanitizer report or a failed
// round trip (abort) is a bug.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OperationSupport.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"

#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <cstdlib>
#include <string>

static mlir::DialectRegistry &registry() {
  static mlir::DialectRegistry *r = [] {
    auto *reg = new mlir::DialectRegistry();
    reg->insert<megaslide::graph::GraphDialect,
                megaslide::schedule::ScheduleDialect, mlir::func::FuncDialect>();
    return reg;
  }();
  return *r;
}

static std::string print(mlir::Operation *op, bool generic) {
  std::string text;
  llvm::raw_string_ostream os(text);
  mlir::OpPrintingFlags flags;
  if (generic)
    flags.printGenericOpForm();
  op->print(os, flags);
  return text;
}

/// Parses `text`, verifying; on failure reports why and aborts.
static mlir::OwningOpRef<mlir::ModuleOp>
reparse(mlir::MLIRContext &context, llvm::StringRef text, const char *what) {
  std::string diagnostics;
  mlir::OwningOpRef<mlir::ModuleOp> module;
  {
    mlir::ScopedDiagnosticHandler capture(
        &context, [&](mlir::Diagnostic &diag) {
          diagnostics += diag.str() + "\n";
          return mlir::success();
        });
    module = mlir::parseSourceString<mlir::ModuleOp>(
        text, mlir::ParserConfig(&context), what);
  }
  if (!module) {
    llvm::errs() << "fuzz-mlir-verify: the " << what
                 << " form of IR that verified does not parse back:\n"
                 << diagnostics << "--- " << what << " form:\n"
                 << text << "\n";
    abort();
  }
  return module;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  // MLIR's lexer finds the end of its buffer by the NUL after it, which
  // megaslide-opt's MemoryBuffer provides and a libFuzzer input does not.
  std::string owned(reinterpret_cast<const char *>(data), size);
  llvm::StringRef text(owned.c_str(), size);
  // One context per input: nothing an input uniques leaks into the next.
  mlir::MLIRContext context(registry(), mlir::MLIRContext::Threading::DISABLED);
  mlir::OwningOpRef<mlir::ModuleOp> module;
  {
    // Diagnostics of rejected inputs are expected: drop them.
    mlir::ScopedDiagnosticHandler quiet(
        &context, [](mlir::Diagnostic &) { return mlir::success(); });
    module = mlir::parseSourceString<mlir::ModuleOp>(
        text, mlir::ParserConfig(&context, /*verifyAfterParse=*/false),
        "fuzz.mlir");
    if (!module || mlir::failed(mlir::verify(*module)))
      return 0;
  }

  std::string custom = print(*module, /*generic=*/false);
  mlir::OwningOpRef<mlir::ModuleOp> fromCustom =
      reparse(context, custom, "custom");
  mlir::OwningOpRef<mlir::ModuleOp> fromGeneric =
      reparse(context, print(*module, /*generic=*/true), "generic");
  std::string again = print(*fromCustom, /*generic=*/false);
  if (again != custom) {
    llvm::errs() << "fuzz-mlir-verify: the custom form does not print back "
                    "the same:\n--- first:\n"
                 << custom << "\n--- second:\n"
                 << again << "\n";
    abort();
  }
  return 0;
}
