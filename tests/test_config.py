"""QuantConfig validation and the shipped recipes."""
from pathlib import Path

import pytest

from quantkit.run.config import QuantConfig, read_recipe
from quantkit.core.errors import QuantkitError

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    config = QuantConfig(**read_recipe(path))
    spec = config.spec_for("model.layers.0.mlp.down_proj")
    assert spec is None or spec.bits in (2, 3, 4, 8)
    assert config.method in ("rtn", "gptq", "awq", "awq+gptq")


def test_spec_for_applies_overrides_in_order():
    c = QuantConfig(bits=4, group_size=128, modules=[{"pattern": "down_proj", "bits": 8},
                                                     {"pattern": r"layers\.1\.", "skip": True}])
    assert c.spec_for("model.layers.0.mlp.down_proj").bits == 8
    assert c.spec_for("model.layers.0.mlp.up_proj").bits == 4
    assert c.spec_for("model.layers.1.mlp.down_proj") is None


@pytest.mark.parametrize("kwargs,words", [
    ({"bits": 5}, "--bits 5"), ({"group_size": 0}, "--group-size 0"), ({"method": "foo"}, "unknown method"),
    ({"damp": 0}, "--damp"), ({"nsamples": 0}, "--nsamples"),
    ({"modules": [{"bits": 8}]}, "pattern"), ({"modules": [{"pattern": "(", "bits": 8}]}, "not a valid regex"),
    ({"modules": [{"pattern": "x", "bitz": 8}]}, "unknown keys"),
])
def test_invalid_configs(kwargs, words):
    with pytest.raises(QuantkitError, match=words.replace("(", r"\(")):
        QuantConfig(**kwargs)
