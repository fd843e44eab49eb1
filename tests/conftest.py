import contextlib
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


@pytest.fixture
def stop_at_part(monkeypatch):
    """stop_at_part(key, stop=KeyboardInterrupt): a context in which a quantize run raises `stop` when it is about to
    save part `key` (quantkit.checkpoint.shards.save_part), as a Ctrl-C, a full disk or a kill would stop it there."""
    from quantkit.checkpoint import shards

    @contextlib.contextmanager
    def stopping(key, stop=KeyboardInterrupt):
        save = shards.save_part

        def save_or_stop(folder, k, tensors, info=None):
            if k == key:
                raise stop
            save(folder, k, tensors, info)
        with monkeypatch.context() as m:
            m.setattr(shards, "save_part", save_or_stop)
            yield
    return stopping
