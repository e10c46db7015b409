"""kiln.dsl: the recipe and model language — grammar, parser, located AST, semantic checks, loader.

    loaded = load_recipe("examples/llama3_8b.dsl")   # checked: every error is a SourceError with file:line:col
    loaded.model, loaded.config                      # the ModelDecl and its instantiated config
"""
from kiln.dsl.check import check_model, check_module, check_recipe
from kiln.dsl.errors import KilnError, Loc, SourceError
from kiln.dsl.evaluate import apply_binop, eval_config, eval_expr
from kiln.dsl.loader import LoadedRecipe, bundled_models_dir, load_file, load_recipe
from kiln.dsl.parser import parse

__all__ = [
    "KilnError",
    "LoadedRecipe",
    "Loc",
    "SourceError",
    "bundled_models_dir",
    "check_model",
    "check_module",
    "check_recipe",
    "eval_config",
    "apply_binop",
    "eval_expr",
    "load_file",
    "load_recipe",
    "parse",
]
