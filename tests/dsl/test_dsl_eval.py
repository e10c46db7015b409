"""The constant evaluator: operator semantics and precedence, and model config instantiation."""
import pytest
from kiln.dsl import Loc, SourceError, eval_config, eval_expr, parse
from kiln.dsl import ast as A


def value_of(text: str, env=None):
    expr = parse(f"recipe r {{ x = {text} }}", "<expr>").recipes[0].settings[0].value
    return eval_expr(expr, env or {})


@pytest.mark.parametrize("text, expected", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("10 - 3 - 2", 5), ("8 / 2 / 2", 2.0),
    ("2 ** 3 ** 2", 512), ("-2 ** 2", -4), ("2 ** -1", 0.5), ("7 // 2", 3), ("-7 // 2", -4),
    ("7 / 2", 3.5), ("7 % 3", 1), ("7.0 // 2", 3.0), ("2 * 3 % 4", 2),
    ("1 + 2 == 3", True), ("1 + 2 != 3", False), ("2 * 3 >= 6 && 1 < 2", True),
    ("true || false && false", True), ("!true || true", True), ("!(true || true)", False),
    ("1 > 2 ? 10 : 20", 20), ("true ? 1 : false ? 2 : 3", 1), ("false ? 1 : false ? 2 : 3", 3),
    ("2 * 3 > 5 ? 1 + 1 : 0", 2), ('"a" + "b" == "ab"', True), ("min(3, 1 + 1)", 2), ("ceil_div(7, 2)", 4),
    ("4096 // 32 * 8", 1024), ("1 == 1.0", True),
])
def test_operators_and_precedence(text, expected):
    value = value_of(text)
    assert value == expected and type(value) is type(expected)


def test_names_come_from_env():
    assert value_of("hidden // heads", {"hidden": 4096, "heads": 32}) == 128


@pytest.mark.parametrize("text, message, col", [
    ("1 / 0", "division by zero", 16),
    ("true + 1", "'+' needs numbers", 16),
    ("1 ? 2 : 3", "a condition must be bool", 16),
    ("nope + 1", "undefined name 'nope'", 16),
    ("1 && true", "the left side of '&&' must be bool", 16),
    ("f(1)", "'f(...)' is not a constant expression", 16),
])
def test_eval_errors_are_located(text, message, col):
    with pytest.raises(SourceError) as info:
        value_of(text)
    assert message in info.value.message
    assert (info.value.loc.line, info.value.loc.col) == (1, col)


MODEL = """\
model m(hidden: int, heads: int, kv_heads: int = heads, head_dim: int = hidden // heads,
        eps: float = 1e-5, theta: float = 10000, tie: bool = false, big: bool = hidden > 2048,
        kind: str = big ? "large" : "small", ratio: float = hidden / heads) {
  forward(x) { return x }
}
"""


def config_of(**kwargs):
    model = parse(MODEL, "m.dsl").models[0]
    args = {k: parse(f"recipe r {{ x = {v} }}", "<arg>").recipes[0].settings[0].value for k, v in kwargs.items()}
    return eval_config(model, args)


def test_eval_config_applies_defaults_in_order():
    assert config_of(hidden="4096", heads="32") == {
        "hidden": 4096, "heads": 32, "kv_heads": 32, "head_dim": 128, "eps": 1e-5, "theta": 10000.0,
        "tie": False, "big": True, "kind": "large", "ratio": 128.0}
    cfg = config_of(hidden="1024", heads="8", kv_heads="2", theta="500000", tie="true")
    assert (cfg["kv_heads"], cfg["head_dim"], cfg["kind"], cfg["tie"]) == (2, 128, "small", True)
    assert type(cfg["theta"]) is float  # an int given for a float param becomes a float


def test_eval_config_errors():
    with pytest.raises(SourceError, match="needs config parameter 'heads'"):
        config_of(hidden="4096")
    with pytest.raises(SourceError) as info:
        config_of(hidden="4096", heads="0")
    assert info.value.message == "division by zero"
    assert info.value.loc == Loc("m.dsl", 1, 73, 88)  # in the default `hidden // heads`
    with pytest.raises(SourceError, match="'heads' must be int, got float 2.5"):
        config_of(hidden="4096", heads="2.5")
    with pytest.raises(SourceError, match="has no config parameter 'nope'"):
        config_of(hidden="4096", heads="2", nope="1")


def test_eval_config_default_of_wrong_type():
    model = parse("model m(a: int, b: int = a / 2) { forward(x) { return x } }", "t.dsl").models[0]
    with pytest.raises(SourceError, match="the default of 'b' must be int, got float 2.0") as info:
        eval_config(model, {"a": A.Num(4, Loc("t.dsl", 1, 1))})
    assert info.value.loc == Loc("t.dsl", 1, 26, 31)
