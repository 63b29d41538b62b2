//! Step graphs: the op vocabulary ([`op`]), shapes ([`shape`]) and the check
//! that decodes a [`StepGraph`] and gives every value its shape. The SDK
//! checks each op as a plugin records it; the host checks the whole graph
//! again at load (it never trusts a plugin), with the same code.

pub mod op;
pub mod shape;

pub use op::{infer, Act, Attention, Binary, Experts, Op, Reduce, Rope, RopeMode, ShapeCx, Unary};
pub use shape::{broadcast, DType, Dim, Shape, Sizes};

use crate::abi::StepGraph;

/// Why a graph was refused: the node, its op and label, and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("node {node} ({op}{at}): {why}")]
pub struct GraphError {
    pub node: usize,
    pub op: String,
    /// ` at layer 3 "attn_out"`, or empty.
    pub at: String,
    pub why: String,
}

/// A decoded graph with every value's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub ops: Vec<Op>,
    pub inputs: Vec<Vec<u32>>,
    pub shapes: Vec<Shape>,
    pub output: u32,
}

fn place(label: &str, layer: i32) -> String {
    match (label.is_empty(), layer >= 0) {
        (true, false) => String::new(),
        (true, true) => format!(" at layer {layer}"),
        (false, false) => format!(" {label:?}"),
        (false, true) => format!(" at layer {layer} {label:?}"),
    }
}

/// Decode every node, check that it reads only earlier values, and infer
/// every shape. The output must be a value of the graph.
pub fn check(g: &StepGraph, cx: &ShapeCx<'_>) -> Result<Checked, GraphError> {
    let mut out = Checked { ops: Vec::with_capacity(g.nodes.len()), inputs: Vec::new(), shapes: Vec::new(), output: g.output };
    for (i, n) in g.nodes.iter().enumerate() {
        let fail = |op: &str, why: String| GraphError { node: i, op: op.to_string(), at: place(n.label.as_str(), n.layer), why };
        let op = Op::decode(n.op, &n.ints, &n.floats).map_err(|why| fail(&format!("opcode {}", n.op), why))?;
        let mut ins = Vec::with_capacity(n.inputs.len());
        for &v in n.inputs.iter() {
            if v as usize >= i {
                return Err(fail(op.name(), format!("reads value {v}, which is not made before it")));
            }
            ins.push(&out.shapes[v as usize]);
        }
        let shape = infer(&op, &ins, cx).map_err(|why| fail(op.name(), why))?;
        out.ops.push(op);
        out.inputs.push(n.inputs.to_vec());
        out.shapes.push(shape);
    }
    if g.output as usize >= g.nodes.len() {
        return Err(GraphError { node: g.output as usize, op: "output".into(), at: String::new(), why: format!("the graph has {} nodes", g.nodes.len()) });
    }
    Ok(out)
}
