// Two toy dialects with the fields megaslide-tblgen reads from ODS (Op's
// opDialect and opName, Dialect's name) and the PlanOp mix-in. The -D
// macros add one mistake each.

include "dialects/PlanOp.td"

class Dialect {
  string name;
}
class Op<Dialect dialect, string mnemonic> {
  Dialect opDialect = dialect;
  string opName = mnemonic;
}

def Toy_Dialect : Dialect {
  let name = "toy";
}
class Toy_Op<string mnemonic> : Op<Toy_Dialect, mnemonic>, PlanOp<"TOY"> {
  let costKind = "Device";
  let kernelFamily = "Elementwise";
}

def Box_Dialect : Dialect {
  let name = "box";
}
class Box_Op<string mnemonic> : Op<Box_Dialect, mnemonic>, PlanOp<"BOX"> {
  let kernelFamily = "None";
}

def Toy_DeclareOp : Toy_Op<"declare"> {
  let notInPlans = "a declaration";
}
def Toy_MatmulWithAVeryLongNameOp : Toy_Op<"matmul_with_a_very_long_name"> {
  let kernelFamily = "Gemm";
}
def Box_CopyOp : Box_Op<"copy"> {
  let costKind = "HostToDevice";
}
def Toy_ReadOp : Toy_Op<"read"> {
  let notInPlans = "replaced by box ops in a pass that has a long name, so "
                   "that this reason needs two lines";
}
def Toy_WriteOp : Toy_Op<"write"> {
  let notInPlans = Toy_ReadOp.notInPlans;
}

#ifdef NO_COST
def Box_WaitOp : Box_Op<"wait">;
#endif

#ifdef SAME_SPELLING
def Box_DeclareOp : Box_Op<"matmul_with_a_very_long_name"> {
  let costKind = "None";
}
#endif

#ifdef SAME_NAME
def Toy_CopyOp : Toy_Op<"copy_again">;
#endif
