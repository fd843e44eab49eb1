import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models helpers

from tiny_models import make_model_folder  # noqa: E402


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(kind) -> folder of a tiny random HF model (built once per kind per session)."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def make(kind):
        if kind not in cache:
            cache[kind] = make_model_folder(kind, root)
        return cache[kind]

    return make
