"""kiln.codegen: a lowered Program -> the serving artifact (model.py, kernels, weights, manifest)."""
from kiln.codegen.artifact import SCHEMA_VERSION, build_manifest, write_artifact
from kiln.codegen.emitters import EMITTERS
from kiln.codegen.errors import CheckpointError, CodegenError, WeightError
from kiln.codegen.render import kernels_used, render_model
from kiln.codegen.weights import Checkpoint, convert_weights

__all__ = ["EMITTERS", "SCHEMA_VERSION", "Checkpoint", "CheckpointError", "CodegenError", "WeightError",
           "build_manifest", "convert_weights", "kernels_used", "render_model", "write_artifact"]
