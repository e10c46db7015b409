"""kiln.compiler: the IR, the op table, the verifier, the IR text form, and the pass API."""
from kiln.compiler.ir import Attrs, BlockSpec, Graph, Node, ParamSpec, Program, TensorType, TupleType
from kiln.compiler.pass_manager import (
    Pass,
    PassContext,
    PassError,
    PassManager,
    register_pass,
    register_pipeline,
)
from kiln.compiler.text import (
    assert_graphs_equal,
    graphs_equal,
    parse_graph,
    parse_program,
    print_graph,
    print_program,
)
from kiln.compiler.verifier import VerifyError, verify_program

__all__ = [
    "Attrs", "BlockSpec", "Graph", "Node", "ParamSpec", "Program", "TensorType", "TupleType",
    "Pass", "PassContext", "PassError", "PassManager", "register_pass", "register_pipeline",
    "assert_graphs_equal", "graphs_equal", "parse_graph", "parse_program", "print_graph", "print_program",
    "VerifyError", "verify_program",
]
